"""What the scheduler holds between steps, shared by its parts.

Owns: the config in force, the waiting list, the running set (prefill and decode, in
admission order), the outbox of finished requests that the engine drains
(``take_finished``) to record their metrics and close their streams, and whether
admission last ran out of memory. Knows nothing about how any of them is decided.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.scheduler.config import SchedulerConfig
from engine.scheduler.request import Request, State


@dataclass
class SchedulerState:
    config: SchedulerConfig
    waiting: list[Request] = field(default_factory=list)
    running: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # done with their metrics to come, oldest first
    memory_short: bool = False  # admission found no room; retried once slots are given back

    def rows_used(self) -> int:
        """Requests in prefill or decode."""
        return sum(1 for r in self.running if r.state in (State.PREFILL, State.DECODE))

    def take_finished(self) -> list[Request]:
        done, self.finished = self.finished, []
        return done
