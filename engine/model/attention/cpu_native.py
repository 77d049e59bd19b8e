"""The CPU backend with our own kernel for a decode step's rows over a long run of keys.

Owns: the choice, per call, between ``engine.model.attention.native`` (built on this
machine; see its C file for why) and PyTorch's flash kernel (``CpuSdpaBackend``). Ours takes
the calls it is faster for, measured here (``docs/PERFORMANCE.md``), in float32 and bfloat16
with no mask and no causal rule: up to ``NATIVE_MAX_ROWS`` query rows (one request's grouped
heads: one stream's decode step) on any CPU with AVX2 or AVX-512, and up to ``AMX_MAX_ROWS``
of bfloat16 (a decode step of up to 21 streams sharing a prefix, or a short question's chunk
over it) where the CPU has AMX or AVX512-BF16 (Zen 4: 2.2-3.2x the flash kernel's speed at 24-64
rows over 2,300-6,000 keys), and as many of float32 where it has AVX-512 (every product kept in
float32). Everything else goes to the flash kernel. Both compute in float32 (ours rounds nothing
in float32; its error against float64 is below the flash kernel's,
``tests/engine/test_native_attention.py``), so batched answers still equal lone runs. Runs only
where the kernel builds (``runs_on``).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from engine.model.attention import native
from engine.model.attention.base import Causal
from engine.model.attention.cpu_sdpa import CpuSdpaBackend

# The most rows ours takes without AMX, per vector layer, measured on pool-sized KV: on AVX-512
# the flash kernel is faster from a few rows; on AVX2 ours stays faster up to its limit
# (native.MAX_ROWS).
NATIVE_MAX_ROWS = {"AVX-512": 4, "AVX2": native.MAX_ROWS}
NATIVE_DTYPES = (torch.float32, torch.bfloat16)


class CpuNativeBackend(CpuSdpaBackend):
    name: ClassVar[str] = "cpu_native"
    devices: ClassVar[frozenset[str]] = frozenset({"cpu"})

    def __init__(self) -> None:
        kernel = native.kernel()
        if kernel is None:
            raise RuntimeError(f"the native attention kernel is not available: {native.why()}")
        self.kernel = kernel
        self.few_rows = NATIVE_MAX_ROWS.get(kernel.simd, 4)

    @classmethod
    def runs_on(cls, device: torch.device) -> bool:
        return super().runs_on(device) and native.kernel() is not None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               mask: torch.Tensor | None = None, causal: Causal | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if mask is None and causal is None:
            if self.takes_rows(q.dtype, q.shape[-2], q.shape[-1]) and self.kernel.fits(q, k, v):
                return self.kernel.attend(q, k, v, scale)
            if q.dim() == 4 and q.shape[2] > native.AMX_MAX_ROWS and self.kernel.many_rows_for(q.dtype, q.shape[-1]):
                parts = [q[:, :, i:i + native.AMX_MAX_ROWS] for i in range(0, q.shape[2], native.AMX_MAX_ROWS)]
                if all(self.kernel.fits(part, k, v) for part in parts):
                    return self._in_parts(parts, k, v, scale)
        return super().attend(q, k, v, scale, mask=mask, causal=causal)

    def _in_parts(self, parts: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """More rows than one call takes (a question's prefill chunk over the prefix it shares:
        its tokens times the grouped heads) in calls of ``AMX_MAX_ROWS`` rows: each row attends on
        its own, so the parts' results side by side are the whole call's (2.4x the flash kernel's
        speed at 64 rows over 6,000 keys on the Zen 4)."""
        outs, lses = zip(*(self.kernel.attend(part, k, v, scale) for part in parts), strict=True)
        return torch.cat(outs, 2), torch.cat(lses, 2)

    def merge_prefix(self, q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor,
                     runs: tuple[tuple[int, int], ...], scale: float, out: torch.Tensor, lse: torch.Tensor) -> bool:
        """The calls ``attend`` gives our kernel (the same row counts), as one call per
        ``AMX_MAX_ROWS`` rows over every run, merged in C with what ``out``/``lse`` hold: no
        PyTorch merge after it (with 16 streams behind one prompt those small ops took 4-6 ms
        of a float32 step)."""
        hq, n, d = q.shape
        h = k_layer.shape[0]
        m = hq // h * n
        parts = -(-m // native.AMX_MAX_ROWS)
        if (k_layer.dim() != 3 or v_layer.shape != k_layer.shape or k_layer.dtype != q.dtype
                or k_layer.stride(2) != 1 or v_layer.stride(2) != 1 or d % 16 or d > native.MAX_HEAD_DIM
                or not (self.takes_rows(q.dtype, m, d)
                        or (parts > 1 and self.kernel.many_rows_for(q.dtype, d)))):
            return False
        qs = q.reshape(h, m, d).contiguous()  # grouped heads folded into rows (the plan's module docstring)
        os_, ls = out.reshape(h, m, d).contiguous(), lse.reshape(h, m).contiguous()
        if parts == 1:
            self.kernel.merge_into(qs, k_layer, v_layer, runs, scale, os_, ls)
        else:  # each row attends on its own: parts side by side are the whole call
            step = native.AMX_MAX_ROWS
            for i in range(0, m, step):
                o_part, l_part = os_[:, i:i + step].contiguous(), ls[:, i:i + step].contiguous()
                self.kernel.merge_into(qs[:, i:i + step].contiguous(), k_layer, v_layer, runs, scale, o_part, l_part)
                os_[:, i:i + step], ls[:, i:i + step] = o_part, l_part
        out.copy_(os_.view(hq, n, d))
        lse.copy_(ls.view(hq, n))
        return True

    def takes_rows(self, dtype: torch.dtype, rows: int, head_dim: int) -> bool:
        return dtype in NATIVE_DTYPES and (rows <= self.few_rows or (self.kernel.many_rows_for(dtype, head_dim)
                                                                       and rows <= native.AMX_MAX_ROWS))

    def cut_rows(self, rows: list[tuple[int, list[tuple[int, int]]]]) -> object:
        return native.cut_rows(rows)

    def attend_rows(self, q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, cut: object, scale: float,
                    out: torch.Tensor, lse: torch.Tensor) -> None:
        self.kernel.attend_rows(q, k_layer, v_layer, cut, scale, out, lse)  # type: ignore[arg-type]

    def layer_call(self, k_layer: torch.Tensor, cut: object, q_heads: int, scale: float) -> native.LayerCall | None:
        """The decode rows' attention for C code to call per layer (``native.LayerCall``): float32
        or bfloat16 pool layers, else None."""
        if k_layer.dtype not in NATIVE_DTYPES or not k_layer.is_contiguous() or k_layer.dim() != 3:
            return None
        return self.kernel.layer_call(k_layer, cut, q_heads, scale)  # type: ignore[arg-type]

    def describe(self) -> str:
        rows = (f"up to {native.AMX_MAX_ROWS} bf16 rows with AMX" if self.kernel.amx else
                f"up to {native.AMX_MAX_ROWS} bf16 rows with AVX512-BF16" if self.kernel.many_rows else
                f"up to {self.few_rows} rows")
        if self.kernel.many_rows_fp32:
            rows += f", up to {native.AMX_MAX_ROWS} float32 rows with AVX-512"
        return (f"cpu_native (our {self.kernel.simd} kernel for decode rows over their keys, {rows}, "
                "a shared prefix's runs in one call merged in place; PyTorch's flash kernel for the rest)")
