"""The caller's side of one request: the handle ``EngineAPI.submit`` returns.

Owns: ``RequestHandle`` (iterate it for ``GenerationEvent``s, in a thread with ``for`` or on
an event loop with ``async for``; ``cancel()`` stops the work at the next step; a consumer
that stops iterating cancels), its ``EventQueue``, the ``END_OF_STREAM`` marker that closes
it, and ``request_key``: the request's ``CacheKey`` (namespace and shareable length, set by
server code). Both engines, local and remote, hand these out. Knows nothing about the
scheduler, the cache or HTTP.

Why ``async for`` matters: an HTTP server on asyncio that reads a thread-blocking queue
needs a worker thread per stream and a hop into it per token (``to_thread.run_sync(next)``),
all under the one GIL the engine's step needs too. Awaiting instead, the engine's thread
wakes the loop with ``call_soon_threadsafe`` at most once per batch of events (one per step
per stream) and the consumer takes everything queued by then.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence

from engine.held_signals import hold_signal
from engine.types import CacheKey, GenerationEvent, GenerationRequest

END_OF_STREAM = object()  # the last item on a handle's event queue


def request_key(ids: Sequence[int], request: GenerationRequest) -> CacheKey:
    """The cache key of ``ids`` for ``request``: its namespace, and the shareable (public)
    length clamped to ``ids``. The namespace is set by server code (the UI passes
    ``PUBLIC`` unless isolation is on; the ordering lab uses one namespace per variant)."""
    return CacheKey(tuple(ids), request.namespace, max(0, min(request.public_len, len(ids))))


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class EventQueue:
    """One request's events: engine threads ``put``; ONE consumer takes them, either a thread
    (``get`` blocks) or a coroutine (``get_batch`` awaits, no thread)."""

    def __init__(self) -> None:
        self._items: deque = deque()
        self._cond = threading.Condition(threading.Lock())
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None  # an awaiting consumer
        self._signal_pending = False  # a wake-up is held or under way (``put``)

    def put(self, item: object) -> None:
        with self._cond:
            self._items.append(item)
            pending, self._signal_pending = self._signal_pending, True
        if pending:
            return  # a wake-up is on its way already: the consumer takes this item with it
        if not hold_signal(self._signal):  # the compute thread holds it until its kernels start
            self._signal()

    def _signal(self) -> None:
        """Wake the consumer: a thread blocked in ``get_all``, or an awaiting coroutine."""
        with self._cond:
            self._signal_pending = False
            waiter, self._waiter = self._waiter, None  # one wake per batch: later puts find it gone
            self._cond.notify()
        if waiter is not None:
            loop, fut = waiter
            try:
                loop.call_soon_threadsafe(_wake, fut)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
                pass

    def get_all(self) -> list:
        """Every item queued now (at least one); blocks the calling thread while there is none."""
        with self._cond:
            while not self._items:
                self._cond.wait()
            items = list(self._items)
            self._items.clear()
            return items

    def qsize(self) -> int:
        with self._cond:
            return len(self._items)

    async def get_batch(self) -> list:
        """Every item queued now (at least one), awaiting on the running loop while there is none."""
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._items:
                    items = list(self._items)
                    self._items.clear()
                    return items
                fut = loop.create_future()
                self._waiter = (loop, fut)
            try:
                await fut
            finally:
                with self._cond:
                    if self._waiter is not None and self._waiter[1] is fut:
                        self._waiter = None


class RequestHandle:
    """A submitted request: iterate it for events; ``cancel()`` stops it at the next step."""

    def __init__(self, request: GenerationRequest, ids: list[int] | None = None, request_id: int = 0) -> None:
        self.request = request
        self.ids = ids
        self.request_id = request_id
        self.events = EventQueue()
        self.cancelled = threading.Event()
        self.submitted_at = time.perf_counter()

    def cancel(self) -> None:
        self.cancelled.set()

    def batches(self) -> Iterator[list[GenerationEvent]]:
        """The events in batches: everything queued by the time the consumer asks (a consumer
        slower than the engine, such as a page redrawing its answer, takes several at once and
        skips none). An error event is raised after the events before it."""
        try:
            while True:
                events, end = _split(self.events.get_all())
                if events:
                    yield events
                if end is not None:
                    _finish(end)
                    return
        finally:
            self.cancel()  # a consumer that stops listening stops the work

    def __iter__(self) -> Iterator[GenerationEvent]:
        for events in self.batches():
            yield from events

    async def __aiter__(self) -> AsyncIterator[GenerationEvent]:
        """The same events on an event loop, without a thread (see the module docstring)."""
        try:
            while True:
                events, end = _split(await self.events.get_batch())
                for event in events:
                    yield event
                if end is not None:
                    _finish(end)
                    return
        finally:
            self.cancel()


def _split(items: list) -> tuple[list[GenerationEvent], object | None]:
    """(the events before the stream's end, the end: ``END_OF_STREAM``, an exception, or None)."""
    for i, item in enumerate(items):
        if item is END_OF_STREAM or isinstance(item, BaseException):
            return items[:i], item
    return items, None


def _finish(end: object) -> None:
    if isinstance(end, BaseException):
        raise end
