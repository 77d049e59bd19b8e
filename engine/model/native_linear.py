"""Linears through our own kernel (``native_linear.c``): float32 decode steps, and all of
bfloat16 on CPUs without native bf16.

Owns: ``NativeLinear`` (an ``nn.Linear`` whose products go to the kernel where it is faster,
everything else to PyTorch's) and turning a loaded model's plain linears into it
(``use_native_linears``, in place: the same parameters, tied embeddings included, no copy).
Knows nothing about requests or the cache; the model runner decides when.

Why: a decode step multiplies a few rows by every weight, so it runs at the speed the
weights stream from memory. On the AMD EPYC these numbers come from (AVX2, no AVX-512), all
linears of the embedded model at one row took 94.5 ms with MKL's float32 product (5.7 GB/s)
and 43.7 ms with this kernel (12.3 GB/s; a plain read gets 14); at 16 rows 139 vs 70 ms. More
than ``MAX_ROWS`` float32 rows (a long prefill chunk) go to MKL, which is as fast there. In
bfloat16 PyTorch's product on that CPU (no native bf16; where there is, the linears are
oneDNN-packed instead, ``engine.model.packed_linear``) took 161 ms at 8 rows and 1.87 s at
128, ours 42 ms and 0.37 s, so ours takes every bf16 product, one row too (PyTorch's one-row
product rounds otherwise than ours, so a lone decode row's logits differed from the same row's in a
batch: found by the AVX2 build's checks on an AVX-512 machine, ``RADIX_ISA=avx2``, issue 48). A
row's result does not depend on the other rows in the call, so batched decode rows equal
lone ones bit for bit; against PyTorch's product they differ in the last bits, and the second
tier's fingerprint says which kernels computed its KV.

Where: float32 or bfloat16 weights (not oneDNN-packed) on a CPU where the kernel builds (AVX2
and FMA, or AVX-512, and a C compiler; ``engine.model.native_build``). The execution plan decides
(``engine.model.plan``: ``RADIX_KERNELS=native=off``, alias ``RADIX_NATIVE_LINEAR=0``, turns it off).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from engine.model import native_abi as abi
from engine.model.native_build import OnFirstUse, bf16_dot_products

SOURCE = Path(__file__).with_name("native_linear.c")
MAX_ROWS = 128  # float32: more rows (a long prefill chunk) go to MKL's product, as fast there
# (all 210 layer matrices, Zen 4, AVX-512 tiles: ours 59-63 / 111-114 / 218-230 / 487-517 ms at
# 32 / 64 / 128 / 256 rows, MKL's 107-109 / 178-185 / 292-305 / 456-468)
BF16_BLOCK = 256  # bfloat16: this many rows per call (bounds the float32 copies); at one row PyTorch's
# product is as fast as ours (37.3 vs 35.6 ms, all linears), but ours keeps a row's bits whatever its batch
DTYPES = (torch.float32, torch.bfloat16)  # the weights it reads


class LinearKernel:
    """The loaded library: ``run`` multiplies rows of x by a weight on torch tensors. Its functions'
    signatures and the codes of its refusals come from ``engine.model.native_abi``."""

    def __init__(self, path: Path) -> None:
        lib = abi.load(path, SOURCE.stem)  # every signature set from the table
        self._run = lib.radix_linear
        self.lib = lib  # the layer functions too (engine.model.fused_decode)
        self.path = path

    def run(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [rows, in] @ weight[out, in]^T + bias`` in float32 (x, bias and the result float32,
        x's rows with a contiguous last dim; the weight float32 or bfloat16, contiguous)."""
        if x.dtype != torch.float32 or weight.dtype not in DTYPES or bias is not None and bias.dtype != torch.float32:
            raise ValueError(f"the native linear kernel takes float32 x and bias, got {x.dtype} x {weight.dtype}")
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32)
        code = self._run(x.data_ptr(), x.stride(0), x.shape[0], weight.data_ptr(), weight.shape[0], weight.shape[1],
                         None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
                         int(weight.dtype == torch.bfloat16), torch.get_num_threads())
        if code:
            raise abi.NativeRefusal(code, "the native linear kernel", f"{tuple(x.shape)} x {tuple(weight.shape)}")
        return out


_library = OnFirstUse(SOURCE, LinearKernel)


def kernel() -> LinearKernel | None:
    """The kernel, built and loaded on the first call; None where it cannot be (``why()``)."""
    return _library.get()


def why() -> str:
    return _library.why


def reset() -> None:
    _library.reset()


class NativeLinear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) whose products outside autograd run on
    the kernel: in float32 up to ``MAX_ROWS`` rows; in bfloat16 any number of rows (x widened to
    float32 on the way in, the result rounded back on the way out, as PyTorch's bf16 product
    accumulates in float32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        rows = x.numel() // max(x.shape[-1], 1)
        k = _library.loaded()  # loaded before any model is converted (use_native_linears)
        if (k is None or rows == 0 or x.dtype != w.dtype or w.dtype not in DTYPES or x.device.type != "cpu"
                or torch.is_grad_enabled() or not w.is_contiguous()
                or (w.dtype == torch.float32 and rows > MAX_ROWS)):
            return nn.functional.linear(x, w, self.bias)
        flat = x.reshape(rows, x.shape[-1])
        bias = None if self.bias is None else self.bias.to(torch.float32)
        if w.dtype == torch.float32:
            return k.run(flat if flat.stride(-1) == 1 else flat.contiguous(), w, bias).reshape(*x.shape[:-1], -1)
        if rows <= BF16_BLOCK:
            return k.run(flat.float(), w, bias).to(x.dtype).reshape(*x.shape[:-1], -1)
        out = torch.empty((rows, w.shape[0]), dtype=x.dtype)
        for r0 in range(0, rows, BF16_BLOCK):
            out[r0:r0 + BF16_BLOCK] = k.run(flat[r0:r0 + BF16_BLOCK].float(), w, bias)  # rounded to bf16 here
        return out.reshape(*x.shape[:-1], -1)


def refusal(model: nn.Module) -> str:
    """Why ``use_native_linears`` leaves ``model`` alone ("" where it converts it): float32, or
    bfloat16 on a CPU without native bf16 (``engine.model.packed_linear`` packs it where there is),
    on a CPU where the kernel builds."""
    try:
        p = next(model.parameters())
    except StopIteration:
        return "no weights"
    if p.device.type != "cpu" or p.dtype not in DTYPES:
        return f"takes float32 or bfloat16 on the CPU, not {str(p.dtype).removeprefix('torch.')} on {p.device.type}"
    if kernel() is None:
        return f"the kernel does not build here: {why()}"
    if p.dtype == torch.bfloat16 and bf16_dot_products():
        return "this CPU has native bf16 dot products: oneDNN's product (packed or not) is the one measured there"
    return ""


def use_native_linears(model: nn.Module) -> int:
    """Turn every plain ``nn.Linear`` of ``model`` whose input size the kernel takes (a multiple of
    8) into a ``NativeLinear``, in place; returns how many. Does nothing (returns 0) where
    ``refusal`` says why not."""
    if refusal(model):
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
