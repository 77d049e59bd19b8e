"""``ZeroGPURunner``: a ``ModelRunner`` whose forwards run inside GPU calls.

Owns: the one GPU function (``gpu_forward``: one forward, ``step_call.run``), decorated once per
process by ``spaces.GPU`` on a Space or by ``emulation.gpu``, with a duration worked out from
what the call carries (``duration_s``); turning a call's failure (quota, time limit, a dead
worker) into one sentence for the visitor. Everything else is the wrapped runner's: text,
geometry, the compute thread, the lock. Every forward the scheduler asks for
(``forward_paged``: prompts, decode rows, the analysis's scratch prefills) is one call, started from the
compute thread, so the worker is a fork of the thread that owns the model.

What it does not do: the contiguous-buffer forwards (``forward``, ``forward_last``,
``reference_prefill``) run in this process; the engine reports ``prefill_timing`` off in this
mode, so the paired timer and the warm start, their users, are not used. Each step is one
call: on a real Space a call's start (a worker, the weights to the device) is paid per step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from engine.held_signals import release_signals
from engine.kvcache.kv_pool import KVPool
from engine.model.paged_attention import PagedSegment
from engine.model.runner import ModelRunner, RowFuture
from engine.types import EngineError, EngineFault
from engine.zerogpu import step_call
from engine.zerogpu.detect import EMULATE, SPACES

log = logging.getLogger(__name__)

BASE_S = 10.0  # a call's start on a Space: the worker, the weights to the device, the runner's checks
S_PER_TOKEN = 0.002  # generous for a 1B-class model on an H200 slice
BYTES_PER_S = 2e9  # pickled KV in and out
MAX_S = 120.0

MAX_AHEAD = 31  # decode forwards a call may run after the asked one (32 tokens a call at most)
AHEAD_LOGITS_BYTES = 64 * 2**20  # the most logits of forwards run ahead held here at once

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
        _DEVICE_RUNNER = runner = ModelRunner(runner.loaded_for_device(torch.device("cuda")))
    return runner


class ZeroGPURunner:
    """Wraps a built ``ModelRunner``; attribute reads fall through to it."""

    in_process_forwards = False  # Engine: no paired prefill timing in this mode

    def __init__(self, inner: ModelRunner, mode: str, max_ahead: int = MAX_AHEAD) -> None:
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
        self.calls = 0  # GPU calls made
        self.reused_steps = 0  # forwards served from what a call ran ahead
        self.max_ahead = max_ahead
        self.last_device_ms = 0.0
        self._ahead: list[step_call.StepOut] = []  # forwards the last call ran ahead, in order
        self._ahead_pool: KVPool | None = None  # the pool they were computed over
        self._to_local: dict[int, int] = {}
        self._to_pool: dict[int, int] = {}

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def forward_paged(self, pool: KVPool, segments: Sequence[PagedSegment], every_position: bool = False,
                      ahead: Sequence[RowFuture] | None = None):
        """``ModelRunner.forward_paged``, computed in a GPU call (``step_call``); a forward the last
        call already ran ahead comes from what it brought back."""
        if not segments or any(not s.ids for s in segments):
            raise EngineError("nothing to compute: every segment needs at least one token")
        if every_position and len(segments) != 1:
            raise EngineError("every_position takes one segment")
        return self.inner.compute.call(self._forward_paged, pool, segments, every_position, ahead)

    def _forward_paged(self, pool: KVPool, segments: Sequence[PagedSegment], every_position: bool,
                       ahead: Sequence[RowFuture] | None):
        if self._ahead and not every_position and pool is self._ahead_pool:  # engines sharing a runner: own pools
            step = self._ahead.pop(0)
            if step_call.signature(step.segments) == _signature_or_none(segments, self._to_local):
                self.reused_steps += 1
                self.last_device_ms = step.device_ms
                return step_call.apply(pool, self._to_pool, step)
        self._ahead.clear()  # not the forward it guessed: what it ran ahead is dropped
        steps = self.ahead_steps(segments, ahead)
        work, to_local = step_call.pack(pool, segments, every_position, ahead, steps)
        release_signals()  # the call blocks for a while: held wake-ups (a first token, say) go out now
        try:
            result = self._call(work)
        except EngineError:
            raise
        except Exception as exc:  # quota, time limit, a dead worker: one sentence, never a traceback
            log.warning("GPU call failed: %s", exc)
            raise EngineFault(_visitor_text(exc)) from exc
        self.calls += 1
        first, *rest = result.steps
        self.last_device_ms = first.device_ms
        self._to_local, self._to_pool = to_local, {v: k for k, v in to_local.items()}
        self._ahead, self._ahead_pool = rest, pool
        return step_call.apply(pool, self._to_pool, first)

    def ahead_steps(self, segments: Sequence[PagedSegment], ahead: Sequence[RowFuture] | None) -> int:
        """How many decode forwards a call runs after the asked one: none unless every row is
        greedy (a sampled token cannot be guessed), and no more than ``AHEAD_LOGITS_BYTES`` of
        logits held here."""
        if not ahead or any(f.sampling.temperature > 0 for f in ahead):
            return 0
        per_step = len(segments) * self.inner.text.vocab_size * 4
        return max(0, min(self.max_ahead, AHEAD_LOGITS_BYTES // max(1, per_step) - 1))

    @property
    def where(self) -> str:
        if self.mode == EMULATE:
            return f"ZeroGPU calls (emulated: a forked worker on this {self.inner.device.type})"
        return "ZeroGPU (a GPU lent to each call)"

    @property
    def forward_kind(self) -> str:
        where = ("a forked worker on this machine: ZeroGPU emulated (RADIX_ZEROGPU=emulate)" if self.mode == EMULATE
                 else "a ZeroGPU worker on the Space's GPU")
        return f"each forward in one GPU call, in {where}; there: {self.inner.forward_kind}"

    def forward_ms(self, wall_ms: float) -> float:
        """The last forward's time as the figures count it: its time on the device, not the call's
        start and transfers around it."""
        return self.last_device_ms


def _signature_or_none(segments: Sequence[PagedSegment], to_local: dict[int, int]):
    try:
        return step_call.signature(segments, to_local)
    except KeyError:  # a slot the last call never saw
        return None


def _visitor_text(exc: Exception) -> str:
    text = str(exc).strip() or type(exc).__name__
    if "quota" in text.lower():
        return f"The free GPU quota is used up: {text[:200]}"
    return f"The GPU call did not finish: {text[:240]} Please try again."
