"""Mistral: Llama's layer; config.sliding_window, where set, holds for every layer."""

from engine.model.families.recipe import Recipe

RECIPE = Recipe("Mistral", ("mistral",), sliding_window="all")
