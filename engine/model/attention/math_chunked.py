"""The portable backend: matmul and softmax in float32, in blocks, within a fixed workspace.

Owns: attention by plain tensor ops on any device (CUDA and MPS take it; on a CPU it is the
reference the flash kernel is tested against), and the byte cap on its scratch. Knows
nothing of the plan: it is handed rows, keys and a rule (``engine.model.attention.base``).

Scores of every row over every key at once would be ``[B, H, M, L]`` floats: for SmolLM2 a
2,048-token chunk over an 8k context is 0.6 GB per tensor, and more for larger models. So
the call walks blocks of ``bc`` batch rows x ``mc`` query rows x ``lc`` keys, sized so that
everything one block keeps alive fits ``workspace_bytes`` (``block_bytes``), with the
softmax online (running max ``m`` and sum ``s`` per row, exact up to float32 rounding)::

    for each key block:  m' = max(m, max_j x_j)       s = s e^(m - m') + sum_j e^(x_j - m')
                         acc = acc e^(m - m') + sum_j e^(x_j - m') v_j
    out = acc / s        lse = m + log s

A causal rule is applied block by block: key blocks wholly after a row block's last
position are skipped, blocks wholly before its first position take no mask.
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch

from engine.model.attention.base import AttentionBackend, Causal
from engine.types import EngineFault

WORKSPACE_ENV = "RADIX_ATTENTION_WORKSPACE_MB"
DEFAULT_WORKSPACE_BYTES = 64 << 20


def block_bytes(bc: int, heads: int, mc: int, lc: int, head_dim: int) -> int:
    """The most bytes one block keeps alive at once: its scores (exponentiated in place),
    its keys and values and its queries in float32, the accumulator and one ``p @ v``, the
    per-row statistics, and the mask block (explicit, or the causal rule's booleans and
    positions)."""
    per = bc * heads
    return (4 * per * (mc * lc + 2 * lc * head_dim + 3 * mc * head_dim + 8 * mc)
            + 4 * bc * mc * lc + 32 * (mc + lc))


def _mask_block(mask: torch.Tensor, b: range, r: range, c: range) -> torch.Tensor:
    """The part of an additive mask (broadcastable to [B, 1, M, L]) over a block; broadcast
    dimensions stay of size 1."""
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    for dim, span in ((0, b), (2, r), (3, c)):
        if mask.shape[dim] != 1:
            mask = mask.narrow(dim, span.start, len(span))
    return mask


class MathChunkedBackend(AttentionBackend):
    name: ClassVar[str] = "math_chunked"
    devices: ClassVar[frozenset[str] | None] = None  # any device

    def __init__(self, workspace_bytes: int | None = None) -> None:
        if workspace_bytes is None:
            env = os.environ.get(WORKSPACE_ENV)
            workspace_bytes = int(float(env) * (1 << 20)) if env else DEFAULT_WORKSPACE_BYTES
        self.workspace_bytes = workspace_bytes
        self.blocks_run = 0  # key blocks computed since start (tests read it)
        self.peak_block_bytes = 0  # the largest block_bytes a call has used

    @property
    def workspace_cap_bytes(self) -> int | None:
        return self.workspace_bytes

    def describe(self) -> str:
        return f"math_chunked (float32 matmul-softmax, online over blocks, workspace at most {self.workspace_bytes >> 20} MiB)"

    def blocks(self, batch: int, heads: int, rows: int, keys: int, head_dim: int) -> tuple[int, int, int]:
        """Block sizes ``(bc, mc, lc)`` within the cap: from the whole call, halve whichever
        of the three saves the most bytes until the block fits (each halving doubles the
        blocks alike, so this keeps them few)."""
        size = (batch, rows, keys)
        while block_bytes(size[0], heads, size[1], size[2], head_dim) > self.workspace_bytes:
            halved = [size[:i] + ((size[i] + 1) // 2,) + size[i + 1:] for i in range(3) if size[i] > 1]
            if not halved:
                raise EngineFault(f"the attention workspace ({self.workspace_bytes:,} bytes) is too small for one "
                                  f"row of {heads} heads of size {head_dim}")
            size = min(halved, key=lambda o: block_bytes(o[0], heads, o[1], o[2], head_dim))
        bc, mc, lc = size
        self.peak_block_bytes = max(self.peak_block_bytes, block_bytes(bc, heads, mc, lc, head_dim))
        return bc, mc, lc

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               mask: torch.Tensor | None = None, causal: Causal | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        batch, heads, rows, head_dim = q.shape
        keys = k.shape[-2]
        bc, mc, lc = self.blocks(batch, heads, rows, keys, head_dim)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((batch, heads, rows), dtype=torch.float32, device=q.device)
        for b0 in range(0, batch, bc):
            b = range(b0, min(b0 + bc, batch))
            for r0 in range(0, rows, mc):
                self._rows(q, k, v, scale, mask, causal, b, range(r0, min(r0 + mc, rows)), lc, out, lse)
        return out, lse

    def _rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
              causal: Causal | None, b: range, r: range, lc: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        """One block of rows over every key block, written to ``out`` and ``lse`` (a row that
        sees no key gets 0 and -inf). Its temporaries end with the call, and each key block's
        before the next one's are made, so ``block_bytes`` bounds what is alive at once."""
        heads, head_dim, keys = q.shape[1], q.shape[3], k.shape[2]
        f32 = dict(dtype=torch.float32, device=q.device)
        qb = torch.empty((len(b), heads, len(r), head_dim), **f32).copy_(q[b.start:b.stop, :, r.start:r.stop])
        m = torch.full((len(b), heads, len(r)), float("-inf"), **f32)
        s = torch.zeros((len(b), heads, len(r)), **f32)
        acc = torch.zeros((len(b), heads, len(r), head_dim), **f32)
        first, last = causal.positions(r) if causal is not None else (0, 0)
        for c0 in range(0, keys, lc):
            c = range(c0, min(c0 + lc, keys))
            hide = None
            if causal is not None:
                if causal.k_start + c.start > last:
                    break  # this key block and every later one come after the rows' positions
                if causal.k_start + c.stop - 1 > first:
                    hide = causal.hidden(r, c)
            kb = torch.empty((len(b), heads, len(c), head_dim), **f32).copy_(k[b.start:b.stop, :, c.start:c.stop])
            vb = torch.empty((len(b), heads, len(c), head_dim), **f32).copy_(v[b.start:b.stop, :, c.start:c.stop])
            scores = torch.matmul(qb, kb.transpose(-1, -2)).mul_(scale)
            if mask is not None:
                scores.add_(_mask_block(mask, b, r, c))
            if hide is not None:
                scores.masked_fill_(hide, float("-inf"))
            m_new = torch.maximum(m, scores.amax(dim=-1))
            m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # rows with no visible key yet
            probs = scores.sub_(m_safe.unsqueeze(-1)).exp_()
            corr = torch.exp(m.sub_(m_safe))
            s.mul_(corr).add_(probs.sum(dim=-1))
            acc.mul_(corr.unsqueeze(-1)).add_(torch.matmul(probs, vb))
            m = m_new
            del kb, vb, scores, probs, hide, m_safe, corr
            self.blocks_run += 1
        out[b.start:b.stop, :, r.start:r.stop] = acc.div_(s.masked_fill(s == 0, 1.0).unsqueeze(-1))
        lse[b.start:b.stop, :, r.start:r.stop] = s.log_().add_(m)
