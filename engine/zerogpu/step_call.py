"""One forward as plain data, for a GPU call in another process: what goes in, what comes back.

Main process, ``pack``: the forward's segments over the pool's slots become segments over a
small local pool of just the slots they touch, numbered in the same order with a one-slot gap
wherever the pool's slots are not consecutive. So every segment keeps its runs of contiguous
slots and a prefix shared by several rows stays one shared run: the worker's ``PagedPlan`` is
the one the main process would build, and the forward is the same computation, bit for bit. The
KV of every slot read (each segment's ``past``) goes along, as CPU tensors.

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
    write_slots: tuple[int, ...]  # local slots the forward writes, in the order they come back
    every_position: bool

    @property
    def tokens(self) -> int:
        return sum(len(s.ids) for s in self.segments)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


@dataclass(frozen=True)
class StepResult:
    """What one GPU call brings back."""

    logits: torch.Tensor  # as ``forward_paged`` returns them, CPU
    k: torch.Tensor  # [layer, kv_head, len(write_slots), head_dim], CPU
    v: torch.Tensor
    device_ms: float  # the forward alone, on the device


def local_numbering(segments: Sequence[PagedSegment]) -> dict[int, int]:
    """Pool slot -> local slot over every slot the segments touch: ascending, a one-slot gap
    where the pool's slots are not consecutive (runs neither merge nor split)."""
    used = sorted({s for seg in segments for s in seg.slots[:seg.past + len(seg.ids)]})
    local: dict[int, int] = {}
    nxt, prev = 0, None
    for s in used:
        if prev is not None and s != prev + 1:
            nxt += 1  # the gap
        local[s] = nxt
        nxt, prev = nxt + 1, s
    return local


def pack(pool: KVPool, segments: Sequence[PagedSegment], every_position: bool = False) -> tuple[StepWork, list[int]]:
    """The call's input for ``segments`` over ``pool``, and the pool slots its result writes."""
    local = local_numbering(segments)
    read = sorted({s for seg in segments for s in seg.slots[:seg.past]})
    written = [s for seg in segments for s in seg.slots[seg.past:seg.past + len(seg.ids)]]
    shape = (pool.num_layers, pool.num_kv_heads, len(read), pool.head_dim)
    k = torch.empty(shape, dtype=pool.dtype)
    v = torch.empty(shape, dtype=pool.dtype)
    if read:
        k_dev, v_dev = (k, v) if pool.device.type == "cpu" else (k.to(pool.device), v.to(pool.device))
        pool.read_into(read, k_dev, v_dev)
        k, v = k_dev.cpu(), v_dev.cpu()
    segs = tuple(LocalSegment(tuple(int(t) for t in seg.ids), int(seg.past),
                              tuple(local[s] for s in seg.slots[:seg.past + len(seg.ids)])) for seg in segments)
    work = StepWork(segs, (max(local.values()) + 1) if local else 0, tuple(local[s] for s in read), k, v,
                    tuple(local[s] for s in written), every_position)
    return work, written


def run(runner, work: StepWork) -> StepResult:
    """The worker's side: ``work`` through ``runner.forward_paged`` on a pool of its own slots.
    ``runner`` is a ``ModelRunner`` on the device (the caller is its compute thread, or a worker
    forked from it)."""
    local = KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype, runner.device,
                   budget_bytes=max(1, work.num_slots) * runner.kv_bytes_per_token)
    taken = local.alloc(local.capacity)  # every local slot is this call's: none is handed out again
    assert taken is not None
    if work.read_slots:
        local.write_from(work.read_slots, work.k.to(runner.device), work.v.to(runner.device))
    segments = [PagedSegment(s.ids, s.past, s.slots, contiguous_runs(s.slots)) for s in work.segments]
    runner.synchronize()
    t0 = time.perf_counter()
    logits = runner.forward_paged(local, segments, every_position=work.every_position)
    runner.synchronize()
    device_ms = (time.perf_counter() - t0) * 1000
    shape = (runner.num_layers, runner.num_kv_heads, len(work.write_slots), runner.head_dim)
    k = torch.empty(shape, dtype=runner.dtype, device=runner.device)
    v = torch.empty(shape, dtype=runner.dtype, device=runner.device)
    local.read_into(work.write_slots, k, v)
    return StepResult(logits.cpu(), k.cpu(), v.cpu(), device_ms)


def apply(pool: KVPool, written: Sequence[int], result: StepResult) -> torch.Tensor:
    """The call's new KV into ``pool`` at ``written``; returns the logits on the pool's device."""
    if result.k.shape[2] != len(written):
        raise ValueError(f"the call returned KV for {result.k.shape[2]} tokens, the forward wrote {len(written)}")
    pool.write_from(written, result.k.to(pool.device), result.v.to(pool.device))
    return result.logits.to(pool.device)
