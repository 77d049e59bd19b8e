"""Torch work runs on the runner's one compute thread, whoever asks (one OpenMP pool)."""

from __future__ import annotations

import threading

import pytest

from engine.compute_thread import ComputeThread, in_fresh_thread
from engine.engine import Engine
from engine.types import GenerationRequest, SamplingParams


def test_call_runs_there_returns_and_raises():
    ct = ComputeThread(name="test-compute")
    assert ct.call(lambda: threading.current_thread().name) == "test-compute"
    assert ct.call(lambda a, b=0: a + b, 2, b=3) == 5
    with pytest.raises(ValueError, match="boom"):
        ct.call(lambda: (_ for _ in ()).throw(ValueError("boom")))
    assert ct.call(lambda: ct.call(lambda: 7)) == 7  # nested: runs directly, no deadlock
    ct.stop()


def test_calls_from_many_threads_are_serialised():
    ct = ComputeThread()
    inside, overlap = [0], []

    def work(i):
        inside[0] += 1
        overlap.append(inside[0])
        inside[0] -= 1
        return i

    results = [None] * 32

    def client(i):
        results[i] = ct.call(work, i)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == list(range(32)) and max(overlap) == 1
    ct.stop()


def test_in_fresh_thread_returns_and_raises():
    assert in_fresh_thread(lambda: threading.current_thread() is not threading.main_thread())
    with pytest.raises(KeyError):
        in_fresh_thread(dict().__getitem__, "missing")


def test_forwards_and_engine_steps_run_on_the_compute_thread(tiny_runner, monkeypatch):
    seen: set[str] = set()
    original = type(tiny_runner).forward_packed.__wrapped__  # the method under the thread hop

    def spy(self, segments):
        seen.add(threading.current_thread().name)
        return original(self, segments)

    monkeypatch.setattr(type(tiny_runner), "forward_packed",
                        lambda self, segments: self.compute.call(spy, self, segments))
    engine = Engine(tiny_runner, max_batch=4)
    req = GenerationRequest(prompt="hello there", sampling=SamplingParams(max_new_tokens=4))
    handles = [engine.submit(req) for _ in range(3)]
    for h in handles:
        list(h)
    engine.close()
    assert seen == {"model-compute"}
    kv = tiny_runner.new_request_kv(8)
    tiny_runner.forward_last([1, 2, 3], kv)  # from the test's own thread: hops over
    assert kv.length == 3
