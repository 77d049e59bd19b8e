"""Qwen 2 and 2.5: Llama's layer with biases on q/k/v; sliding windows where config.layer_types says."""

from engine.model.families.recipe import Recipe

RECIPE = Recipe("Qwen 2", ("qwen2",), qkv_bias=True, sliding_window="layer_types")
