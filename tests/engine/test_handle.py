"""The caller's side of a request (``engine.handle``): a slow consumer takes events in batches
and skips none; an error is raised after the events queued before it; the thread and the
event-loop consumers see the same events; stopping early cancels the request."""

from __future__ import annotations

import asyncio

import pytest

from engine.handle import END_OF_STREAM, RequestHandle
from engine.types import EngineError, GenerationEvent, GenerationRequest


def handle_with(*items) -> RequestHandle:
    h = RequestHandle(GenerationRequest(prompt_ids=(1, 2, 3)))
    for item in items:
        h.events.put(item)
    return h


def ev(text: str) -> GenerationEvent:
    return GenerationEvent(text=text)


def test_a_slow_consumer_takes_what_was_queued_in_one_batch():
    h = handle_with(ev("a"), ev("ab"), ev("abc"))
    batches = h.batches()
    assert [e.text for e in next(batches)] == ["a", "ab", "abc"]
    h.events.put(ev("abcd"))
    h.events.put(END_OF_STREAM)
    assert [e.text for e in next(batches)] == ["abcd"]
    with pytest.raises(StopIteration):
        next(batches)
    assert h.cancelled.is_set()


def test_an_error_comes_after_the_events_before_it_in_every_consumer():
    items = (ev("a"), ev("ab"), EngineError("out of room"), ev("never"))
    got = []
    with pytest.raises(EngineError, match="out of room"):
        for batch in handle_with(*items).batches():
            got.extend(e.text for e in batch)
    assert got == ["a", "ab"]
    got = []
    with pytest.raises(EngineError, match="out of room"):
        for e in handle_with(*items):
            got.append(e.text)
    assert got == ["a", "ab"]

    async def consume():
        out = []
        with pytest.raises(EngineError, match="out of room"):
            async for e in handle_with(*items):
                out.append(e.text)
        return out

    assert asyncio.run(consume()) == ["a", "ab"]


def test_stopping_early_cancels():
    h = handle_with(ev("a"), ev("ab"))
    for _ in h:
        break
    assert h.cancelled.is_set()
