"""The scheduler: which requests run, one step of work at a time.

Owns: ``Scheduler``, its state and the step. One step is three calls::

    for batch in schedule():           # policy, admission, packing: this step's forwards
        postprocess(batch, run(batch)) # run: one forward; postprocess: tokens, events, finishing

``schedule`` is lazy: each forward is planned after the one before it is post-processed,
so a forward sees what the one before it changed (a finished request's rows are free).
In order: cancelled requests leave (waiting ones silently; running ones finish as
``cancelled``, their reply so far cached, locks and budget freed); waiting requests are
admitted (``policy``, ``admission``); the prompts' chunks and the decode rows are packed
(``batch``). Finished requests come back from ``step()``: the engine records their
metrics and closes their streams. Knows the model only through ``ModelRunner`` and the
cache only through ``PrefixCache``; it never sees threads or the UI: the engine facade
calls ``step()`` under the runner's lock.
"""

from __future__ import annotations

from collections.abc import Iterator

from engine.handle import END_OF_STREAM
from engine.kvcache.prefix_cache import PrefixCache
from engine.model.runner import ModelRunner
from engine.scheduler import admission, policy
from engine.scheduler.batch import Batch, Output, forward, pack
from engine.scheduler.config import SchedulerConfig
from engine.scheduler.postprocess import Postprocess, as_engine_error
from engine.scheduler.request import Request
from engine.scheduler.state import SchedulerState
from engine.scheduler.telemetry import Telemetry, report_queue
from engine.types import StepRecord


class Scheduler:
    def __init__(self, runner: ModelRunner, cache: PrefixCache, config: SchedulerConfig) -> None:
        self.runner, self.cache = runner, cache
        self.state = SchedulerState(config)
        self.telemetry = Telemetry(config.step_log_size)
        self.post = Postprocess(self.state, runner, cache, self.telemetry)

    # ---------------------------------------------------------------- facts
    @property
    def config(self) -> SchedulerConfig:
        return self.state.config

    @config.setter
    def config(self, config: SchedulerConfig) -> None:
        self.state.config = config  # in force from the next step on

    @property
    def waiting(self) -> list[Request]:
        return self.state.waiting

    @property
    def running(self) -> list[Request]:
        return self.state.running  # prefill and decode, in admission order

    def has_work(self) -> bool:
        return bool(self.state.waiting or self.state.running)

    def step_log(self, n: int | None = None) -> list[StepRecord]:
        return self.telemetry.step_log(n)

    def tokens_per_s(self) -> float:
        """Output tokens per second over the last ``rate_window_s`` (all requests together)."""
        return self.telemetry.tokens_per_s(self.config.rate_window_s)

    def add(self, r: Request) -> None:
        self.state.waiting.append(r)

    # ----------------------------------------------------------------- step
    def step(self) -> list[Request]:
        """One step of work; returns the requests that finished in it (for the engine to record)."""
        self.telemetry.step_id += 1
        for batch in self.schedule():
            self.postprocess(batch, self.run(batch))
        self._report_queue()
        return self.take_finished()

    def schedule(self) -> Iterator[Batch]:
        """This step's forwards: cancelled requests leave, waiting ones are admitted, then the
        prefill chunks and decode rows."""
        self._drop_cancelled()
        for r, exc in admission.admit(self.state, self.cache):
            self.post.fail(r, exc)
        forwards, _left = pack(self.state.running, self.config.chunk_tokens, self.config.oldest_prefill_tokens,
                               by_owner=self.config.isolation)
        yield from forwards

    def run(self, batch: Batch) -> Output:
        return forward(self.runner, self.cache.pool, batch)

    def postprocess(self, batch: Batch, out: Output) -> None:
        self.post.apply(batch, out)

    def take_finished(self) -> list[Request]:
        """Requests finished since the last call (also after a step that raised), oldest first."""
        return self.state.take_finished()

    def fail_all(self, exc: BaseException) -> None:
        """Something outside any one request's work failed: end every request with an error."""
        for r in list(self.state.running):
            self.post.fail(r, exc)
        for r in self.state.waiting:
            r.emit(as_engine_error(exc))
            r.emit(END_OF_STREAM)
        self.state.waiting.clear()

    # ------------------------------------------------------------- in a step
    def _drop_cancelled(self) -> None:
        keep = []
        for r in self.state.waiting:
            if r.cancelled:
                r.emit(END_OF_STREAM)  # never started: no events, nothing recorded
            else:
                keep.append(r)
        self.state.waiting = keep
        for r in list(self.state.running):
            if r.cancelled:
                self.post.finish(r, "cancelled")

    def _report_queue(self) -> None:
        """Tell each waiting request how many are ahead of it, when that changes."""
        if self.state.waiting:
            report_queue(policy.ordered_waiting(self.state.waiting, self.state.running, self.cache, self.config))
