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

Decode ahead: a forward of decode rows only may come with each row's ``RowFuture``. The worker
then keeps going, up to ``ahead_steps`` more forwards: it picks each row's next token from its
logits as the main process will (``sampling.sample``, greedy rows only), drops a row whose pick
ends it (an end-of-sequence token, its last token), and runs the next forward over the slots the
row already holds. Each forward comes back as its own ``StepOut``; the main process uses one only
when the scheduler then asks for exactly that forward (same ids, positions and slots), so a guess
that was wrong costs time, never a different answer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kvcache.kv_pool import KVPool, contiguous_runs
from engine.model import sampling
from engine.model.paged_attention import PagedSegment
from engine.model.runner import RowFuture


@dataclass(frozen=True)
class LocalSegment:
    ids: tuple[int, ...]
    past: int
    slots: tuple[int, ...]  # local slot numbers


@dataclass(frozen=True)
class StepWork:
    """What one GPU call carries in."""

    segments: tuple[LocalSegment, ...]  # each with ``ahead_steps`` more slots where it holds them
    ahead: tuple[RowFuture, ...] | None  # decode rows only: the forwards after this one may be run too
    ahead_steps: int  # at most this many forwards after the first
    num_slots: int  # the local pool's size
    read_slots: tuple[int, ...]  # local slots whose KV is sent, in the order of ``k``/``v``'s token axis
    k: torch.Tensor  # [layer, kv_head, len(read_slots), head_dim], CPU
    v: torch.Tensor
    every_position: bool

    @property
    def tokens(self) -> int:
        return sum(len(s.ids) for s in self.segments) * (1 + self.ahead_steps)

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


@dataclass(frozen=True)
class StepResult:
    """What one GPU call brings back: the asked forward first, then any run ahead."""

    steps: tuple[StepOut, ...]


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


def signature(segments: Sequence[PagedSegment] | Sequence[LocalSegment], to_local: dict[int, int] | None = None):
    """What makes two forwards the same computation on the same KV: ids, positions, slots."""
    out = []
    for seg in segments:
        slots = seg.slots[:seg.past + len(seg.ids)]
        out.append((tuple(int(t) for t in seg.ids), int(seg.past),
                    tuple(to_local[s] for s in slots) if to_local is not None else tuple(slots)))
    return tuple(out)


def pack(pool: KVPool, segments: Sequence[PagedSegment], every_position: bool = False,
         ahead: Sequence[RowFuture] | None = None, ahead_steps: int = 0) -> tuple[StepWork, dict[int, int]]:
    """The call's input for ``segments`` over ``pool``, and the pool -> local slot numbering."""
    if ahead is None or len(ahead) != len(segments) or any(len(s.ids) != 1 for s in segments):
        ahead, ahead_steps = None, 0
    local = local_numbering(segments, ahead_steps)
    read = sorted({s for seg in segments for s in seg.slots[:seg.past]})
    shape = (pool.num_layers, pool.num_kv_heads, len(read), pool.head_dim)
    k = torch.empty(shape, dtype=pool.dtype)
    v = torch.empty(shape, dtype=pool.dtype)
    if read:
        k_dev, v_dev = (k, v) if pool.device.type == "cpu" else (k.to(pool.device), v.to(pool.device))
        pool.read_into(read, k_dev, v_dev)
        k, v = k_dev.cpu(), v_dev.cpu()
    segs = tuple(LocalSegment(tuple(int(t) for t in seg.ids), int(seg.past),
                              tuple(local[s] for s in seg.slots[:seg.past + len(seg.ids) + ahead_steps]))
                 for seg in segments)
    work = StepWork(segs, None if ahead is None else tuple(ahead), ahead_steps,
                    (max(local.values()) + 1) if local else 0, tuple(local[s] for s in read), k, v, every_position)
    return work, local


def run(runner, work: StepWork) -> StepResult:
    """The worker's side: ``work`` through ``runner.forward_paged`` on a pool of its own slots,
    then the forwards ahead, if asked. ``runner`` is a ``ModelRunner`` on the device (the caller
    is its compute thread, or a worker forked from it)."""
    local = KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype, runner.device,
                   budget_bytes=max(1, work.num_slots) * runner.kv_bytes_per_token)
    taken = local.alloc(local.capacity)  # every local slot is this call's: none is handed out again
    assert taken is not None
    if work.read_slots:
        local.write_from(work.read_slots, work.k.to(runner.device), work.v.to(runner.device))
    segments = [LocalSegment(s.ids, s.past, s.slots[:s.past + len(s.ids)]) for s in work.segments]
    steps = [_forward(runner, local, segments, work.every_position)]
    rows = list(range(len(segments)))  # which of work.segments each current segment is
    history = [list(f.history) for f in work.ahead or ()]
    for _ in range(work.ahead_steps if work.ahead else 0):
        nxt, keep = [], []
        for j, i in enumerate(rows):
            future, full = work.ahead[i], work.segments[i].slots
            tok = sampling.sample(steps[-1].logits[j].float(), future.sampling, None, history[i])
            history[i].append(tok)
            if tok in runner.text.eos_ids and not future.sampling.ignore_eos:
                continue  # the main process ends this row here
            if len(history[i]) >= future.max_new_tokens:
                continue  # its last token: no forward after it
            past = segments[j].past + 1
            if past + 1 > len(full):
                return StepResult(tuple(steps))  # no slot for it here
            nxt.append(LocalSegment((tok,), past, full[:past + 1]))
            keep.append(i)
        if not nxt:
            break
        segments, rows = nxt, keep
        steps.append(_forward(runner, local, segments, False))
    return StepResult(tuple(steps))


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
