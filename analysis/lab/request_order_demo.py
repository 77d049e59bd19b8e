"""Request order under a small cache: first-come-first-served against longest-prefix-match first.

Owns: running one queue of waiting requests through a dedicated small-budget
engine that the app's engine spawns on its own model (``EngineAPI.spawn``; their
steps take turns on the model), once per policy from an empty cache, and the
per-policy results. Every number comes from the real engine, and the order
comes from the real scheduler's admission order (``engine/scheduler/policy.py``): the
whole queue is submitted at once and the scheduler picks.

- ``fcfs``: requests run in arrival order (the scheduler's first-come-first-served
  fallback, forced with ``lpm_queue_limit=0``).
- ``lpm``: before each admission the scheduler matches every waiting request
  against the tree and admits the one with the longest cached prefix (ties: the
  earliest), as SGLang's scheduler does with its ``lpm`` policy. Requests that
  share a prefix then run back to back, before eviction can take that prefix
  away. (The app's scheduler falls back to FCFS above 16 waiting requests, where
  matching every request costs too much, and admits anyone who waited over 10 s
  first: LPM can delay a lone request. The demo lifts both limits to show the
  policy itself.)

The demo's engine admits one request at a time (``max_batch=1``), so each
request's prefill sees exactly what the ones before it left in the cache.

Its KV pool is outside the app's cache budget, so it is bounded and short-lived: at most
``MAX_DEMO_TOKENS`` tokens, one comparison at a time, made when a comparison starts and
closed when it ends (``pool_bytes`` says what it holds now; the Cache memory panel shows it).
"""

from __future__ import annotations

import math
import queue
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from analysis.lab.ordering_runs import LabPrompt, RunTotals, lab_request
from analysis.per_engine import per_engine
from engine.api import EngineAPI
from engine.types import EngineBusy, EngineError, GenerationRequest, SamplingParams

FCFS, LPM = "fcfs", "lpm"
MAX_DEMO_TOKENS = 20_000  # the demo's pool, outside the cache budget: ~0.9 GB for the embedded model in fp32
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
    """A small-budget engine of its own, spawned by ``parent`` on its model; one comparison at a time."""

    def __init__(self, parent: EngineAPI) -> None:
        self._parent = weakref.ref(parent)  # kept per engine by ``per_engine``: never keeps it alive
        self._engine: EngineAPI | None = None
        self._pool_bytes = 0
        self._busy = threading.Lock()

    @property
    def pool_bytes(self) -> int:
        """Bytes of KV the demo's own engine holds now (0 between comparisons)."""
        return self._pool_bytes

    def _engine_for(self, budget_tokens: int) -> EngineAPI:
        parent = self._parent()
        if parent is None:
            raise EngineError("The engine this demo ran on is gone.")
        budget = budget_tokens * parent.info().kv_bytes_per_token
        self._engine = parent.spawn(budget, max_batch=1, max_queue=64)
        self._pool_bytes = self._engine.stats().budget_bytes
        return self._engine

    def _close_engine(self) -> None:
        """Give the demo's pool back: its engine stops and nothing refers to its tensors."""
        engine, self._engine = self._engine, None
        self._pool_bytes = 0
        if engine is not None:
            engine.close()

    def compare(self, prompts: Sequence[LabPrompt], budget_tokens: int, policies: Sequence[str] = (FCFS, LPM),
                max_new_tokens: int = 1, should_stop: Callable[[], bool] | None = None) -> Iterator[ScheduleProgress]:
        """Run the queue once per policy, each from an empty cache of ``budget_tokens``.

        Raises ``EngineBusy`` if another comparison is running, ``EngineError`` for
        bad prompts or settings (before running anything)."""
        if not prompts:
            raise EngineError("Nothing to schedule: the queue is empty.")
        if budget_tokens < 1:
            raise EngineError("The cache budget must hold at least one token.")
        if budget_tokens > MAX_DEMO_TOKENS:
            raise EngineError(f"The demo's cache holds at most {MAX_DEMO_TOKENS:,} tokens.")
        if any(p not in POLICY_NAMES for p in policies):
            raise EngineError(f"Unknown policy; use one of {', '.join(POLICY_NAMES)}.")
        if not self._busy.acquire(blocking=False):
            raise EngineBusy("Another visitor is running the request-order demo right now; try again in a moment.")
        try:
            yield from self._compare(prompts, int(budget_tokens), policies, max_new_tokens, should_stop)
        finally:
            self._close_engine()
            self._busy.release()

    def _compare(self, prompts, budget_tokens, policies, max_new_tokens, should_stop) -> Iterator[ScheduleProgress]:
        engine = self._engine_for(budget_tokens)
        ids = [engine.prompt_ids(lab_request(p)) for p in prompts]
        stop = should_stop or (lambda: False)
        sampling = SamplingParams(max_new_tokens=max(1, int(max_new_tokens)))
        total, done, results = len(prompts) * len(policies), 0, []
        for policy in policies:
            engine.clear_cache()
            evicted_before = engine.stats().evicted_tokens
            engine.configure_scheduler(lpm_queue_limit=0 if policy == FCFS else len(prompts) + 1,
                                       max_wait_s=math.inf, match_refresh_s=0.0)
            finished: queue.Queue = queue.Queue()
            handles = [engine.submit(_req(ids[i], sampling)) for i in range(len(prompts))]
            for i, handle in enumerate(handles):
                threading.Thread(target=_collect, args=(i, handle, finished), daemon=True).start()
            ran: list[ScheduledRequest] = []
            ended: list[tuple[float, int, object]] = []
            while len(ran) < len(prompts) and not stop():
                try:
                    pick, m = finished.get(timeout=0.2)
                except queue.Empty:
                    continue
                if m is None:  # failed or cancelled: the demo stops
                    break
                # With one request admitted at a time, the order requests finished in (the engine's
                # clock, not the order their listeners woke: a busy machine swaps two) is the order
                # the scheduler admitted them; what it matched then is what it reused.
                ended = sorted([*ended, (m.finished_at, pick, m)], key=lambda e: e[0])
                ran = [ScheduledRequest(k, i, prompts[i].label, r.prompt_tokens, r.cached_tokens, r.computed_tokens,
                                        r.prefill_ms, r.cached_tokens) for k, (_, i, r) in enumerate(ended)]
                done += 1
                current = ScheduleResult(policy, tuple(ran), len(prompts), budget_tokens,
                                         engine.stats().evicted_tokens - evicted_before)
                yield ScheduleProgress(done, total, f"{POLICY_NAMES[policy]}: request {len(ran)} of {len(prompts)}",
                                       tuple(results) + (current,))
            for handle in handles:
                handle.cancel()
            results.append(ScheduleResult(policy, tuple(ran), len(prompts), budget_tokens,
                                          engine.stats().evicted_tokens - evicted_before))
            if len(ran) < len(prompts):
                _wait_idle(engine)
                engine.clear_cache()
                yield ScheduleProgress(done, total, "Stopped.", tuple(results), finished=True, stopped=True)
                return
            engine.check_invariants()
        engine.clear_cache()
        yield ScheduleProgress(done, total, "Done.", tuple(results), finished=True)


def _collect(index: int, handle, out: queue.Queue) -> None:
    """Drain one request's events; put (index, metrics or None) when it ends."""
    metrics = None
    try:
        for event in handle:
            if event.done:
                metrics = event.metrics
    except EngineError:
        metrics = None
    out.put((index, metrics if metrics is not None and metrics.finish_reason != "cancelled" else None))


def _wait_idle(engine: EngineAPI, timeout_s: float = 10.0) -> None:
    """Until the cancelled requests have left the engine (so clearing frees everything)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.running == 0 and s.waiting == 0:
            return
        time.sleep(0.02)


def _req(ids: Sequence[int], sampling: SamplingParams) -> GenerationRequest:
    return GenerationRequest(prompt_ids=tuple(ids), sampling=sampling, tag="scheduling-lab")


def request_order_demo_for(engine: EngineAPI) -> RequestOrderDemo:
    """The engine's one ``RequestOrderDemo`` (and so one small engine), made on first use and
    kept per engine by the analysis (``analysis.per_engine``). Where the engine cannot spawn one (remote
    mode), the comparison's first step raises the engine's own ``EngineError`` saying so."""
    return per_engine(engine, "lab.request_order_demo", lambda: RequestOrderDemo(engine))


def demo_pool_bytes(engine: EngineAPI) -> int:
    """What the request-order demo's own pool holds now, outside ``engine``'s cache budget."""
    return request_order_demo_for(engine).pool_bytes
