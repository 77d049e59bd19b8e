"""A decode step's layers in two C calls each: everything around attention, fused.

Owns: ``FusedLayers``, the forward (float32 or bfloat16) of a decoder layer's work before attention
(its norm, the q/k/v linears, q/k norms, the rotary embedding, the new KV written to its pool slots)
and after it (the o linear, a norm, the residual, a norm, gate/up, the activation times up, down, a
norm, the residual), as its family's recipe says, each one call into ``native_linear.c`` (``radix_layer_pre``/``radix_layer_post``).
Knows nothing about requests or the tree: ``engine.model.decoder_stack`` calls it for a step of
at most ``MAX_ROWS`` rows and does the attention between the two calls.

Where every row of the step is a decode row that shares no prefix with another (one stream, or
streams with prompts of their own), ``run_all`` goes further: every layer's two calls and the
attention between them (``native.LayerCall``, the attention kernel called from C) in one C
call (``radix_layers``), which took the Python between the calls, 2.8 ms of a 27.5 ms step
behind 2,300 tokens, down to 1 ms for the whole forward. Rows that share a prefix (the cascade
merges pieces in PyTorch) run layer by layer.

Why: a one-request decode step on a CPU streams the weights once (about 37 ms of linears for
the embedded model in float32 on the AMD EPYC here) and spent another 15-20 ms in about eighty
small PyTorch ops per layer and the Python between them (an op on one 576-value row costs
as much to dispatch as to compute). Two calls per layer leave that to C.

Exactness: every step is per row (a row's result does not depend on the others in the call), so
batched decode rows still equal lone ones bit for bit. Against the unfused forward the logits
differ in their last bits (another order of float32 operations), like our linears against
PyTorch's: the runner checks them within a bound on a probe at start
(``engine.model.layer_checks``) and runs unfused on any other result, and the second tier's
fingerprint names the fused forward. The execution plan decides (``engine.model.plan``:
``RADIX_KERNELS=fused=off``, alias ``RADIX_FUSED_DECODE=0``, turns it off).

In bfloat16 the C code rounds to bf16 wherever the unfused bf16 forward stores a bf16 tensor
(``native_linear.c``), so the two differ only in the order of the sums inside the linears and the
norms: a lone row's logits then differ from the unfused forward's by about what two bf16 runs of
another kernel would (the probe's bound is wider than float32's, ``BOUND``). It reads the bf16
weights in place (a oneDNN-packed linear keeps its plain weight beside the packed one). At one row
on the Zen 4 here the step's linears took 12.4 ms against oneDNN's 18.0-18.6, and a step behind
2,300 tokens 15.4 ms fused against 37.5 unfused. At 8 rows (streams sharing that prompt) a step took
55-60 ms fused against 61-63 unfused; at 16, 81-90 against 75-77 (oneDNN's bf16 dot products win
there), so bf16 takes at most ``BF16_MAX_ROWS`` rows.

Which layers: every family of ``engine.model.families``, read through ``engine.model.decoder_parts``
(its recipe says the rest: norms before and after attention and the MLP, Gemma's ``1 + w``, q/k norms
per head or over the projection, SiLU or GELU-tanh, a rotary table per layer type), in float32 or
bfloat16 on a CPU, with plain ``[out, in]`` weights (views of a fused projection's rows too; biases
allowed) and sizes our linear kernel takes (multiples of 8).
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from engine.model import families, native_linear
from engine.model import native_abi as abi
from engine.model.decoder_parts import DecoderParts, LayerParts, Linear, Norm
from engine.model.families import Recipe

MAX_ROWS = 32  # float32: a step of more rows (a prefill chunk) runs unfused
BF16_MAX_ROWS = 8  # bfloat16: more rows go to oneDNN's bf16 products (faster there, module docstring)
# The probe's bound on the logits against the unfused forward, a fraction of the largest logit: in
# float32 rounding in another order; in bfloat16 that, then a bf16 rounding that can fall the other
# way and carry through the layers. A misread layer is off by far more.
BOUND = {torch.float32: 1e-3, torch.bfloat16: 5e-2}
DTYPES = tuple(BOUND)


_LayerStruct = abi.struct("radix_layer")  # one layer's weights by address, and its sizes (native_abi.h)


def plain_rms_norm(norm: nn.Module) -> tuple[torch.Tensor, float] | None:
    """``(weight, eps)`` of a plain RMSNorm (a ``weight`` vector and a ``variance_epsilon``, no
    offset), else None: the decoder stack's one-kernel norm (its PyTorch layers, Llama-shaped only)."""
    weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if weight is None or eps is None or not type(norm).__name__.endswith("RMSNorm") or weight.ndim != 1:
        return None
    return weight, float(eps)


def _weighted_ok(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.dtype == dtype and t.is_contiguous() and t.shape[-1] % 8 == 0


class FusedLayers:
    """The fused decode-step layer work for one model (module docstring)."""

    def __init__(self, lib: ctypes.CDLL, structs: list[_LayerStruct], keep: list[torch.Tensor],
                 dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype  # the weights' and the pool's; rows in and out are float32 (bf16 values in bf16)
        self.max_rows = BF16_MAX_ROWS if dtype == torch.bfloat16 else MAX_ROWS
        self.bound = BOUND[dtype]
        self._name = str(dtype).removeprefix("torch.")
        # signatures set where the library was loaded (engine.model.native_abi)
        self._pre, self._post, self._all = lib.radix_layer_pre, lib.radix_layer_post, lib.radix_layers
        self._structs = structs
        self._refs = [ctypes.addressof(s) for s in structs]
        self._table = (ctypes.c_void_p * len(structs))(*self._refs)  # every layer, for radix_layers
        self._keep = keep  # every tensor the structs point at: the model's weights, the biases made float32 here
        first = structs[0]
        self.q_width = int(first.q_heads * first.head_dim)
        self.tail: _Tail | None = None  # the final norm and the LM head in C, for an exact forward

    @classmethod
    def build(cls, parts: DecoderParts, dtype: torch.dtype, device: torch.device) -> FusedLayers | None:
        """The fused layers of a decoder (its ``DecoderParts``), or None when they are not ones it takes
        (module docstring) or the kernel does not build."""
        kernel = native_linear.kernel() if device.type == "cpu" and dtype in DTYPES else None
        if kernel is None:
            return None
        structs, keep = [], []
        for layer in parts.layers:
            s = cls._struct(layer, parts.recipe, keep, dtype)
            if s is None:
                return None
            structs.append(s)
        if not structs:
            return None
        fused = cls(kernel.lib, structs, keep, dtype)
        fused.tail = _Tail.build(parts, dtype, kernel)
        return fused

    @staticmethod
    def _struct(p: LayerParts, recipe: Recipe, keep: list[torch.Tensor], dtype: torch.dtype) -> _LayerStruct | None:
        lins = [p.q, p.k, p.v, p.o, p.gate, p.up, p.down]
        norms = [p.attn_in, p.mlp_in, p.attn_out, p.mlp_out, p.q_norm, p.k_norm]
        if not all(_weighted_ok(m.weight, dtype) for m in lins) or p.head_dim % 2 or p.inter % 8:
            return None
        if not all(n is None or (n.weight.dtype == (torch.float32 if n.offset else dtype) and n.weight.is_contiguous())
                   for n in norms):
            return None

        def bias(m) -> int | None:
            if m.bias is None:
                return None
            b = m.bias.float().contiguous()
            keep.append(b)
            return b.data_ptr()

        def norm(n) -> tuple[int | None, float]:
            if n is None:
                return None, 0.0
            keep.append(n.weight)
            return n.weight.data_ptr(), n.eps

        keep += [m.weight for m in lins]  # held: what the struct points at cannot be freed
        (n1, e1), (n2, e2), (n3, e3), (n4, e4) = (norm(n) for n in norms[:4])
        (qn, qe), (kn, _) = norm(p.q_norm), norm(p.k_norm)
        s = _LayerStruct(norm1=n1, norm2=n2, eps1=e1, eps2=e2, norm3=n3, norm4=n4, eps3=e3, eps4=e4, qnorm=qn, knorm=kn,
                         qk_eps=qe, qk_norm={"": 0, "head": 1, "projection": 2}[recipe.qk_norm],
                         norm_offset=int(recipe.norm_offset), act=families.ACTIVATIONS.index(recipe.activation),
                         rope=p.rope, hidden=p.hidden, q_heads=p.q_heads, kv_heads=p.kv_heads, head_dim=p.head_dim,
                         inter=p.inter, bf16=int(dtype == torch.bfloat16))
        for name, m in zip(("q", "k", "v", "o", "g", "u", "d"), lins, strict=True):
            setattr(s, "w" + name, m.weight.data_ptr())
            setattr(s, "b" + name, bias(m))
        return s

    def run_all(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_layers: list[torch.Tensor],
                v_layers: list[torch.Tensor], write_index: torch.Tensor, attend: object) -> None:
        """Every layer, in one C call (``radix_layers``): ``pre``, the attention ``attend`` (a
        ``native.LayerCall`` for these rows) and ``post`` per layer, on ``h [rows, hidden]`` in
        place; the same work and the same bits as those three calls from Python."""
        rows = h.shape[0]
        if len(k_layers) != len(self._refs) or len(v_layers) != len(self._refs):
            raise ValueError("the fused decode kernel takes one pool layer per decoder layer")
        shape = k_layers[0].shape
        if not all(t.dtype == self.dtype and t.is_contiguous() and t.shape == shape for t in (*k_layers, *v_layers)):
            raise ValueError(f"the fused decode kernel takes contiguous {self._name} pool layers of one shape")
        self._check_rows(h, cos, sin, write_index)
        q = torch.empty((rows, self.q_width), dtype=torch.float32)
        a = torch.empty((rows, self.q_width), dtype=torch.float32)
        q16 = torch.empty((rows, self.q_width), dtype=torch.bfloat16) if self.dtype == torch.bfloat16 else None
        n = len(self._refs)
        ks = (ctypes.c_void_p * n)(*[t.data_ptr() for t in k_layers])
        vs = (ctypes.c_void_p * n)(*[t.data_ptr() for t in v_layers])
        failed = ctypes.c_int64(-1)
        code = self._all(self._table, n, h.data_ptr(), h.stride(0), rows, cos.data_ptr(), sin.data_ptr(), ks, vs,
                         shape[1], write_index.data_ptr(), q.data_ptr(), None if q16 is None else q16.data_ptr(),
                         a.data_ptr(), attend.fn, attend.contexts(n), torch.get_num_threads(), ctypes.addressof(failed))
        if code:
            raise abi.NativeRefusal(code, "the fused decode kernel", f"layer {failed.value} at {rows} rows")

    @staticmethod
    def _check_rows(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, write_index: torch.Tensor) -> None:
        rows = h.shape[0]
        if not all(t.dtype == torch.float32 and t.is_contiguous() for t in (h, cos, sin)):
            raise ValueError("the fused decode kernel takes contiguous float32 rows and rotary tables")
        if write_index.dtype != torch.int64 or write_index.numel() != rows or not write_index.is_contiguous():
            raise ValueError("the fused decode kernel takes one int64 pool slot per row")

    def pre(self, index: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_layer: torch.Tensor,
            v_layer: torch.Tensor, write_index: torch.Tensor) -> torch.Tensor:
        """Layer ``index`` before attention: ``h [rows, hidden]`` (rows contiguous), ``cos``/``sin``
        ``[rows, head_dim]`` contiguous, all float32 (holding bf16 values in bf16); the new KV goes
        to ``write_index`` (int64) of the pool layer ``k_layer``/``v_layer`` ``[Hkv, S, D]``
        (contiguous, in the weights' dtype). Returns the rotated queries ``[rows, q_heads *
        head_dim]`` in float32."""
        rows = h.shape[0]
        self._check_rows(h, cos, sin, write_index)
        if not all(t.dtype == self.dtype and t.is_contiguous() for t in (k_layer, v_layer)):
            raise ValueError(f"the fused decode kernel takes contiguous {self._name} pool layers")
        q = torch.empty((rows, self.q_width), dtype=torch.float32)
        code = self._pre(self._refs[index], h.data_ptr(), h.stride(0), rows, cos.data_ptr(), sin.data_ptr(),
                         q.data_ptr(), k_layer.data_ptr(), v_layer.data_ptr(), k_layer.shape[1],
                         write_index.data_ptr(), torch.get_num_threads())
        if code:
            raise abi.NativeRefusal(code, "the fused decode kernel", f"layer {index} at {rows} rows")
        return q

    def post(self, index: int, h: torch.Tensor, a: torch.Tensor) -> None:
        """Layer ``index`` after attention, on ``h [rows, hidden]`` in place; ``a [rows, q_width]``
        contiguous is attention's output."""
        if not (h.dtype == a.dtype == torch.float32 and h.is_contiguous() and a.is_contiguous()
                and a.numel() == h.shape[0] * self.q_width):
            raise ValueError("the fused decode kernel takes contiguous float32 rows")
        code = self._post(self._refs[index], h.data_ptr(), h.stride(0), h.shape[0], a.data_ptr(),
                          torch.get_num_threads())
        if code:
            raise abi.NativeRefusal(code, "the fused decode kernel", f"layer {index} at {h.shape[0]} rows")


class _Tail:
    """The decoder's final RMSNorm and its LM head on our kernels (``radix_rms_norm``, our linear):
    the last steps of an exact forward (issue 44), where a row's logits must not depend on the rows
    beside it (PyTorch's and oneDNN's products pick their kernels by the number of rows)."""

    def __init__(self, lib: ctypes.CDLL, norm: Norm, head: Linear, kernel: native_linear.LinearKernel,
                 dtype: torch.dtype, softcap: float) -> None:
        self._norm_fn = lib.radix_rms_norm  # its signature set where the library was loaded
        self.norm = norm
        self.weight = head.weight
        self.bias = None if head.bias is None else head.bias.float().contiguous()
        self.kernel, self.dtype, self.softcap = kernel, dtype, softcap

    @classmethod
    def build(cls, parts: DecoderParts, dtype: torch.dtype, kernel: native_linear.LinearKernel) -> _Tail | None:
        norm, head = parts.norm, parts.head
        if (norm.weight.dtype != (torch.float32 if norm.offset else dtype) or not norm.weight.is_contiguous()
                or not _weighted_ok(head.weight, dtype) or head.weight.shape[1] != norm.weight.shape[0]):
            return None
        return cls(kernel.lib, norm, head, kernel, dtype, parts.final_softcap)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``h [rows, hidden]`` float32 (bf16 values in bf16), contiguous: the final norm, then the
        head (then the recipe's soft-cap, row by row: an elementwise op over the whole pack would
        take its vector lanes by the row's place in the pack); ``[rows, vocab]`` in the model's dtype,
        as the model's own head returns them."""
        x = torch.empty_like(h)
        code = self._norm_fn(h.data_ptr(), h.stride(0), h.shape[0], h.shape[1], self.norm.weight.data_ptr(),
                             self.norm.eps, x.data_ptr(), int(self.dtype == torch.bfloat16), int(self.norm.offset))
        if code:
            raise abi.NativeRefusal(code, "the fused decode kernel", f"the final norm of {tuple(h.shape)}")
        logits = self.kernel.run(x, self.weight, self.bias).to(self.dtype)
        if self.softcap:
            for row in logits:
                row.copy_(torch.tanh(row / self.softcap) * self.softcap)
        return logits
