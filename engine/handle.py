"""The caller's side of one request: the handle ``EngineAPI.submit`` returns.

Owns: ``RequestHandle`` (iterate it for ``GenerationEvent``s; ``cancel()`` stops the work at
the next step; a consumer that stops iterating cancels), the ``END_OF_STREAM`` marker that
closes its event queue, and ``request_key``: the request's ``CacheKey`` (namespace and
shareable length, set by server code). Both engines, local and remote, hand these out.
Knows nothing about the scheduler, the cache or HTTP.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence

from engine.types import CacheKey, GenerationEvent, GenerationRequest

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
