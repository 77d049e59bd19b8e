"""Attention backends: the kernels that attend query rows over one segment of pool KV.

Owns: the registry of backends, in order of preference, and ``choose_backend`` (a name, else the
first that runs on the device). The runner's backend is one decision of its execution plan
(``engine.model.plan``, which reads ``RADIX_KERNELS=attention=<name>``, alias
``RADIX_ATTENTION_BACKEND``). Knows nothing about the
pool or the plan (``engine.model.paged_attention``), which calls the backend per layer per
segment; the contract is in ``base``.

A new kernel is one new file here (a subclass of ``AttentionBackend``) and one line below:
its import and its place in ``BACKENDS`` (in order of preference: a CUDA flash kernel goes
before ``MathChunkedBackend``).
"""

from __future__ import annotations

import torch

from engine.model.attention.base import AttentionBackend, Causal
from engine.model.attention.cpu_native import CpuNativeBackend
from engine.model.attention.cpu_sdpa import CpuSdpaBackend
from engine.model.attention.math_chunked import MathChunkedBackend
from engine.types import EngineError

# In order of preference: a device takes the first one that runs on it.
BACKENDS: tuple[type[AttentionBackend], ...] = (CpuNativeBackend, CpuSdpaBackend, MathChunkedBackend)

__all__ = ["BACKENDS", "AttentionBackend", "Causal", "choose_backend"]


def choose_backend(device: torch.device, name: str | None = None) -> AttentionBackend:
    """The backend for ``device``: ``name``, else the first in ``BACKENDS`` that runs there.
    Raises ``EngineError`` for an unknown name or one that does not run on ``device``."""
    by_name = {b.name: b for b in BACKENDS}
    if name is None:
        cls = next((b for b in BACKENDS if b.runs_on(device)), None)
        if cls is None:
            raise EngineError(f"no attention backend runs on {device.type}")
    elif name not in by_name:
        raise EngineError(f"unknown attention backend {name!r}; known: {', '.join(by_name)}")
    else:
        cls = by_name[name]
        if not cls.runs_on(device):
            raise EngineError(f"the attention backend {name!r} does not run on {device.type}")
    return cls()
