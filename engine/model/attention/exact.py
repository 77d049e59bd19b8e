"""Exact attention: a token's result depends on its queries and its keys, nothing else (issue 44).

Owns: ``ExactPlan``, one packed forward's tokens in the form ``radix_exact_attention``
(``native/decode_attention.c``) takes (each token's position and the runs of the pool that hold
its keys), and ``ExactCall``, that kernel's call for every layer of the forward, from C (the
fused layers call it between their two halves, ``engine.model.fused_decode``) or from Python.
Knows nothing of the tree or the scheduler.

Why: the paged plan (``engine.model.paged_attention``) is built for speed, and each of its
paths reduces in an order of its own (a shared prefix read apart and merged, pieces cut where a
run of the pool starts, the flash kernel's blocks for a prefill chunk), so a token's bits hung on
its batch, on where the cache ended and on its chunk. Here every token at position ``p`` reduces
over keys ``0..p`` in blocks fixed by absolute position, merged in order (the C file says how);
a decode row alone or among sixteen, a position inside a prefill chunk over a cached prefix or
from nothing, and KV loaded from the second tier all give the same bits. Tokens go in the
caller's order (no regrouping, so logits need no permutation back), in chunks of
chunks of consecutive tokens (up to ``MAX_ROWS`` query rows) that read a shared block once between them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from engine.model import native_abi as abi
from engine.model.attention import native

BLOCK = abi.VALUE["RADIX_EXACT_BLOCK"]  # keys per block, by absolute position
MAX_GROUP = abi.VALUE["RADIX_EXACT_MAX_G"]  # query heads per KV head
MAX_CHUNK_TOKENS = abi.VALUE["RADIX_EXACT_MAX_CHUNK"]  # tokens per work item
MAX_ROWS = abi.VALUE["RADIX_EXACT_ROWS"]  # their query rows
_ExactStruct = abi.struct("radix_exact")  # one forward's exact attention (native_abi.h)


class ExactCall:
    """The exact attention of one forward's tokens for every layer whose pool layers are shaped
    like the one it was made for: ``fn`` and ``contexts`` for C (``radix_layers``' attend, one
    struct a layer: a sliding window's layers have their own), ``attend`` for Python. Holds every
    buffer its structs point at."""

    def __init__(self, kernel: native.DecodeKernel, structs: Sequence[_ExactStruct], keep: tuple) -> None:
        self.structs, self._keep = list(structs), keep
        self.struct = self.structs[0]
        self.fn = kernel.exact_fn
        self._ctxs = [ctypes.addressof(s) for s in self.structs]
        self.ctx = self._ctxs[0]
        self._run = kernel.lib.radix_exact_attention  # its signature set where the library is loaded

    def contexts(self, layers: int) -> ctypes.Array:
        """Each layer's struct, for ``radix_layers`` (``layers`` of them: the call's own count)."""
        if layers != len(self._ctxs):
            raise ValueError(f"this exact attention was made for {len(self._ctxs)} layers, not {layers}")
        return (ctypes.c_void_p * layers)(*self._ctxs)

    def attend(self, q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """``q [T, Hq * D]`` (contiguous, the pool's dtype; query head ``h * G + i`` reads KV head
        ``h``) over the pool layer ``k_layer``/``v_layer`` ``[H, S, D]`` as layer ``layer`` (its window):
        ``[T, Hq * D]`` float32."""
        s = self.structs[layer]
        if (q.shape != (s.ntok, s.H * s.G * s.D) or not q.is_contiguous() or k_layer.shape != (s.H, s.slots, s.D)
                or v_layer.shape != k_layer.shape or not (k_layer.is_contiguous() and v_layer.is_contiguous())
                or not q.dtype == k_layer.dtype == v_layer.dtype):
            raise ValueError(f"the exact attention kernel takes [{s.ntok}, {s.H * s.G * s.D}] queries over "
                             f"[{s.H}, {s.slots}, {s.D}] pool layers of one dtype")
        out = torch.empty((s.ntok, s.H * s.G * s.D), dtype=torch.float32)
        abi.check(self._run(self._ctxs[layer], q.data_ptr(), k_layer.data_ptr(), v_layer.data_ptr(), out.data_ptr()),
                  "the exact attention kernel")
        return out


class ExactPlan:
    """What one exact forward needs, built once before the layers run: the pack's token ids,
    positions and the slots their KV goes to (in the caller's order: ``order`` is the identity),
    and each token's runs of the pool. ``segments`` are ``PagedSegment``s."""

    def __init__(self, segments: Sequence, device: torch.device) -> None:
        from engine.kvcache.kv_pool import contiguous_runs
        from engine.model.paged_attention import packed

        self.device = device
        self.order = list(range(len(segments)))
        self.lens, self.ids, self.positions, self.write_index = packed(segments, device)
        self.total = len(self.ids)
        tok, runs = [], []
        for s in segments:
            own = s.runs if s.runs is not None else contiguous_runs(s.slots[: s.past + len(s.ids)])
            first = len(runs)
            runs += [tuple(r) for r in own]
            tok += [(p, first, len(runs)) for p in range(s.past, s.past + len(s.ids))]
        self.tok = torch.tensor(tok, dtype=torch.int64).reshape(-1, 3)
        self.runs = torch.tensor(runs, dtype=torch.int64).reshape(-1, 3)

    def call(self, k_layer: torch.Tensor, q_heads: int, scale: float, windows: Sequence[int] = (0,),
             softcap: float = 0.0) -> ExactCall:
        """The exact attention of this plan's tokens for pool layers shaped like ``k_layer``
        ``[H, S, D]`` (float32 or bfloat16), ``q_heads`` query heads, scale ``scale``; one layer a
        window of ``windows`` (0: none; a sliding window's keys are those above ``p - window``) and
        the scores soft-capped at ``softcap`` (0: none)."""
        kernel = native.kernel()
        if kernel is None:
            raise ValueError(f"the exact attention kernel is not available: {native.why()}")
        h, slots, d = k_layer.shape
        per = max(1, min(MAX_CHUNK_TOKENS, MAX_ROWS // (q_heads // h)))
        chunks = torch.tensor(list(range(0, self.total, per)) + [self.total], dtype=torch.int64)
        made: dict[int, _ExactStruct] = {}
        for w in windows:
            if w not in made:
                made[w] = _ExactStruct(H=h, G=q_heads // h, D=d, slots=slots, ntok=self.total, tok=self.tok.data_ptr(),
                                       runs=self.runs.data_ptr(), nruns=self.runs.shape[0], chunks=chunks.data_ptr(),
                                       nchunks=chunks.shape[0] - 1, scale=scale,
                                       bf16=int(k_layer.dtype == torch.bfloat16), threads=torch.get_num_threads(),
                                       window=int(w), softcap=float(softcap))
        return ExactCall(kernel, [made[w] for w in windows], (self.tok, self.runs, chunks))


def takes(dtype: torch.dtype, q_heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the exact kernel takes a model of these sizes in this dtype (and has built)."""
    return (dtype in (torch.float32, torch.bfloat16) and kv_heads > 0 and q_heads % kv_heads == 0
            and q_heads // kv_heads <= MAX_GROUP and head_dim % 16 == 0 and 16 <= head_dim <= native.MAX_HEAD_DIM
            and native.kernel() is not None)
