"""The scheduler package: policy, admission, one step = schedule -> run -> postprocess.

``scheduler`` (the step), ``policy`` (waiting order, isolation), ``admission`` (acquire
through the cache, in-batch prefix sharing), ``batch`` (packing, the forward),
``postprocess`` (sampling, events, finishing), ``baseline`` (the no-reuse timing),
``telemetry`` (step log, tokens/s, queue places), ``config``, ``state``, ``request``.
"""

from engine.scheduler.config import BASELINE_MAX_TOKENS, SchedulerConfig
from engine.scheduler.scheduler import Scheduler

__all__ = ["BASELINE_MAX_TOKENS", "Scheduler", "SchedulerConfig"]
