"""The scheduler package: policy, admission, one step = schedule -> run -> postprocess.

``scheduler`` (the step), ``policy`` (waiting order, isolation), ``admission`` (acquire
through the cache, in-batch prefix sharing), ``batch`` (packing, the forward),
``postprocess`` (sampling, events, finishing),
``telemetry`` (step log, tokens/s, queue places), ``config``, ``state``, ``request``.

Import the modules themselves (``engine.scheduler.scheduler.Scheduler``,
``engine.scheduler.config.SchedulerConfig``): the package imports nothing, so reading its
plain config loads no torch. The no-reuse timing is not here: ``analysis/no_reuse.py`` times it
after the answer, through ``EngineAPI.scratch_prefill``.
"""
