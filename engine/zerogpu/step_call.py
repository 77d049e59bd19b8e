"""One forward outside any visitor's turn as plain data, for a GPU call: what goes in, what comes back.

Such forwards are rare in ZeroGPU mode (a prompt scored for its log-probabilities, the analysis's
scratch prefills); a visitor's turn is ``turn_call``'s. Main process, ``pack``: the forward's
segments over the pool's slots become segments over a small local pool of just the slots they
touch, numbered in the same order with a one-slot gap wherever the pool's slots are not
consecutive (``local_numbering``). So every segment keeps its runs of contiguous slots and a
prefix shared by several rows stays one shared run: the worker's ``PagedPlan`` is the one the main
process would build, and the forward is the same computation, bit for bit. The KV of every slot
read (each segment's ``past``) goes along, as CPU tensors.

Worker, ``run``: a ``KVPool`` of the local slots on the device, the KV written in, the runner's
own ``forward_paged``, the new tokens' KV read back; logits and KV return as CPU tensors (a CUDA
tensor must never be returned from a ZeroGPU call), with the forward's time on the device.

Main process, ``apply``: the new KV into the pool's slots; the logits are the forward's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kvcache.kv_pool import KVPool, contiguous_runs
from engine.model.paged_attention import PagedSegment


@dataclass(frozen=True)
class LocalSegment:
    ids: tuple[int, ...]
    past: int
    slots: tuple[int, ...]  # local slot numbers


@dataclass(frozen=True)
class StepWork:
    """What one GPU call carries in."""

    segments: tuple[LocalSegment, ...]
    num_slots: int  # the local pool's size
    read_slots: tuple[int, ...]  # local slots whose KV is sent, in the order of ``k``/``v``'s token axis
    k: torch.Tensor  # [layer, kv_head, len(read_slots), head_dim], CPU
    v: torch.Tensor
    every_position: bool

    @property
    def tokens(self) -> int:
        return sum(len(s.ids) for s in self.segments)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


@dataclass(frozen=True)
class StepOut:
    """One forward the call ran: its segments (local slots), logits, the KV it wrote."""

    segments: tuple[LocalSegment, ...]
    logits: torch.Tensor  # as ``forward_paged`` returns them, CPU
    k: torch.Tensor  # [layer, kv_head, written tokens, head_dim], CPU, in the segments' order
    v: torch.Tensor
    device_ms: float  # the forward alone, on the device


def local_numbering(segments: Sequence[PagedSegment], extra: int = 0) -> dict[int, int]:
    """Pool slot -> local slot over every slot the segments touch (and ``extra`` more of each
    segment's, where it holds them): ascending, a one-slot gap where the pool's slots are not
    consecutive, so the runs of any of these slots neither merge nor split."""
    used = sorted({s for seg in segments for s in seg.slots[:seg.past + len(seg.ids) + extra]})
    local: dict[int, int] = {}
    nxt, prev = 0, None
    for s in used:
        if prev is not None and s != prev + 1:
            nxt += 1  # the gap
        local[s] = nxt
        nxt, prev = nxt + 1, s
    return local


def pack(pool: KVPool, segments: Sequence[PagedSegment],
         every_position: bool = False) -> tuple[StepWork, dict[int, int]]:
    """The call's input for ``segments`` over ``pool``, and the pool -> local slot numbering."""
    local = local_numbering(segments)
    read = sorted({s for seg in segments for s in seg.slots[:seg.past]})
    shape = (pool.num_layers, pool.num_kv_heads, len(read), pool.head_dim)
    k = torch.empty(shape, dtype=pool.dtype, device=pool.device)
    v = torch.empty(shape, dtype=pool.dtype, device=pool.device)
    if read:
        pool.read_into(read, k, v)
    segs = tuple(LocalSegment(tuple(int(t) for t in seg.ids), int(seg.past),
                              tuple(local[s] for s in seg.slots[:seg.past + len(seg.ids)]))
                 for seg in segments)
    work = StepWork(segs, (max(local.values()) + 1) if local else 0, tuple(local[s] for s in read),
                    k.cpu(), v.cpu(), every_position)
    return work, local


def run(runner, work: StepWork) -> StepOut:
    """The worker's side: ``work`` through ``runner.forward_paged`` on a pool of its own slots.
    ``runner`` is a ``ModelRunner`` on the worker's device."""
    local = KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype, runner.device,
                   budget_bytes=max(1, work.num_slots) * runner.kv_bytes_per_token)
    taken = local.alloc(local.capacity)  # every local slot is this call's: none is handed out again
    assert taken is not None
    if work.read_slots:
        local.write_from(work.read_slots, work.k.to(runner.device), work.v.to(runner.device))
    return _forward(runner, local, work.segments, work.every_position)


def _forward(runner, local: KVPool, segments: Sequence[LocalSegment], every_position: bool) -> StepOut:
    paged = [PagedSegment(s.ids, s.past, s.slots, contiguous_runs(s.slots)) for s in segments]
    runner.synchronize()
    t0 = time.perf_counter()
    logits = runner.forward_paged(local, paged, every_position=every_position)
    runner.synchronize()
    device_ms = (time.perf_counter() - t0) * 1000
    written = [s for seg in segments for s in seg.slots[seg.past:seg.past + len(seg.ids)]]
    shape = (runner.num_layers, runner.num_kv_heads, len(written), runner.head_dim)
    k = torch.empty(shape, dtype=runner.dtype, device=runner.device)
    v = torch.empty(shape, dtype=runner.dtype, device=runner.device)
    local.read_into(written, k, v)
    return StepOut(tuple(segments), logits.cpu(), k.cpu(), v.cpu(), device_ms)


def apply(pool: KVPool, to_pool: dict[int, int], step: StepOut) -> torch.Tensor:
    """One forward's new KV into ``pool`` (``to_pool``: local -> pool slot); returns its logits on
    the pool's device."""
    written = [to_pool[s] for seg in step.segments for s in seg.slots[seg.past:seg.past + len(seg.ids)]]
    if step.k.shape[2] != len(written):
        raise ValueError(f"the call returned KV for {step.k.shape[2]} tokens, the forward wrote {len(written)}")
    pool.write_from(written, step.k.to(pool.device), step.v.to(pool.device))
    return step.logits.to(pool.device)
