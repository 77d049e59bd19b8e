"""Request order under a small cache: first-come-first-served against longest-prefix-match first.

Owns: running one queue of waiting requests through a dedicated small-budget
``Engine`` built on the app's ``ModelRunner`` (``runner.lock`` serialises model
use with the app's engine), once per policy from an empty cache, and the
per-policy results. Every number comes from the real engine.

- ``fcfs``: requests run in arrival order.
- ``lpm``: before each request, the scheduler matches every waiting request
  against the tree and runs the one with the longest cached prefix (ties: the
  earliest), as SGLang's scheduler does with its ``lpm`` policy. Requests that
  share a prefix then run back to back, before eviction can take that prefix
  away. (SGLang falls back to FCFS for very long queues, where matching every
  request costs too much; and LPM can delay a lone request: fairness is the price.)

The engine runs one request at a time, so a "batch" here is one request.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from engine.engine import Engine
from engine.lab.ordering_runs import LabPrompt, RunTotals, lab_request
from engine.model_runner import ModelRunner
from engine.types import EngineBusy, EngineError, GenerationRequest, SamplingParams

FCFS, LPM = "fcfs", "lpm"
POLICY_NAMES = {FCFS: "first-come-first-served", LPM: "longest-prefix-match first"}


@dataclass(frozen=True)
class ScheduledRequest:
    run_position: int  # when it ran, from 0
    queue_index: int  # where it stood in the queue, from 0
    label: str
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    prefill_ms: float
    match_at_pick: int  # cached prefix the scheduler saw when it picked this request


@dataclass(frozen=True)
class ScheduleResult(RunTotals):
    policy: str
    requests: tuple[ScheduledRequest, ...]  # in the order they ran
    planned: int
    budget_tokens: int
    evicted_tokens: int


@dataclass(frozen=True)
class ScheduleProgress:
    done: int
    total: int
    message: str
    results: tuple[ScheduleResult, ...]
    finished: bool = False
    stopped: bool = False


class RequestOrderDemo:
    """A small-budget engine of its own, on a shared runner; one comparison at a time."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._engine: Engine | None = None
        self._busy = threading.Lock()

    def _engine_for(self, budget_tokens: int) -> Engine:
        budget = budget_tokens * self.runner.kv_bytes_per_token
        if self._engine is None:
            self._engine = Engine(self.runner, budget_bytes=budget, max_queue=4)
        else:
            self._engine.clear_cache()
            self._engine.set_budget(budget)
        return self._engine

    def compare(self, prompts: Sequence[LabPrompt], budget_tokens: int, policies: Sequence[str] = (FCFS, LPM),
                max_new_tokens: int = 1, should_stop: Callable[[], bool] | None = None) -> Iterator[ScheduleProgress]:
        """Run the queue once per policy, each from an empty cache of ``budget_tokens``.

        Raises ``EngineBusy`` if another comparison is running, ``EngineError`` for
        bad prompts or settings (before running anything)."""
        if not prompts:
            raise EngineError("Nothing to schedule: the queue is empty.")
        if budget_tokens < 1:
            raise EngineError("The cache budget must hold at least one token.")
        if any(p not in POLICY_NAMES for p in policies):
            raise EngineError(f"Unknown policy; use one of {', '.join(POLICY_NAMES)}.")
        if not self._busy.acquire(blocking=False):
            raise EngineBusy("Another visitor is running the request-order demo right now; try again in a moment.")
        try:
            yield from self._compare(prompts, int(budget_tokens), policies, max_new_tokens, should_stop)
        finally:
            self._busy.release()

    def _compare(self, prompts, budget_tokens, policies, max_new_tokens, should_stop) -> Iterator[ScheduleProgress]:
        engine = self._engine_for(budget_tokens)
        ids = [engine.prompt_ids(lab_request(p)) for p in prompts]
        stop = should_stop or (lambda: False)
        sampling = SamplingParams(max_new_tokens=max(1, int(max_new_tokens)))
        total, done, results = len(prompts) * len(policies), 0, []
        for policy in policies:
            engine.clear_cache()
            evicted_before = engine.cache.evicted_tokens
            waiting = list(range(len(prompts)))
            ran: list[ScheduledRequest] = []
            while waiting and not stop():
                matches = {i: engine.cache.match_len(engine.cache_key(ids[i], _req(ids[i], sampling)))
                           for i in waiting}
                pick = waiting[0] if policy == FCFS else max(waiting, key=lambda i: (matches[i], -i))
                waiting.remove(pick)
                m = engine.run(_req(ids[pick], sampling))
                ran.append(ScheduledRequest(len(ran), pick, prompts[pick].label, m.prompt_tokens, m.cached_tokens,
                                            m.computed_tokens, m.prefill_ms, matches[pick]))
                done += 1
                current = ScheduleResult(policy, tuple(ran), len(prompts), budget_tokens,
                                         engine.cache.evicted_tokens - evicted_before)
                yield ScheduleProgress(done, total, f"{POLICY_NAMES[policy]}: request {len(ran)} of {len(prompts)}",
                                       tuple(results) + (current,))
            results.append(ScheduleResult(policy, tuple(ran), len(prompts), budget_tokens,
                                          engine.cache.evicted_tokens - evicted_before))
            engine.check_invariants()
            if stop() or waiting:
                engine.clear_cache()
                yield ScheduleProgress(done, total, "Stopped.", tuple(results), finished=True, stopped=True)
                return
        engine.clear_cache()  # give the memory back between demos
        yield ScheduleProgress(done, total, "Done.", tuple(results), finished=True)


def _req(ids: Sequence[int], sampling: SamplingParams) -> GenerationRequest:
    return GenerationRequest(prompt_ids=tuple(ids), sampling=sampling, tag="scheduling-lab")


_LABS: dict[int, RequestOrderDemo] = {}
_LABS_LOCK = threading.Lock()


def request_order_demo_for(engine: Engine) -> RequestOrderDemo:
    """One ``RequestOrderDemo`` (and so one small engine) per model runner, built on first use."""
    runner = engine.runner
    with _LABS_LOCK:
        lab = _LABS.get(id(runner))
        if lab is None or lab.runner is not runner:
            lab = _LABS[id(runner)] = RequestOrderDemo(runner)
        return lab
