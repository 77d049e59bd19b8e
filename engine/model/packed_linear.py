"""CPU linears with their weights packed once for oneDNN: faster bfloat16 on CPUs with native bf16.

Owns: swapping a loaded model's ``nn.Linear`` layers (projections, MLP, the LM
head) for ``PackedLinear``, which keeps the same weight and bias but multiplies
through oneDNN with the weight reordered once into the layout its kernels
stream best (what ``torch.compile``'s CPU freezing does for linears). Knows
nothing about requests or the cache; the model runner decides when to pack.

When: by default **bfloat16 only**, on an x86 CPU with native bf16 dot products, where
PyTorch was built with oneDNN and a packed product checks out at start. Measured on the
2-core machine (all linears of the embedded model, one process, alternating): in bf16 the
packed product is faster at every batch size (22.7 vs 29.4 ms at 1 row, 115 vs 175 ms at
512); in float32 MKL's plain product is as fast or faster (25.6 vs 41.7 ms at 1 row, 61.5 vs
63.7 ms at 16, 463 vs 455 ms at 512), and one decode step of one request over a 2,300-token
prompt took 69 ms plain against 91 ms packed, so float32 stays plain (and does not hold the
weights twice). The execution plan decides (``engine.model.plan``: ``RADIX_KERNELS=linear=packed``
packs float32 too, ``packed=off`` nothing; ``RADIX_PACKED_LINEAR=1``/``0`` are their aliases).

The packed copy is extra memory (the model's linear weights once more; a tied LM head is
packed as a copy). Outputs differ from the plain product's in the last bits; every path of
the engine (with or without the cache, alone or batched) runs the same layers, so reuse
still changes nothing.
"""

from __future__ import annotations

import copy
import functools
import platform

import torch
from torch import nn

from engine.model.native_build import bf16_dot_products

DEFAULT_DTYPES = (torch.bfloat16,)  # what is packed unless the plan names packed (then float32 too)


class PackedLinear(nn.Module):
    """``nn.Linear`` whose weight is also held pre-packed for oneDNN (inference only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # kept: state_dict, tied embeddings and unpacking still see it
        self.bias = linear.bias
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or x.device.type != "cpu" or torch.is_grad_enabled() and x.requires_grad:
            return nn.functional.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"

    def __deepcopy__(self, memo: dict) -> PackedLinear:
        # The packed tensor is opaque (no storage to copy): copy the weights, pack again.
        return PackedLinear(copy.deepcopy(self.unpacked(), memo))

    def unpacked(self) -> nn.Linear:
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        device=self.weight.device, dtype=self.weight.dtype)
        lin.weight = self.weight
        if self.bias is not None:
            lin.bias = self.bias
        return lin


def refusal(model: nn.Module, dtypes: tuple[torch.dtype, ...] = DEFAULT_DTYPES) -> str:
    """Why packing does not apply to ``model`` ("" where it does): weights of one of ``dtypes`` on an
    x86 CPU (where it was measured), oneDNN built in, and a packed product checks out against the
    plain one (bfloat16 also needs native bf16 dot products)."""
    if not torch.backends.mkldnn.is_available():
        return "PyTorch was built without oneDNN"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"measured on x86 only, not {platform.machine()}"
    try:
        p = next(model.parameters())
    except StopIteration:
        return "no weights"
    if p.dtype == torch.bfloat16 and not bf16_dot_products():  # (RADIX_ISA=avx2: as on a CPU without them)
        return "no native bf16 dot products on this CPU (or RADIX_ISA narrows it)"
    if p.device.type != "cpu":
        return f"weights on {p.device.type}, not the CPU"
    if p.dtype not in dtypes:
        return (f"{str(p.dtype).removeprefix('torch.')} is not packed unless named (MKL's plain float32 product "
                "is as fast)" if p.dtype == torch.float32 else f"{str(p.dtype).removeprefix('torch.')} is not packed")
    return "" if _packing_works(p.dtype) else "a packed product did not check out against the plain one"


def can_pack(model: nn.Module, dtypes: tuple[torch.dtype, ...] = DEFAULT_DTYPES) -> bool:
    """Packing applies (``refusal`` says why not)."""
    return not refusal(model, dtypes)


@functools.cache
def _packing_works(dtype: torch.dtype = torch.float32) -> bool:
    """One small packed product against ``F.linear``: any error or mismatch turns packing off
    (bfloat16 also needs a CPU with native bf16 dot products: ``can_pack`` asks first)."""
    try:
        gen = torch.Generator().manual_seed(0)
        w, x = torch.randn(48, 32, generator=gen).to(dtype), torch.randn(1, 5, 32, generator=gen).to(dtype)
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
            got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        return bool(torch.allclose(got.float(), nn.functional.linear(x, w).float(), atol=tol, rtol=tol))
    except Exception:  # an op missing from this build, or unsupported on this CPU
        return False


def pack_linears(model: nn.Module, dtypes: tuple[torch.dtype, ...] = DEFAULT_DTYPES) -> int:
    """Swap every ``nn.Linear`` of ``model`` for a ``PackedLinear``, in place; returns how many.
    Does nothing (returns 0) where ``can_pack`` says no."""
    if not can_pack(model, dtypes):
        return 0
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)


def unpack_linears(model: nn.Module) -> int:
    """The inverse of ``pack_linears`` (for a peer that must run plain transformers)."""
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if isinstance(child, PackedLinear)]
    for parent, name, child in swaps:
        setattr(parent, name, child.unpacked())
    return len(swaps)
