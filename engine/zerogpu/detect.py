"""Whether this process runs in ZeroGPU mode: on a ZeroGPU Space, unless turned off.

``SPACES_ZERO_GPU`` is what the ``spaces`` package itself reads (its ``@spaces.GPU`` is a no-op
without it, and ``import spaces`` then starts its CUDA emulation); ``RADIX_ZEROGPU=0`` turns the
mode off on a Space. ``RADIX_ZEROGPU_MODEL`` names the model a Space loads while ``--model`` is
left at the embedded 135M one: a GPU is worth a bigger model (a 1-2B instruct model of a Llama
family with the embedded model's tokenizer). Torch-free. There is no home-made emulation: tests run the real ``spaces``
package against a stand-in of ZeroGPU's device API (``tests/zerogpu``).
"""

from __future__ import annotations

import os

OFF, SPACES = "off", "spaces"
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-1.7B-Instruct"  # SmolLM2's tokenizer, LlamaForCausalLM, 24 layers


def zerogpu_mode(env: dict[str, str] | None = None) -> str:
    """``"off"`` or ``"spaces"`` (a ZeroGPU Space, or the tests' stand-in of one)."""
    env = os.environ if env is None else env
    if env.get("RADIX_ZEROGPU", "").strip().lower() in ("0", "off", "false", "no"):
        return OFF
    if env.get("SPACES_ZERO_GPU", "").strip().lower() in ("1", "true", "yes", "t"):
        return SPACES
    return OFF


def zerogpu_model(asked: str, env: dict[str, str] | None = None) -> str:
    """The model to load on a ZeroGPU Space: ``asked`` unless it is the embedded default."""
    env = os.environ if env is None else env
    if asked != "embedded":
        return asked
    return env.get("RADIX_ZEROGPU_MODEL", "").strip() or DEFAULT_MODEL
