"""The decode step's float32 linears through our own kernel (``native_linear.c``).

Owns: ``NativeLinear`` (an ``nn.Linear`` whose products of a few rows in float32 go to the
kernel; everything else to PyTorch's) and turning a loaded model's plain linears into it
(``use_native_linears``, in place: the same parameters, tied embeddings included, no copy).
Knows nothing about requests or the cache; the model runner decides when.

Why: a decode step multiplies a few rows by every weight, so it runs at the speed the
weights stream from memory. On the AMD EPYC these numbers come from (AVX2, no AVX-512), all
linears of the embedded model at one row took 94.5 ms with MKL's product (5.7 GB/s) and 43.7
ms with this kernel (12.3 GB/s; a plain read gets 14); at 16 rows 139 vs 70 ms
(``docs/PERFORMANCE.md``). More than ``MAX_ROWS`` rows (a prefill chunk) go to PyTorch, which
is faster there. A row's result does not depend on the other rows in the call, so batched
decode rows equal lone ones bit for bit; against MKL's product they differ in the last bits,
and the second tier's fingerprint says which kernels computed its KV.

Where: float32 weights on a CPU where the kernel builds (AVX2 and FMA, or AVX-512, and a C
compiler; ``engine.model.native_build``). ``RADIX_NATIVE_LINEAR=0`` turns it off.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import nn

from engine.model.native_build import OnFirstUse

SOURCE = Path(__file__).with_name("native_linear.c")
ENV_SWITCH = "RADIX_NATIVE_LINEAR"
MAX_ROWS = 32  # more rows (a prefill chunk): PyTorch's product, faster there


class LinearKernel:
    """The loaded library: ``run`` multiplies rows of x by a weight on torch tensors."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._run = lib.radix_linear
        self._run.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, ctypes.c_int]
        self._run.restype = ctypes.c_int
        self.path = path

    def run(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [rows, in] @ weight[out, in]^T + bias``, float32, x's rows with a contiguous last dim."""
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32)
        rc = self._run(x.data_ptr(), x.stride(0), x.shape[0], weight.data_ptr(), weight.shape[0], weight.shape[1],
                       None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
                       torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"the native linear kernel refused {tuple(x.shape)} x {tuple(weight.shape)}")
        return out


_library = OnFirstUse(SOURCE, ENV_SWITCH, LinearKernel)


def kernel() -> LinearKernel | None:
    """The kernel, built and loaded on the first call; None where it cannot be (``why()``)."""
    return _library.get()


def why() -> str:
    return _library.why


def reset() -> None:
    _library.reset()


class NativeLinear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) whose float32 products of up to
    ``MAX_ROWS`` rows, outside autograd, run on the kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        rows = x.numel() // max(x.shape[-1], 1)
        k = _library.loaded()  # loaded before any model is converted (use_native_linears)
        if (k is None or rows > MAX_ROWS or rows == 0 or x.dtype != torch.float32 or w.dtype != torch.float32
                or x.device.type != "cpu" or torch.is_grad_enabled() or not w.is_contiguous()):
            return nn.functional.linear(x, w, self.bias)
        flat = x.reshape(rows, x.shape[-1])
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        return k.run(flat, w, self.bias).reshape(*x.shape[:-1], w.shape[0])


def use_native_linears(model: nn.Module) -> int:
    """Turn every plain ``nn.Linear`` of a float32 CPU model whose input size the kernel takes
    (a multiple of 8) into a ``NativeLinear``, in place; returns how many. Does nothing
    (returns 0) where the kernel does not build or the model is not float32 on a CPU."""
    try:
        p = next(model.parameters())
    except StopIteration:
        return 0
    if p.device.type != "cpu" or p.dtype != torch.float32 or kernel() is None:
        return 0
    linears = [m for m in model.modules() if type(m) is nn.Linear and m.in_features % 8 == 0]
    for m in linears:
        m.__class__ = NativeLinear
    return len(linears)


def plain_linears(model: nn.Module) -> int:
    """The inverse of ``use_native_linears`` (for a peer that must run plain transformers)."""
    native = [m for m in model.modules() if type(m) is NativeLinear]
    for m in native:
        m.__class__ = nn.Linear
    return len(native)
