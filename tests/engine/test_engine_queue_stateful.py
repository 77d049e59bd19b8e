"""A model-based test of the engine's front door (``Engine.submit``): the inbox cap, one address's
share of it under isolation, cancellation, bad input and many threads at once, in random orders
against a plain count (tiny random Llama, real engine, real worker thread).

The engine's steps are held at a gate (``StepGate``) while the machine runs, so nothing is
admitted behind the model's back: every accepted request waits (in the worker's hand, the
inbox or the scheduler's waiting list) until ``drain`` lets every step through, and the model's
count of waiting requests is exact. A cancelled request still holds its place until a step
drops it. After a drain every stream has ended (an answer or a cancellation), nothing waits
and the cache is clean (``assert_clean``)."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.namespaces import owner_of
from engine.types import EngineBusy, EngineError, GenerationRequest, SamplingParams
from tests.engines import EngineFactory, machine_runner
from tests.helpers_app import StepGate, assert_clean, wait_for, wait_idle

MAX_QUEUE = 6  # so one address may hold 3 waiting places under isolation
MAX_PROMPT = 48
NAMESPACES = ("v-a/s-1", "v-a/s-2", "v-b/s-1", "v-c/s-1", "v-c/s-1/lab")  # v-a: one address, two tabs



def _request(namespace: str, length: int, seed: int, new_tokens: int = 2) -> GenerationRequest:
    rnd = random.Random(seed)
    return GenerationRequest(prompt_ids=tuple(rnd.randrange(100, 5000) for _ in range(length)), namespace=namespace,
                             sampling=SamplingParams(max_new_tokens=new_tokens))


class EngineQueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.factory = EngineFactory(machine_runner)
        self.engine = self.gate = None
        self.live: list[tuple[object, str]] = []  # (handle, namespace): accepted, not drained
        self.isolation = False

    def teardown(self) -> None:
        if self.gate is not None:
            self.gate.open()
        self.factory.close_all()

    @initialize(isolation=st.booleans())
    def start(self, isolation):
        self.isolation = isolation
        self.engine = self.factory(isolation=isolation, max_queue=MAX_QUEUE, max_new_tokens_cap=2,
                                   max_prompt_tokens=MAX_PROMPT)
        self.gate = StepGate(self.engine)

    # ------------------------------------------------------------ the model
    def _refusal(self, namespace: str) -> str | None:
        """What the model says a submit from ``namespace`` gets now: None (accepted) or the refusal."""
        if len(self.live) >= MAX_QUEUE:
            return "too many requests are waiting"
        mine = sum(owner_of(ns) == owner_of(namespace) for _, ns in self.live)
        if self.isolation and mine >= self.engine.max_waiting_per_owner:
            return f"you already have {mine} requests waiting"
        return None

    def _settle(self) -> None:
        """The first request after a drain: the worker takes it and parks at the gate."""
        wait_for(lambda: self.gate.held, timeout_s=60, what="the worker at the gate")

    # ------------------------------------------------------------ rules
    @rule(ns=st.sampled_from(NAMESPACES), length=st.integers(1, MAX_PROMPT), seed=st.integers(0, 99))
    def submit(self, ns, length, seed):
        expected = self._refusal(ns)
        try:
            handle = self.engine.submit(_request(ns, length, seed))
        except EngineBusy as exc:
            assert expected is not None and expected in str(exc), (expected, str(exc))
            return
        assert expected is None, f"accepted past the cap: {expected}"
        self.live.append((handle, ns))
        if len(self.live) == 1:
            self._settle()

    @precondition(lambda self: self.live)  # the worker is parked: submits from threads race only each other
    @rule(ns=st.sampled_from(NAMESPACES), k=st.integers(2, 6))
    def burst(self, ns, k):
        """``k`` threads submit from one namespace at once: exactly the places left are taken."""
        room = MAX_QUEUE - len(self.live)
        if self.isolation:
            mine = sum(owner_of(n) == owner_of(ns) for _, n in self.live)
            room = min(room, self.engine.max_waiting_per_owner - mine)
        got, refused, start = [], [], threading.Barrier(k)

        def one(i: int) -> None:
            start.wait()
            try:
                got.append(self.engine.submit(_request(ns, 8, 1000 + i)))
            except EngineBusy:
                refused.append(i)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        self.live += [(h, ns) for h in got]
        assert len(got) == max(0, min(k, room)) and len(got) + len(refused) == k, (room, len(got), len(refused))

    @rule(ns=st.sampled_from(NAMESPACES), how=st.sampled_from(["too-long", "no-tokens", "nan-temperature",
                                                                "bad-sampling", "huge-token"]))
    def bad_input(self, ns, how):
        """Bad input: a clear refusal whatever the queue holds, and nothing changes."""
        before = self.engine.stats().queue_depth
        if how == "too-long":
            req = _request(ns, MAX_PROMPT + 1, 0)
        elif how == "no-tokens":
            req = GenerationRequest(prompt_ids=(), namespace=ns)
        elif how == "nan-temperature":
            req = GenerationRequest(prompt_ids=(5, 6), namespace=ns, sampling=SamplingParams(temperature=float("nan")))
        elif how == "bad-sampling":
            req = GenerationRequest(prompt_ids=(5, 6), namespace=ns, sampling=None)
        else:
            req = GenerationRequest(prompt_ids=(5, 10**9), namespace=ns)
        with pytest.raises(EngineError) as caught:
            self.engine.submit(req)
        assert not isinstance(caught.value, EngineBusy) or self._refusal(ns) is not None
        assert self.engine.stats().queue_depth == before

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 50))
    def cancel(self, i):
        """A cancelled request keeps its place until a step drops it (the model keeps counting it)."""
        self.live[i % len(self.live)][0].cancel()

    @rule()
    def drain(self):
        """Every step through: every stream ends, nothing waits, the cache is clean; the gate shuts again."""
        self.gate.open()
        for handle, _ in self.live:
            events = list(handle)  # ends: a cancelled request's stream may end with no event at all
            assert handle.cancelled.is_set() or (events and events[-1].done), events[-1:]
        wait_idle(self.engine)
        assert self.engine.stats().queue_depth == 0
        assert_clean(self.engine)
        self.live.clear()
        self.gate.close()

    # ------------------------------------------------------------ invariants
    @invariant()
    def counts(self):
        if self.engine is None:
            return
        assert self.engine.stats().queue_depth == len(self.live)
        if self.isolation:
            for owner in {owner_of(ns) for ns in NAMESPACES}:
                waiting = [ns for ns in self.engine._waiting_namespaces() if owner_of(ns) == owner]
                assert len(waiting) == sum(owner_of(ns) == owner for _, ns in self.live)
        assert self.engine.healthy()


TestEngineQueue = EngineQueueMachine.TestCase
TestEngineQueue.settings = settings(max_examples=12, stateful_step_count=30, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])
