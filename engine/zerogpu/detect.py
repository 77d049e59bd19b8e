"""Which GPU-call mode this process runs in: none, a real ZeroGPU Space, or the emulation.

``SPACES_ZERO_GPU`` is what the ``spaces`` package itself reads (its ``@spaces.GPU`` is a no-op
without it); ``RADIX_ZEROGPU=emulate`` runs ZeroGPU's process model on any machine (tests, and a
laptop trying the mode); ``RADIX_ZEROGPU=0`` turns the mode off on a Space. Torch-free.
"""

from __future__ import annotations

import os

OFF, SPACES, EMULATE = "off", "spaces", "emulate"


def zerogpu_mode(env: dict[str, str] | None = None) -> str:
    """``"off"``, ``"spaces"`` (a real ZeroGPU Space) or ``"emulate"``."""
    env = os.environ if env is None else env
    asked = env.get("RADIX_ZEROGPU", "").strip().lower()
    if asked in ("emulate", "emulation"):
        return EMULATE
    if asked in ("0", "off", "false", "no"):
        return OFF
    if env.get("SPACES_ZERO_GPU", "").strip().lower() in ("1", "true", "yes"):
        return SPACES
    return OFF
