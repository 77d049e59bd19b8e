"""The CPU backend: PyTorch's flash attention kernel for CPUs, which returns the log-sum-exp.

Owns: one call of ``aten._scaled_dot_product_flash_attention_for_cpu``. Knows nothing of
the plan: it is handed rows, keys and a rule (``engine.model.attention.base``). The kernel
works in blocks of its own; a causal rule becomes the dense ``[rows, keys]`` mask the
kernel takes (built once per forward, repeated per call over the folded heads), so its
scratch is not capped here (``workspace_cap_bytes`` is None): on a CPU the chunk size keeps
it small.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from engine.model.attention.base import AttentionBackend, Causal


class CpuSdpaBackend(AttentionBackend):
    name: ClassVar[str] = "cpu_sdpa"
    devices: ClassVar[frozenset[str]] = frozenset({"cpu"})

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               mask: torch.Tensor | None = None, causal: Causal | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if causal is not None:
            rows = q.shape[-2]
            dense = causal.dense().repeat(rows // causal.period, 1).view(1, 1, rows, -1)
            mask = dense if mask is None else mask + dense
        if mask is not None:
            mask = mask.to(q.dtype)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                           scale=scale)

    def describe(self) -> str:
        return "cpu_sdpa (PyTorch's flash kernel for CPUs)"
