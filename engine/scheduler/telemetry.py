"""What the scheduler shows of its work: the step log, tokens per second, queue places.

Owns: the bounded log of forwards (one ``StepRecord`` each, for the scheduler view), the
output-token rate over ``rate_window_s``, and the "queued" events that tell each waiting
request how many are ahead of it when that changes. Thread-safe for readers (the UI reads
while the worker steps). Knows nothing about how work is chosen or run.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from engine.scheduler.request import Request
from engine.types import GenerationEvent, StepRecord


class Telemetry:
    def __init__(self, step_log_size: int) -> None:
        self._steps: deque[StepRecord] = deque(maxlen=step_log_size)
        self._rate: deque[tuple[float, int]] = deque()  # (time, output tokens) per sampled token
        self._lock = threading.Lock()
        self.step_id = 0

    def step_log(self, n: int | None = None) -> list[StepRecord]:
        with self._lock:
            items = list(self._steps)
        return items[-n:] if n else items

    def tokens_per_s(self, window_s: float) -> float:
        """Output tokens per second over the last ``window_s`` (all requests together)."""
        now = time.perf_counter()
        with self._lock:
            recent = [(t, n) for t, n in self._rate if now - t <= window_s]
        if not recent:
            return 0.0
        span = max(now - recent[0][0], 1e-3)
        return sum(n for _, n in recent) / span if span >= 0.5 else 0.0

    def log(self, kind: str, rows: list[Request], computed: int, cached: int, duration_ms: float,
            prefilling: tuple[int, ...], running: int, waiting: int) -> None:
        rec = StepRecord(step_id=self.step_id, kind=kind, request_ids=tuple(r.request_id for r in rows),
                         prefill_request_ids=prefilling,
                         namespaces=tuple(r.namespace for r in rows), batch_size=len(rows),
                         computed_tokens=computed, cached_tokens=cached, duration_ms=duration_ms,
                         finished_at=time.time(), running=running, waiting=waiting)
        with self._lock:
            self._steps.append(rec)

    def count_output(self, n: int, window_s: float) -> None:
        now = time.perf_counter()
        with self._lock:
            self._rate.append((now, n))
            while self._rate and now - self._rate[0][0] > window_s:
                self._rate.popleft()


def report_queue(ordered: list[Request]) -> None:
    """Tell each waiting request (in admission order) how many are ahead of it, when that changes."""
    for i, r in enumerate(ordered):
        if r.memo.place(i):
            r.emit(GenerationEvent(text="", phase="queued", queue_ahead=i, prompt_tokens=len(r.ids)))
