"""``ZeroGPURunner``: a ``ModelRunner`` whose forwards run inside GPU calls.

Owns: the one GPU function (``gpu_forward``: one forward, ``step_call.run``), decorated once per
process by ``spaces.GPU`` on a Space or by ``emulation.gpu``, with a duration worked out from
what the call carries (``duration_s``); turning a call's failure (quota, time limit, a dead
worker) into one sentence for the visitor. Everything else is the wrapped runner's: text,
geometry, the compute thread, the lock. Every forward the scheduler asks for
(``forward_paged``: prompts, decode rows, no-reuse baselines) is one call, started from the
compute thread, so the worker is a fork of the thread that owns the model.

What it does not do: the contiguous-buffer forwards (``forward``, ``forward_last``,
``baseline_prefill``) run in this process; the engine reports ``prefill_timing`` off in this
mode, so the paired timer and the warm start, their users, are not used. Each step is one
call: on a real Space a call's start (a worker, the weights to the device) is paid per step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from engine.kvcache.kv_pool import KVPool
from engine.model.paged_attention import PagedSegment
from engine.model.runner import ModelRunner
from engine.types import EngineError, EngineFault
from engine.zerogpu import step_call
from engine.zerogpu.detect import EMULATE, SPACES

log = logging.getLogger(__name__)

BASE_S = 10.0  # a call's start on a Space: the worker, the weights to the device, the runner's checks
S_PER_TOKEN = 0.002  # generous for a 1B-class model on an H200 slice
BYTES_PER_S = 2e9  # pickled KV in and out
MAX_S = 120.0

_DEVICE_RUNNER: ModelRunner | None = None  # the runner a worker computes with (inherited by fork)


def duration_s(work: step_call.StepWork) -> float:
    """Seconds to ask for a call carrying ``work`` (a shorter ask waits less in ZeroGPU's queue)."""
    return min(MAX_S, BASE_S + work.tokens * S_PER_TOKEN + 2 * work.nbytes / BYTES_PER_S)


def gpu_forward(work: step_call.StepWork) -> step_call.StepResult:
    """The body of every GPU call: one forward on the worker's device."""
    return step_call.run(_device_runner(), work)


def _device_runner() -> ModelRunner:
    """The forked main runner where it is already on a device this worker has (the emulation,
    a GPU machine); on a Space, where the main process holds the model on the CPU and a worker
    sees the GPU, a runner on ``cuda`` built once in this worker."""
    global _DEVICE_RUNNER
    runner = _DEVICE_RUNNER
    assert runner is not None, "ZeroGPURunner.install was not called"
    import torch

    if runner.device.type == "cpu" and torch.cuda.is_available():
        from dataclasses import replace

        loaded = runner.loaded_for_device(torch.device("cuda"))
        _DEVICE_RUNNER = runner = ModelRunner(replace(loaded))
    return runner


class ZeroGPURunner:
    """Wraps a built ``ModelRunner``; attribute reads fall through to it."""

    in_process_forwards = False  # Engine: no paired prefill timing in this mode

    def __init__(self, inner: ModelRunner, mode: str) -> None:
        global _DEVICE_RUNNER
        if mode not in (SPACES, EMULATE):
            raise ValueError(f"unknown ZeroGPU mode {mode!r}")
        self.inner, self.mode = inner, mode
        _DEVICE_RUNNER = inner
        if mode == SPACES:
            import spaces  # must come before CUDA is touched: the caller imports this module early

            self._call = spaces.GPU(duration=duration_s)(gpu_forward)
        else:
            from engine.zerogpu.emulation import gpu

            self._call = gpu(gpu_forward, duration=duration_s)
        self.calls = 0
        self.last_device_ms = 0.0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def forward_paged(self, pool: KVPool, segments: Sequence[PagedSegment], every_position: bool = False):
        """``ModelRunner.forward_paged``, computed in a GPU call (``step_call``)."""
        if not segments or any(not s.ids for s in segments):
            raise EngineError("nothing to compute: every segment needs at least one token")
        if every_position and len(segments) != 1:
            raise EngineError("every_position takes one segment")
        return self.inner.compute.call(self._forward_paged, pool, segments, every_position)

    def _forward_paged(self, pool: KVPool, segments: Sequence[PagedSegment], every_position: bool):
        work, written = step_call.pack(pool, segments, every_position)
        try:
            result = self._call(work)
        except EngineError:
            raise
        except Exception as exc:  # quota, time limit, a dead worker: one sentence, never a traceback
            log.warning("GPU call failed: %s", exc)
            raise EngineFault(_visitor_text(exc)) from exc
        self.calls += 1
        self.last_device_ms = result.device_ms
        return step_call.apply(pool, written, result)

    @property
    def forward_kind(self) -> str:
        where = ("a forked worker on this machine: ZeroGPU emulated (RADIX_ZEROGPU=emulate)" if self.mode == EMULATE
                 else "a ZeroGPU worker on the Space's GPU")
        return f"each forward in one GPU call, in {where}; there: {self.inner.forward_kind}"

    def forward_ms(self, wall_ms: float) -> float:
        """The last forward's time as the figures count it: its time on the device, not the call's
        start and transfers around it."""
        return self.last_device_ms


def _visitor_text(exc: Exception) -> str:
    text = str(exc).strip() or type(exc).__name__
    if "quota" in text.lower():
        return f"The free GPU quota is used up: {text[:200]}"
    return f"The GPU call did not finish: {text[:240]} Please try again."
