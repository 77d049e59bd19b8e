"""One request inside the engine: its handle to the caller and its running state.

Owns: the ``RequestHandle`` a caller iterates (events in, cancel out), the
``END_OF_STREAM`` marker that closes its event queue, the request's ``CacheKey``
(``request_key``: namespace and shareable length, set by server code) and the
``Request`` object the scheduler moves through its states (waiting -> prefill
-> decode -> [baseline] -> done): token ids, the request's KV slots in the pool, the
output so far and its text (detokenized incrementally), the seeded sampler,
timings and counters for the metrics. Knows nothing about the model or the
cache: the scheduler does the work and writes the results here.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from enum import Enum

import torch

from engine.prefix_cache import RequestSlots
from engine.radix_tree import CacheKey
from engine.text.detokenizer import Detokenizer
from engine.types import GenerationEvent, GenerationRequest, RequestMetrics

END_OF_STREAM = object()  # the last item on a handle's event queue


def request_key(ids: Sequence[int], request: GenerationRequest) -> CacheKey:
    """The cache key of ``ids`` for ``request``: its namespace, and the shareable (public)
    length clamped to ``ids``. The namespace is set by server code (the UI passes
    ``PUBLIC`` unless isolation is on; the ordering lab uses one namespace per variant)."""
    return CacheKey(tuple(ids), request.namespace, max(0, min(request.public_len, len(ids))))


class RequestHandle:
    """A submitted request: iterate it for events; ``cancel()`` stops it at the next step."""

    def __init__(self, request: GenerationRequest, ids: list[int] | None = None, request_id: int = 0) -> None:
        self.request = request
        self.ids = ids
        self.request_id = request_id
        self.events: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()
        self.submitted_at = time.perf_counter()

    def cancel(self) -> None:
        self.cancelled.set()

    def __iter__(self) -> Iterator[GenerationEvent]:
        try:
            while True:
                item = self.events.get()
                if item is END_OF_STREAM:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.cancel()  # a consumer that stops listening stops the work


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
