"""The CPU backend with our own kernel for a decode step's few rows over a long run of keys.

Owns: the choice, per call, between ``engine.model.attention.native`` (built on this
machine; see its C file for why) and PyTorch's flash kernel (``CpuSdpaBackend``). Ours takes
the calls it is faster for, measured here (``docs/PERFORMANCE.md``): no mask, no causal rule,
at most ``NATIVE_MAX_ROWS`` query rows (one request's grouped heads) in bfloat16, which is
what one stream's decode step is made of. Everything else, and every float32 call (there
batched answers must equal solo ones bit for bit, and the flash kernel is what both use),
goes to the flash kernel. Runs only where the kernel builds (``runs_on``).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from engine.model.attention import native
from engine.model.attention.base import Causal
from engine.model.attention.cpu_sdpa import CpuSdpaBackend

NATIVE_MAX_ROWS = 4  # at 6 rows the flash kernel is already faster here
NATIVE_DTYPES = (torch.bfloat16,)


class CpuNativeBackend(CpuSdpaBackend):
    name: ClassVar[str] = "cpu_native"
    devices: ClassVar[frozenset[str]] = frozenset({"cpu"})

    def __init__(self) -> None:
        kernel = native.kernel()
        if kernel is None:
            raise RuntimeError(f"the native attention kernel is not available: {native.why()}")
        self.kernel = kernel

    @classmethod
    def runs_on(cls, device: torch.device) -> bool:
        return super().runs_on(device) and native.kernel() is not None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               mask: torch.Tensor | None = None, causal: Causal | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if (mask is None and causal is None and q.dtype in NATIVE_DTYPES and q.shape[-2] <= NATIVE_MAX_ROWS
                and self.kernel.fits(q, k, v)):
            return self.kernel.attend(q, k, v, scale)
        return super().attend(q, k, v, scale, mask=mask, causal=causal)

    def takes_runs(self, dtype: torch.dtype, rows: int) -> bool:
        return dtype in NATIVE_DTYPES and rows <= NATIVE_MAX_ROWS

    def cut_runs(self, runs: list[tuple[int, int]]) -> torch.Tensor:
        return native.pieces(runs)

    def attend_runs(self, q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, cut: object,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        assert isinstance(cut, torch.Tensor)
        return self.kernel.attend_runs(q, k_layer, v_layer, cut, scale)

    def describe(self) -> str:
        return ("cpu_native (our AVX-512 kernel for one request's decode rows in bfloat16; "
                "PyTorch's flash kernel for the rest)")
