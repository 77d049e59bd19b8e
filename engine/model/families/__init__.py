"""The model families the exact forward knows, one file each, and their registry.

Owns: ``Recipe``, what a family's decoder layer is (norms and their offset, activation, q/k norms,
fused projections, rotary tables, sliding windows, soft-capping, embedding scale), and ``REGISTRY``,
``model_type`` (a transformers config's) to recipe. ``engine.model.decoder_parts`` reads a recipe to
find the weights; the C layers (``native_linear.c``) and the exact attention compute what it says;
the plan (``engine.model.plan``) asks ``refusal`` first. Knows nothing of requests, the cache or
the kernels themselves.

To add a family: a file here that declares its ``RECIPE`` (copy the nearest one: ``llama.py`` for a
plain decoder, ``gemma3.py`` for everything at once; ``recipe.py`` says what each field means)
and its name on one line of ``FAMILY_FILES`` below; then ``tests/engine/test_family_exact.py``
takes its tiny config (``tests/family_models.py``).
"""

from __future__ import annotations

import importlib

from engine.model.families.recipe import ACTIVATIONS, Norms, Recipe

__all__ = ["ACTIVATIONS", "FAMILIES", "FAMILY_FILES", "NEEDS", "REGISTRY", "Norms", "Recipe", "model_type", "recipe_of",
           "refusal"]

FAMILY_FILES = (  # the registry: one line a family, the name of its file here
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma2",
    "gemma3",
    "phi3",
    "olmo2",
    "olmo3",
)
FAMILIES: tuple[Recipe, ...] = tuple(importlib.import_module(f"{__name__}.{f}").RECIPE for f in FAMILY_FILES)
REGISTRY: dict[str, Recipe] = {t: r for r in FAMILIES for t in r.model_types}
NEEDS = ("a file in engine.model.families declaring its Recipe (norms, activation, q/k norms, fused "
         "projections, rotary, window, soft-caps) and one line in its registry")


def model_type(model) -> str:
    """The text decoder's ``model_type`` of a transformers model ("" where it has none)."""
    config = getattr(model, "config", None)
    if config is None:
        return ""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return str(getattr(text, "model_type", "") or getattr(config, "model_type", ""))


def recipe_of(model) -> Recipe | None:
    """The registered recipe of ``model``, or None."""
    return REGISTRY.get(model_type(model))


def refusal(model) -> str:
    """Why ``model``'s family is not one the exact forward knows ("" where it is), with what it would need."""
    if recipe_of(model) is not None:
        return ""
    kind = model_type(model) or type(model).__name__
    return (f"the family {kind!r} is not in the registry (engine.model.families knows "
            f"{', '.join(r.name for r in FAMILIES)}): it would need {NEEDS}")
