"""One request inside the engine: its handle to the caller and its running state.

Owns: the ``Request`` object the scheduler moves through its states (waiting -> prefill
-> decode -> [baseline] -> done): token ids, the request's KV slots in the pool, the
output so far and its text (detokenized incrementally), the seeded sampler,
timings and counters for the metrics. Knows nothing about the model or the
cache: the scheduler does the work and writes the results here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from enum import Enum

import torch

from engine.handle import END_OF_STREAM, RequestHandle, request_key
from engine.kvcache.prefix_cache import RequestSlots
from engine.text.detokenizer import Detokenizer
from engine.types import CacheKey, GenerationEvent, GenerationRequest, RequestMetrics


class State(Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    BASELINE = "baseline"
    DONE = "done"


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
        # KV (pool slots: the cached prefix's, locked, then its own) and the cache
        self.slots: RequestSlots | None = None
        self.cached_tokens = 0
        self.tier_tokens = 0  # of the cached ones, loaded back from the second tier
        self.tier_load_ms = 0.0
        self.inserted_tokens = 0
        self.path: tuple[int, ...] = ()
        # prefill
        self.prefill_ms = 0.0
        self.prefill_chunks = 0
        self.prefill_shared_step = False
        # output
        self.out_ids: list[int] = []
        self.text = ""
        self._detokenizer: Detokenizer | None = None  # made with the first token's decode
        self.generator: torch.Generator | None = None
        self.finish_reason = "length"
        # timings (perf_counter seconds) and batch sizes
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.batch_sizes: list[int] = []
        # the no-reuse baseline, measured after the answer as work of its own
        self.baseline_slots: RequestSlots | None = None
        self.baseline_ms: float | None = None
        # policy bookkeeping
        self.match_len = 0
        self.match_checked_at = -1.0
        self.last_queue_ahead = -1

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
        return min(self.slots.length, len(self.ids)) if self.slots is not None else 0

    @property
    def capacity_tokens(self) -> int:
        return len(self.ids) + self.max_new_tokens

    def reply_key(self) -> CacheKey:
        """The key of the prompt plus the reply whose KV is in the pool (for caching both)."""
        assert self.slots is not None
        return request_key(self.ids + self.out_ids[: self.slots.length - len(self.ids)], self.req)

    def emit(self, event: GenerationEvent | BaseException | object) -> None:
        self.handle.events.put(event)

    def end(self, metrics: RequestMetrics | None = None) -> None:
        """Close the stream: with ``metrics``, after the final ``done`` event that carries them
        (a request that never ran or failed ends without one)."""
        if metrics is not None:
            n = len(self.ids)
            self.emit(GenerationEvent(text=self.text, done=True, metrics=metrics, phase="done", prompt_tokens=n,
                                      cached_tokens=self.cached_tokens, prefilled_tokens=n))
        self.emit(END_OF_STREAM)

    # ------------------------------------------------------------ the answer
    def append_token(self, token_id: int, decode: Callable[[Sequence[int]], str]) -> str:
        """Add a sampled token; return the text so far (without a trailing partial character).

        Incremental (``engine.text.detokenizer``): a short window per token, so a long answer
        costs linear time. The final text is decoded whole at the end anyway.
        """
        self.out_ids.append(token_id)
        if self._detokenizer is None:
            self._detokenizer = Detokenizer(decode)
        self._detokenizer.feed(token_id)
        self.text = self._detokenizer.text
        return self.text

    def seed_generator(self) -> None:
        params = self.req.sampling
        if params.temperature > 0:
            seed = params.seed if params.seed is not None else int(time.time_ns() % 2**31)
            self.generator = torch.Generator().manual_seed(seed)
