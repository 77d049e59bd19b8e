"""One visitor turn as one GPU call: what goes in, what streams out, both sides.

Main process, ``pack``: the request's pool slots (its cached prefix, then its own) renumbered as a
small local pool (``step_call.local_numbering``: the same runs of contiguous slots, so the worker's
plan is the one the main process would build and the forward is the same computation), the KV of
the positions already computed as CPU tensors, the ids still to compute before the next token,
the sampling parameters, the answer so far with the seeded sampler's state, and how many tokens
may still come.

Worker, ``run`` (a generator, streamed out by ``spaces``): a ``KVPool`` of the local slots on the
worker's device, the KV written in, then exactly the forwards the scheduler will ask for, in its
order: the forward it was asked for, the rest of the prompt in chunks of ``chunk_tokens`` (a
prompt's chunked prefill, as the scheduler splits a lone prompt), then one decode forward
per token, each token picked from the returned logits as ``postprocess`` will pick it
(``sampling.sample``, the same generator state), stopping where the main process stops (an
end-of-sequence token, the last token). Each forward is yielded as soon as it is done, as a
``Step`` (its logits and the new KV, CPU tensors: a CUDA tensor must never leave a ZeroGPU call).

Main process, ``Step.matches`` and ``apply``: a step is used only for the very forward it was
computed for (same ids at the same position); its KV goes into the pool of record at that
forward's slots. Knows nothing about requests, Gradio or ``spaces``: ``turns`` makes the calls.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from engine.kvcache.kv_pool import KVPool, contiguous_runs
from engine.model import sampling
from engine.model.paged_attention import PagedSegment
from engine.types import SamplingParams
from engine.zerogpu.step_call import local_numbering


@dataclass(frozen=True)
class TurnWork:
    """What one turn's GPU call carries in."""

    ids: tuple[int, ...]  # computed first, from position ``past``: the uncached prompt, or the last token
    first: int  # of which the first forward takes this many (the forward the scheduler asked), then chunks
    past: int  # positions whose KV is sent
    slots: tuple[int, ...]  # local slot of every position the request holds (prompt and answer)
    num_slots: int  # the local pool's size
    k: torch.Tensor  # [layer, kv_head, past, head_dim], CPU: the KV of slots[:past]
    v: torch.Tensor
    chunk_tokens: int  # the scheduler's prefill chunk
    sampling: SamplingParams
    history: tuple[int, ...]  # the answer so far
    generator_state: torch.Tensor | None  # the request's seeded sampler, where it samples
    max_new_tokens: int
    eos_ids: frozenset[int]
    cold: bool = False  # no call has come back whole yet: the worker likely starts (the weights to its GPU)
    kv_bytes_per_token: int = 0  # what each position computed brings back

    @property
    def kv_bytes(self) -> int:
        """KV bytes in (the positions already computed) and out (those this call computes)."""
        return self.nbytes + self.kv_bytes_per_token * (len(self.ids) + self.new_tokens)

    @property
    def new_tokens(self) -> int:
        """Decode forwards this call may run."""
        return max(0, self.max_new_tokens - len(self.history) - 1)

    @property
    def nbytes(self) -> int:
        """KV bytes in."""
        return self.k.numel() * self.k.element_size() * 2


@dataclass(frozen=True)
class Step:
    """One forward the call ran: where, its logits row, the KV it wrote (CPU tensors)."""

    ids: tuple[int, ...]
    past: int
    logits: torch.Tensor  # [vocab]: the row the next token is picked from
    k: torch.Tensor  # [layer, kv_head, len(ids), head_dim]
    v: torch.Tensor
    device_ms: float  # the forward alone, on the worker's device

    def matches(self, segment: PagedSegment) -> bool:
        return self.past == int(segment.past) and self.ids == tuple(int(t) for t in segment.ids)


def pack(pool: KVPool, segment: PagedSegment, chunk_tokens: int, sampling_params: SamplingParams,
         history: Sequence[int], generator: torch.Generator | None, max_new_tokens: int,
         eos_ids: Sequence[int], prompt_rest: Sequence[int] = (), cold: bool = False) -> TurnWork:
    """The call's input for a request whose next forward is ``segment`` (over ``pool``'s slots).
    ``prompt_rest``: the prompt's ids after this segment's, when it is a prefill chunk."""
    slots = list(segment.slots)
    local = local_numbering([PagedSegment(segment.ids, segment.past, slots, segment.runs)],
                            extra=len(slots) - segment.past - len(segment.ids))
    past = int(segment.past)
    shape = (pool.num_layers, pool.num_kv_heads, past, pool.head_dim)
    k = torch.empty(shape, dtype=pool.dtype, device=pool.device)
    v = torch.empty(shape, dtype=pool.dtype, device=pool.device)
    if past:
        pool.read_into(slots[:past], k, v)
    ids = tuple(int(t) for t in segment.ids) + tuple(int(t) for t in prompt_rest)
    return TurnWork(ids=ids, first=len(segment.ids), past=past, slots=tuple(local[s] for s in slots),
                    num_slots=max(local.values()) + 1, k=k.cpu(), v=v.cpu(), chunk_tokens=max(1, int(chunk_tokens)),
                    sampling=sampling_params,
                    history=tuple(int(t) for t in history),
                    generator_state=None if generator is None else generator.get_state(),
                    max_new_tokens=int(max_new_tokens), eos_ids=frozenset(int(t) for t in eos_ids), cold=cold,
                    kv_bytes_per_token=pool.bytes_per_token)


def run(runner, work: TurnWork) -> Iterator[Step]:
    """The worker's side: the turn's forwards on ``runner`` (a ``ModelRunner`` on this worker's
    device), each yielded as soon as it is done."""
    device = runner.device
    local = KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype, device,
                   budget_bytes=max(1, work.num_slots) * runner.kv_bytes_per_token)
    taken = local.alloc(local.capacity)  # every local slot is this call's
    assert taken is not None
    if work.past:
        local.write_from(work.slots[:work.past], work.k.to(device), work.v.to(device))
    generator = None
    if work.generator_state is not None:
        generator = torch.Generator()
        generator.set_state(work.generator_state)
    history = list(work.history)
    past, todo, take = work.past, list(work.ids), work.first
    while True:
        while todo:  # the asked forward, then the prompt's chunks (or the one token a decode forward computes)
            ids, todo, take = todo[:take], todo[take:], work.chunk_tokens
            step = _forward(runner, local, work.slots, tuple(ids), past)
            past += len(ids)
            yield step
        tok = sampling.sample(step.logits, work.sampling, generator, history)
        if tok in work.eos_ids and not work.sampling.ignore_eos:
            return  # the main process ends the answer here
        history.append(tok)
        if len(history) >= work.max_new_tokens or past + 1 > len(work.slots):
            return  # its last token: no forward after it
        todo = [tok]


def _forward(runner, local: KVPool, slots: Sequence[int], ids: tuple[int, ...], past: int) -> Step:
    mine = list(slots[:past + len(ids)])
    segment = PagedSegment(list(ids), past, mine, contiguous_runs(mine))
    runner.synchronize()
    t0 = time.perf_counter()
    logits = runner.forward_paged(local, [segment])
    runner.synchronize()
    device_ms = (time.perf_counter() - t0) * 1000
    written = mine[past:]
    shape = (runner.num_layers, runner.num_kv_heads, len(written), runner.head_dim)
    k = torch.empty(shape, dtype=runner.dtype, device=runner.device)
    v = torch.empty(shape, dtype=runner.dtype, device=runner.device)
    local.read_into(written, k, v)
    return Step(ids, past, logits[0].cpu(), k.cpu(), v.cpu(), device_ms)


def apply(pool: KVPool, segment: PagedSegment, step: Step) -> torch.Tensor:
    """``step``'s KV into ``pool`` at ``segment``'s slots; returns its logits row on the pool's device."""
    written = list(segment.slots[segment.past:segment.past + len(segment.ids)])
    if step.k.shape[2] != len(written):
        raise ValueError(f"the call returned KV for {step.k.shape[2]} tokens, the forward wrote {len(written)}")
    pool.write_from(written, step.k.to(pool.device), step.v.to(pool.device))
    return step.logits.to(pool.device)
