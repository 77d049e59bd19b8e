"""One forward's rows, how a step packs them, and running the forward.

Owns: ``Batch`` (prefill chunks, then one decode token per decoding request), the packing of a step's model work (chunked prefill: at most
``chunk_tokens`` prompt tokens per step, prompts with fewer chunks done first so a
short newcomer is not stuck behind a long prompt, after a minimum share for the oldest
prompt so steady arrivals cannot starve it, packed with every request in
decode; a request that asked for its prompt's log-probabilities prefills in forwards of its own,
because only a lone prompt chunk's forward keeps every position's logits (``every_position``): a
packed forward keeps each row's last; no other flag changes the packing) and ``forward``: the rows as paged segments
through the ``ModelRunner``, timed. Knows nothing about what the logits become
(``postprocess``) or who was admitted (``admission``)::

    prompt ids:  [0 ....... cached) [cached .. start) [start .. start+n) ...
                  the tree's slots   earlier chunks    this step's chunk
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.kvcache.kv_pool import KVPool
from engine.kvcache.prefix_cache import RequestSlots
from engine.model.paged_attention import PagedSegment
from engine.model.runner import ModelRunner, RowFuture
from engine.namespaces import owner_of
from engine.scheduler.request import Request, State
from engine.types import OutOfMemoryFault


@dataclass(frozen=True)
class Chunk:
    request: Request
    start: int  # first prompt position computed
    num_tokens: int


@dataclass(frozen=True)
class Batch:
    """The rows of one forward: ``chunks`` first (prompt chunks), then ``decoding``."""

    kind: str  # "prefill", "decode" or "mixed"
    chunks: tuple[Chunk, ...] = ()
    decoding: tuple[Request, ...] = ()

    @property
    def every_position(self) -> bool:
        """A lone prompt chunk of a request that asked for its prompt's log-probabilities: the
        forward keeps the logits of every position, not only the last."""
        return (self.kind == "prefill" and len(self.chunks) == 1 and not self.decoding
                and self.chunks[0].request.req.prompt_logprobs is not None)

    @property
    def rows(self) -> list[Request]:
        return [c.request for c in self.chunks] + list(self.decoding)

    def slots_of(self, r: Request) -> RequestSlots:
        rs = r.kv.slots
        assert rs is not None
        return rs

    def segments(self) -> list[PagedSegment]:
        segs = []
        for c in self.chunks:
            rs = self.slots_of(c.request)
            segs.append(PagedSegment(c.request.ids[c.start:c.start + c.num_tokens], c.start, rs.slots, rs.runs()))
        for r in self.decoding:
            rs = self.slots_of(r)
            segs.append(PagedSegment([r.answer.out_ids[-1]], rs.length, rs.slots, rs.runs()))
        return segs


@dataclass(frozen=True)
class Output:
    logits: torch.Tensor | None  # a row per segment; None when the forward failed
    duration_ms: float = 0.0
    # ``Batch.every_position``: the chunk's logits at every position, ``[num_tokens, vocab]``
    # (``logits`` is its last row, the one the next token is sampled from)
    every_position: torch.Tensor | None = None
    error: BaseException | None = None  # the whole forward failed: every row fails
    row_errors: dict[int, BaseException] | None = None  # these rows failed alone; the others' logits stand


def pack(running: list[Request], budget: int, oldest_min_tokens: int = 0,
         by_owner: bool = False) -> tuple[list[Batch], int]:
    """This step's prefill and decode forwards (the lone prefills of requests timed side by side
    or scoring their prompt first, then the packed one) and what is left of the token ``budget``.

    Prompts with fewer chunks done go first (a short newcomer is not stuck behind a long
    prompt), but the oldest prompt in prefill takes ``oldest_min_tokens`` of the budget before
    anyone: under steady arrivals, each with no chunk done, it would otherwise never get a
    token while holding its reserved slots. With ``by_owner`` (a public deployment) the
    prompts of visitors with fewer running requests go before those of visitors with more, so
    a visitor who arrives beside a classroom (or a flood) behind one address is prefilled first,
    as ``policy`` admitted it first."""
    prefills = [r for r in running if r.state is State.PREFILL]
    take: dict[int, int] = {}  # request seq -> tokens this step
    if prefills and oldest_min_tokens > 0 and budget > 0:
        oldest = min(prefills, key=lambda r: r.seq)
        n = min(len(oldest.ids) - oldest.prefilled, oldest_min_tokens, budget)
        take[oldest.seq] = n
        budget -= n
    load = running_per_owner(running) if by_owner else {}
    order = sorted(prefills, key=lambda r: (load.get(owner_of(r.namespace), 0), r.timings.prefill_chunks, r.seq))
    for r in order:
        if budget <= 0:
            break
        n = min(len(r.ids) - r.prefilled - take.get(r.seq, 0), budget)
        take[r.seq] = take.get(r.seq, 0) + n
        budget -= n
    own, packed = [], []
    for r in order:
        n = take.get(r.seq, 0)
        if n > 0:
            # Only a lone chunk's forward keeps every position's logits (``Batch.every_position``).
            alone = r.req.prompt_logprobs is not None
            (own if alone else packed).append(Chunk(r, r.prefilled, n))
    decoding = tuple(r for r in running if r.state is State.DECODE)
    batches = [Batch("prefill", (c,)) for c in own]
    if packed or decoding:
        kind = "decode" if not packed else "prefill" if not decoding else "mixed"
        batches.append(Batch(kind, tuple(packed), decoding))
    return batches, budget


def running_per_owner(running: list[Request]) -> dict[str, int]:
    """Running requests per owner (``engine.namespaces.owner_of``): what turns count by."""
    counts: dict[str, int] = {}
    for r in running:
        v = owner_of(r.namespace)
        counts[v] = counts.get(v, 0) + 1
    return counts


def forward(runner: ModelRunner, pool: KVPool, batch: Batch) -> Output:
    """Run ``batch`` through the model; a failure comes back as ``Output.error`` (its rows fail).
    Out of device memory with several rows: each row runs again alone, and only the rows that
    fail alone fail (``Output.row_errors``); a lone run rewrites only that row's own slots."""
    segments = batch.segments()
    t0 = time.perf_counter()
    try:
        if batch.every_position:
            rows = runner.forward_paged(pool, segments, every_position=True)
            runner.synchronize()
            return Output(rows[-1:], runner.forward_ms((time.perf_counter() - t0) * 1000), every_position=rows)
        futures = None if runner.in_process_forwards else _futures(batch)  # only a runner that computes elsewhere
        logits = (runner.forward_paged(pool, segments) if futures is None
                  else runner.forward_paged(pool, segments, ahead=futures))
        runner.synchronize()
        return Output(logits, runner.forward_ms((time.perf_counter() - t0) * 1000))
    except OutOfMemoryFault as exc:
        if len(segments) < 2:
            return Output(None, error=exc)
    except Exception as exc:
        return Output(None, error=exc)
    return _one_by_one(runner, pool, segments, t0)


def _futures(batch: Batch) -> tuple[RowFuture, ...] | None:
    """A decode-only forward's rows as ``RowFuture``s (a runner computing elsewhere may run the
    next steps ahead; the local runner ignores them)."""
    if batch.kind != "decode" or batch.chunks:
        return None
    return tuple(RowFuture(r.req.sampling, tuple(r.answer.out_ids), r.max_new_tokens) for r in batch.decoding)


def _one_by_one(runner: ModelRunner, pool: KVPool, segments: list[PagedSegment], t0: float) -> Output:
    rows: list[torch.Tensor | None] = []
    errors: dict[int, BaseException] = {}
    for i, seg in enumerate(segments):
        try:
            rows.append(runner.forward_paged(pool, [seg])[0])
        except Exception as exc:
            rows.append(None)
            errors[i] = exc
    if len(errors) == len(segments):
        return Output(None, error=errors[0])
    like = next(r for r in rows if r is not None)
    logits = torch.stack([r if r is not None else torch.zeros_like(like) for r in rows])
    runner.synchronize()
    return Output(logits, (time.perf_counter() - t0) * 1000, row_errors=errors)
