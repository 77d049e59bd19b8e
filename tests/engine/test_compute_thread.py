"""Torch work runs on the runner's one compute thread, whoever asks (one OpenMP pool)."""

from __future__ import annotations

import threading

import pytest

from engine.model.compute_thread import ComputeThread, in_fresh_thread
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


def test_forwards_and_engine_steps_run_on_the_compute_thread(tiny_runner, monkeypatch, make_engine):
    seen: set[str] = set()
    original = type(tiny_runner).forward_paged.__wrapped__  # the method under the thread hop

    def spy(self, pool, segments):
        seen.add(threading.current_thread().name)
        return original(self, pool, segments)

    # On the instance: an earlier test's monkeypatch may have left a bound method there.
    monkeypatch.setattr(tiny_runner, "forward_paged",
                        lambda pool, segments: tiny_runner.compute.call(spy, tiny_runner, pool, segments))
    engine = make_engine(max_batch=4)
    req = GenerationRequest(prompt="hello there", sampling=SamplingParams(max_new_tokens=4))
    handles = [engine.submit(req) for _ in range(3)]
    for h in handles:
        list(h)
    engine.close()
    assert seen == {"model-compute"}
    kv = tiny_runner.new_request_kv(8)
    tiny_runner.forward_last([1, 2, 3], kv)  # from the test's own thread: hops over
    assert kv.length == 3


EXIT_RIGHT_AFTER_AN_ANSWER = """
import sys
sys.path.insert(0, {root!r})
from tests.conftest import make_tiny_runner
from engine.model.loader import load_tokenizer
from engine.engine import Engine
from engine.types import GenerationRequest, SamplingParams
engine = Engine(make_tiny_runner(load_tokenizer()))  # by hand: a script of its own, no fixtures
print(len(engine.run(GenerationRequest(prompt="hi", sampling=SamplingParams(max_new_tokens=3))).output_ids))
"""


def test_a_script_that_exits_right_after_an_answer_exits_cleanly():
    """The process used to abort ("terminate called without an active exception") when it ended
    while the compute thread was still inside the step that produced the answer."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", EXIT_RIGHT_AFTER_AN_ANSWER.format(root=root)],
                              capture_output=True, text=True, timeout=120, cwd=root,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip().endswith("3")


def test_a_call_after_stop_raises_instead_of_waiting_forever():
    from engine.types import EngineFault

    ct = ComputeThread(name="stopping-compute")
    assert ct.call(lambda: 1) == 1
    ct.stop(join_timeout_s=5)
    outcome: list[object] = []

    def late_call() -> None:
        try:
            outcome.append(ct.call(lambda: 2))
        except EngineFault as exc:
            outcome.append(exc)

    t = threading.Thread(target=late_call, daemon=True)
    t.start()
    t.join(timeout=5)
    assert not t.is_alive(), "call() after stop() blocked"
    assert len(outcome) == 1 and isinstance(outcome[0], EngineFault)
    assert "stopping-compute" in str(outcome[0]) and "stopped" in str(outcome[0])
    ct.stop()  # twice: harmless


def test_turn_lock_counts_its_waiters_and_works_as_a_lock():
    import threading
    import time

    from engine.model.compute_thread import TurnLock

    lock = TurnLock()
    assert not lock.waiting and not lock.locked()
    with lock:
        assert lock.locked() and not lock.acquire(blocking=False)
        got = threading.Event()
        t = threading.Thread(target=lambda: (lock.acquire(), got.set(), lock.release()))
        t.start()
        deadline = time.monotonic() + 10
        while not lock.waiting and time.monotonic() < deadline:
            time.sleep(0.001)
        assert lock.waiting and not got.is_set()  # blocked, and seen as waiting
    t.join(10)
    assert got.is_set() and not lock.waiting and not lock.locked()
    # Free again: the waiter took it and let it go, so a try without waiting gets it at once.
    assert lock.acquire(timeout=0), "the lock is still held after the waiter released it"
    assert lock.locked() and not lock.waiting
    lock.release()
    assert not lock.locked()


def test_two_engines_on_one_runner_take_turns_step_by_step(tiny_runner, make_engine):
    """A worker pauses between its steps only when another waits for the runner's lock, and then
    the other gets its turn: two engines on one runner both make progress while both have work."""
    from engine.types import GenerationRequest, SamplingParams

    a = make_engine(budget_bytes=200 * tiny_runner.kv_bytes_per_token)
    b = a.spawn(200 * tiny_runner.kv_bytes_per_token)
    try:
        import threading
        import time

        req = GenerationRequest(prompt_ids=tuple(range(20, 40)), sampling=SamplingParams(max_new_tokens=40))
        times: dict[str, list[float]] = {"a": [], "b": []}
        finals = {}

        def read(name, handle):
            for ev in handle:
                times[name].append(time.monotonic())
                if ev.metrics is not None:
                    finals[name] = ev.metrics

        with tiny_runner.lock:  # both queued before either runs
            readers = [threading.Thread(target=read, args=(n, e.submit(req))) for n, e in (("a", a), ("b", b))]
            for t in readers:
                t.start()
        for t in readers:
            t.join(60)
        assert finals["a"].output_ids == finals["b"].output_ids and len(finals["a"].output_ids) == 40
        # Each one's tokens came while the other's were still coming: they took turns, not one after the other.
        assert times["a"][0] < times["b"][-1] and times["b"][0] < times["a"][-1]
        # Step by step: the engines' forwards alternate often (on this 2-core machine 36-77 switches
        # in 80 forwards with the pause when someone waits, depending on how soon the waiting worker
        # gets a core; 24-27 without any pause). Counted on the forwards' own end times, not on when
        # the reading threads woke (those also wait for a core).
        merged = sorted([(s.finished_at, "a") for s in a.step_log()] + [(s.finished_at, "b") for s in b.step_log()])
        assert len(merged) >= 80
        assert sum(1 for x, y in zip(merged, merged[1:], strict=False) if x[1] != y[1]) >= 30
    finally:
        b.close()
        a.close()


def test_requests_caught_by_a_stopped_compute_thread_end_with_an_error(tokenizer, make_engine):
    """The hang two full runs met (issue 58's shutdown): a test ran ``app.main``, whose exit
    stops the engine's runner, on the session's shared runner; every later request on it waited
    forever, taken from the inbox by a worker whose step could never start. Now each request
    the worker holds or the inbox holds ends with one error, and a later submit is refused."""
    from engine.types import EngineFault
    from tests.conftest import make_tiny_runner

    runner = make_tiny_runner(tokenizer)  # its own: it is stopped below
    engine = make_engine(runner)
    req = GenerationRequest(prompt_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=2))
    with runner.lock:  # the worker takes the first request, then waits here for its step
        handles = [engine.submit(req) for _ in range(3)]
        runner.close(timeout_s=5)
    outcomes: list[object] = []

    def drain(h) -> None:
        try:
            outcomes.append(list(h))
        except Exception as exc:  # noqa: BLE001 - the outcome is what is checked
            outcomes.append(exc)

    threads = [threading.Thread(target=drain, args=(h,), daemon=True) for h in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads), "a request was left waiting on a stopped compute thread"
    assert len(outcomes) == 3 and all(isinstance(o, Exception) for o in outcomes), outcomes
    assert all("stopped" in str(o) for o in outcomes), outcomes
    with pytest.raises(EngineFault, match="shut down"):
        engine.submit(req)
