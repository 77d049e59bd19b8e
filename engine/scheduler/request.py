"""One request inside the engine: its handle to the caller and its running state.

Owns: the ``Request`` the scheduler moves through its states, and every change to it::

    WAITING --admit--> PREFILL --start_decode--> DECODE --finish--> --leave--> DONE
       |                  |  complete_chunk          |  complete_decode, append_token ^
       +------------------+--------------------------+--------- leave (failed) -------+

Its state is split by who reads it, each part a small dataclass changed only through
methods (here, in this module; ``tests/engine/test_request_state.py`` checks no other
module assigns a field): ``KVBookkeeping`` (the pool slots it holds, what its prompt found
in the cache and gave back to it), ``Answer`` (the output ids, their text, detokenized
incrementally, their log-probabilities where asked, the seeded sampler, why it ended), ``Timings`` (timestamps and counters
for the metrics) and ``PolicyMemo`` (what the waiting order remembers between steps).
The transitions check their invariants (a chunk never computes past the prompt, a
request finishes once) and raise ``IllegalTransition`` on a bug. Knows nothing about
the model or the cache: the scheduler does the work and reports it here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch

from engine.handle import END_OF_STREAM, RequestHandle, request_key
from engine.kvcache.prefix_cache import RequestSlots
from engine.text.detokenizer import Detokenizer
from engine.types import CacheKey, GenerationEvent, GenerationRequest, RequestMetrics, SamplingParams, TokenLogprob


class State(Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


class IllegalTransition(RuntimeError):
    """A request was asked to change in a way its state does not allow (a scheduler bug)."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise IllegalTransition(message)


@dataclass
class KVBookkeeping:
    """The pool slots a request holds, and what its prompt found in and gave to the cache.

    ``slots``: the cached prefix's (locked), then its own. The counts outlive the slots, for
    the metrics."""

    slots: RequestSlots | None = None
    cached_tokens: int = 0
    tier_tokens: int = 0  # of the cached ones, loaded back from the second tier
    tier_load_ms: float = 0.0
    path: tuple[int, ...] = ()  # node ids of the match at admission
    inserted_tokens: int = 0  # new tokens its KV added to the tree

    def hold(self, rs: RequestSlots) -> None:
        self.slots = rs
        self.cached_tokens, self.path = rs.cached_tokens, rs.path
        self.tier_tokens, self.tier_load_ms = rs.tier_tokens, rs.tier_load_ms

    def adopted(self, num_tokens: int) -> None:
        """``num_tokens`` of its KV passed to the tree as new tokens."""
        self.inserted_tokens += num_tokens

    def hand_back(self) -> list[RequestSlots]:
        """Let go of every slot set it holds; the caller releases them to the cache."""
        held = [self.slots] if self.slots is not None else []
        self.slots = None
        return held

    @property
    def holds_slots(self) -> bool:
        return self.slots is not None


@dataclass
class Answer:
    """The output so far: ids, their text, the sampler that draws them, and why it ended."""

    out_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per appended token, where asked
    # the prompt's scored tokens (positions 1..), gathered chunk by chunk until the prefill ends
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "cancelled" once finished
    generator: torch.Generator | None = None
    _detokenizer: Detokenizer | None = field(default=None, repr=False)  # made with the first token

    def seed(self, params: SamplingParams) -> None:
        if params.temperature > 0:
            seed = params.seed if params.seed is not None else int(time.time_ns() % 2**31)
            self.generator = torch.Generator().manual_seed(seed)

    def append(self, token_id: int, decode: Callable[[Sequence[int]], str],
               logprob: TokenLogprob | None = None) -> str:
        """Add a sampled token (and its log-probability, where asked); return the text so far
        (without a trailing partial character).

        Incremental (``engine.text.detokenizer``): a short window per token, so a long answer
        costs linear time. The final text is decoded whole at the end (``settle_text``)."""
        self.out_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)
        if self._detokenizer is None:
            self._detokenizer = Detokenizer(decode)
        self._detokenizer.feed(token_id)
        self.text = self._detokenizer.text
        return self.text

    def finish(self, reason: str) -> None:
        self.finish_reason = reason

    def settle_text(self, decode: Callable[[Sequence[int]], str]) -> None:
        self.text = decode(self.out_ids)


@dataclass
class Timings:
    """Timestamps (``time.perf_counter`` seconds) and counters the request's metrics report."""

    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    prefill_ms: float = 0.0  # admission's match and slot bookkeeping, then its prefill forwards
    prefill_chunks: int = 0
    prefill_shared_step: bool = False  # a prefill forward had other rows
    batch_sizes: list[int] = field(default_factory=list)  # rows of each decode forward

    def admitted(self, started_at: float, now: float) -> None:
        self.admitted_at = started_at
        self.prefill_ms = (now - started_at) * 1000

    def prefill_forward(self, duration_ms: float, batch_size: int) -> None:
        self.prefill_ms += duration_ms
        self.prefill_chunks += 1
        self.prefill_shared_step = self.prefill_shared_step or batch_size > 1

    def token_sampled(self, now: float) -> None:
        if self.first_token_at is None:
            self.first_token_at = now

    def token_streamed(self, now: float) -> None:
        self.last_token_at = now


@dataclass
class PolicyMemo:
    """What the waiting order remembers between steps."""

    match_len: int = 0  # cached prefix length, as last matched
    match_checked_at: float = -1.0
    queue_ahead: int = -1  # requests ahead, as last reported

    def matched(self, match_len: int, now: float) -> None:
        self.match_len, self.match_checked_at = match_len, now

    def place(self, ahead: int) -> bool:
        """Record ``ahead`` requests in front; True when that changed (worth an event)."""
        changed = ahead != self.queue_ahead
        self.queue_ahead = ahead
        return changed


class Request:
    """A request the scheduler runs; one per submitted handle."""

    def __init__(self, handle: RequestHandle, key: CacheKey, max_new_tokens: int, seq: int) -> None:
        self.handle = handle
        self.req: GenerationRequest = handle.request
        self.ids: list[int] = list(handle.ids or ())
        self.key = key
        self.max_new_tokens = max_new_tokens
        self.seq = seq  # arrival order
        self.state = State.WAITING
        self.kv = KVBookkeeping()
        self.answer = Answer()
        self.timings = Timings()
        self.memo = PolicyMemo()

    # ----------------------------------------------------------------- facts
    @property
    def request_id(self) -> int:
        return self.handle.request_id

    @property
    def namespace(self) -> str:
        return self.key.namespace

    @property
    def cancelled(self) -> bool:
        return self.handle.cancelled.is_set()

    @property
    def prefilled(self) -> int:
        """Prompt tokens whose KV is in the pool (cached plus computed so far)."""
        return min(self.kv.slots.length, len(self.ids)) if self.kv.slots is not None else 0

    @property
    def capacity_tokens(self) -> int:
        return len(self.ids) + self.max_new_tokens

    @property
    def finish_reason(self) -> str:
        """Why the answer ended; asked only once it has."""
        if self.answer.finish_reason is None:
            raise IllegalTransition(f"request {self.request_id} has not finished")
        return self.answer.finish_reason

    def reply_key(self) -> CacheKey:
        """The key of the prompt plus the reply whose KV is in the pool (for caching both)."""
        assert self.kv.slots is not None
        return request_key(self.ids + self.answer.out_ids[: self.kv.slots.length - len(self.ids)], self.req)

    def emit(self, event: GenerationEvent | BaseException | object) -> None:
        self.handle.events.put(event)

    def end(self, metrics: RequestMetrics | None = None) -> None:
        """Close the stream: with ``metrics``, after the final ``done`` event that carries them
        (a request that never ran or failed ends without one)."""
        if metrics is not None:
            n = len(self.ids)
            self.emit(GenerationEvent(text=self.answer.text, done=True, metrics=metrics, phase="done",
                                      prompt_tokens=n, cached_tokens=self.kv.cached_tokens, prefilled_tokens=n))
        self.emit(END_OF_STREAM)

    # ----------------------------------------------------------- transitions
    def admit(self, rs: RequestSlots, started_at: float, now: float) -> None:
        """Into prefill with the slots admission acquired (match from ``started_at`` until ``now``)."""
        _require(self.state is State.WAITING, f"admit in state {self.state.value}")
        _require(rs.cached_tokens < len(self.ids) or not self.ids, "the last prompt token is always computed")
        self.kv.hold(rs)
        self.timings.admitted(started_at, now)
        self.answer.seed(self.req.sampling)
        self.state = State.PREFILL

    def complete_chunk(self, start: int, num_tokens: int, duration_ms: float, batch_size: int) -> None:
        """A prefill forward wrote prompt positions ``[start, start + num_tokens)``."""
        rs = self.kv.slots
        if self.state is not State.PREFILL or rs is None:
            raise IllegalTransition(f"prefill chunk in state {self.state.value}")
        if start != rs.length or start + num_tokens > len(self.ids):
            raise IllegalTransition(f"chunk [{start}, {start + num_tokens}) with {rs.length} of "
                                    f"{len(self.ids)} prompt positions written")
        rs.length = start + num_tokens
        self.timings.prefill_forward(duration_ms, batch_size)

    def start_decode(self) -> None:
        """The whole prompt is in the pool: the next tokens are the answer's."""
        _require(self.state is State.PREFILL and self.prefilled == len(self.ids),
                 f"decode with {self.prefilled} of {len(self.ids)} prompt tokens in state {self.state.value}")
        self.state = State.DECODE

    def complete_decode(self, batch_size: int) -> None:
        """A decode forward wrote the last token's KV, in a batch of ``batch_size`` rows."""
        rs = self.kv.slots
        if self.state is not State.DECODE or rs is None:
            raise IllegalTransition(f"decode step in state {self.state.value}")
        if rs.length >= len(rs.slots):
            raise IllegalTransition("a decode step past the slots reserved for the answer")
        rs.length += 1
        self.timings.batch_sizes.append(batch_size)

    def token_sampled(self, now: float) -> None:
        """A token was sampled (or, with no new tokens asked for, the prompt is done) at ``now``."""
        self.timings.token_sampled(now)

    def append_token(self, token_id: int, now: float, decode: Callable[[Sequence[int]], str],
                     logprob: TokenLogprob | None = None) -> str:
        """Stream a sampled (non-eos) token, with its log-probability where asked; returns the text so far."""
        if self.state is not State.DECODE:
            raise IllegalTransition(f"a token appended in state {self.state.value}")
        if len(self.answer.out_ids) >= self.max_new_tokens:
            raise IllegalTransition("more tokens than max_new_tokens")
        self.timings.token_streamed(now)
        return self.answer.append(token_id, decode, logprob)

    def prompt_scored(self, start: int, entries: Sequence[TokenLogprob]) -> None:
        """Log-probabilities of prompt positions ``[start, start + len(entries))``, from a prefill chunk."""
        if self.state is not State.PREFILL:
            raise IllegalTransition(f"prompt logprobs in state {self.state.value}")
        if start != len(self.answer.prompt_logprobs) + 1 or start + len(entries) > len(self.ids):
            raise IllegalTransition(f"prompt logprobs for [{start}, {start + len(entries)}) after "
                                    f"{len(self.answer.prompt_logprobs)} scored of {len(self.ids)}")
        self.answer.prompt_logprobs.extend(entries)

    def take_prompt_logprobs(self) -> tuple[TokenLogprob | None, ...]:
        """The whole prompt's log-probabilities (None for the first token), handed out once: the
        request keeps none of them after (a long prompt's would be a big record)."""
        if len(self.answer.prompt_logprobs) != len(self.ids) - 1:
            raise IllegalTransition(f"{len(self.answer.prompt_logprobs)} prompt logprobs for {len(self.ids)} tokens")
        out: tuple[TokenLogprob | None, ...] = (None, *self.answer.prompt_logprobs)
        self.answer.prompt_logprobs.clear()
        return out

    def adopted(self, num_tokens: int) -> None:
        """Its KV passed to the tree, ``num_tokens`` of them new there."""
        self.kv.adopted(num_tokens)

    def finish(self, reason: str) -> None:
        """The answer is over (``reason``: "stop", "length" or "cancelled"); once only."""
        _require(self.answer.finish_reason is None, f"finished twice ({self.answer.finish_reason}, then {reason})")
        _require(self.state in (State.PREFILL, State.DECODE), f"finish in state {self.state.value}")
        self.answer.finish(reason)

    def hand_back_slots(self) -> list[RequestSlots]:
        """Every slot set it holds, now held by nobody: the caller releases them to the cache."""
        return self.kv.hand_back()

    def leave(self) -> None:
        """Out of the scheduler (done or failed), its slots already handed back."""
        _require(self.state is not State.DONE, "left twice")
        _require(not self.kv.holds_slots, "left while holding pool slots")
        self.state = State.DONE
