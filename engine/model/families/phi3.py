"""Phi-3: Llama's layer with q/k/v in one projection and gate/up in another, split at load (views of
their rows, no copies); config.sliding_window, where set, holds for every layer."""

from engine.model.families.recipe import Recipe

RECIPE = Recipe("Phi-3", ("phi3",), fused_qkv="qkv_proj", fused_gate_up="gate_up_proj", sliding_window="all")
