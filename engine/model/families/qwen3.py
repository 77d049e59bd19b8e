"""Qwen 3: Llama's layer with an RMSNorm over each query and key head before the rotary embedding."""

from engine.model.families.recipe import Recipe

RECIPE = Recipe("Qwen 3", ("qwen3",), qk_norm="head", sliding_window="layer_types")
