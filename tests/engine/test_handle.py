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


def test_the_compute_thread_holds_wake_ups_until_it_lets_them_go():
    """A put on a thread that holds (the compute thread) queues the event at once but wakes the
    consumer only at ``release_signals``; several puts make one wake-up; a put on any other thread
    wakes at once; the compute thread lets go at the end of every call."""
    import threading

    from engine.held_signals import holding, release_signals
    from engine.model.compute_thread import ComputeThread

    async def consume(h: RequestHandle, producer) -> list[str]:
        loop = asyncio.get_running_loop()
        got: list[str] = []

        async def read() -> None:
            async for e in h:
                got.append(e.text)

        task = asyncio.create_task(read())
        await asyncio.sleep(0.05)  # the reader awaits
        await loop.run_in_executor(None, producer, got)
        await asyncio.wait_for(task, 5)
        return got

    def holding_producer(h: RequestHandle):
        def produce(got: list[str]) -> None:
            seen: list[list[str]] = []

            def body() -> None:
                holding()
                h.events.put(ev("a"))
                h.events.put(ev("ab"))
                assert h.events.qsize() == 2  # queued, not signalled
                threading.Event().wait(0.1)
                seen.append(list(got))  # nobody woke the reader
                release_signals()
                threading.Event().wait(0.1)
                seen.append(list(got))
                h.events.put(END_OF_STREAM)
                release_signals()

            t = threading.Thread(target=body)
            t.start()
            t.join()
            assert seen == [[], ["a", "ab"]]

        return produce

    h = RequestHandle(GenerationRequest(prompt_ids=(1,)))
    assert asyncio.run(consume(h, holding_producer(h))) == ["a", "ab"]

    # Elsewhere: at once, and a blocked thread consumer too.
    h = RequestHandle(GenerationRequest(prompt_ids=(1,)))
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(e.text for e in h))
    reader.start()
    h.events.put(ev("x"))
    h.events.put(END_OF_STREAM)
    reader.join(5)
    assert out == ["x"] and not reader.is_alive()
    release_signals()  # a thread that holds nothing: nothing to do

    # The compute thread holds, and lets go when its call ends even with no kernel after the put.
    compute = ComputeThread("test-compute")
    try:
        h = RequestHandle(GenerationRequest(prompt_ids=(1,)))
        compute.call(lambda: (h.events.put(ev("y")), h.events.put(END_OF_STREAM)))
        assert [e.text for e in h] == ["y"]
    finally:
        compute.stop(join_timeout_s=5)


def test_a_failing_wake_up_is_reported_not_raised(caplog):
    import threading

    from engine.held_signals import hold_signal, holding, release_signals

    calls: list[str] = []

    def body() -> None:
        holding()
        hold_signal(lambda: 1 / 0)
        hold_signal(lambda: calls.append("second"))
        release_signals()
        release_signals()  # nothing left

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert calls == ["second"] and "wake-up failed" in caplog.text
