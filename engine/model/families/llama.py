"""Llama (and SmolLM2, the embedded model): the plain decoder every other recipe departs from."""

from engine.model.families.recipe import Recipe

RECIPE = Recipe("Llama", ("llama",))
