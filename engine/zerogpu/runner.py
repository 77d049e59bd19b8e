"""``ZeroGPURunner``: the model runner of ZeroGPU mode, in the main process and in each call's worker.

Main process: the ``ModelRunner`` this wraps is built first on the CPU (its geometry, its text,
its plan's checks; torch linears only), then its model is placed on ``cuda`` once, at start
(``place_on_gpu``, under the ``spaces`` package's CUDA emulation, before the app launches), as
ZeroGPU asks: ``spaces`` packs those weights at launch and each worker finds them on its GPU; no
call moves the model. From then on nothing computes in the main process: the tree, the pool of
record (host memory: ``device`` is the CPU) and the scheduler (``turns.TurnScheduler``) live here,
the arithmetic in calls.

The GPU functions, decorated once by ``spaces.GPU`` with a duration worked out from the work each
call carries (shorter asks wait less in ZeroGPU's queue):

- ``turn_call`` (a generator): one visitor turn, the one call a turn makes (``turn_call.run``),
  asking ``turn_duration_s``;
- a call for one forward that belongs to no turn (``step_call.run``), asking ``step_duration_s``.

Worker side, ``device_runner``: a ``ModelRunner`` over the weights where this worker has them (its
GPU on a Space), built once per worker; ``spaces`` reuses a worker while its GPU slot stays idle.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterator, Sequence

import torch

from engine.held_signals import release_signals
from engine.kvcache.kv_pool import KVPool
from engine.model.paged_attention import PagedSegment
from engine.model.runner import ModelRunner, RowFuture
from engine.types import EngineError
from engine.zerogpu import step_call, turn_call

log = logging.getLogger(__name__)

# What a call asks for (seconds on a Space's GPU; ``spaces`` rounds down to whole seconds, so asks are
# rounded up here). Measured figures and the reasoning: docs/GPU.md, "ZeroGPU mode".
CALL_BASE_S = 1.5  # a call's start: the schedule, a reused worker taking the work, pickling both ways
WORKER_START_S = 10.0  # a new worker's start besides: CUDA, the weights to the GPU, its runner's checks
PREFILL_S_PER_TOKEN = 0.0005  # a 1-2B model's prefill on half a Blackwell, chunks of 256 and more
DECODE_S_PER_TOKEN = 0.03  # one decode forward of a 1-2B model, launch overhead included
BYTES_PER_S = 1e9  # KV pickled into the call and back
MAX_S = 60  # spaces.GPU's default duration; a turn that would need more asks this much

_WORKER_RUNNERS: dict[int, ModelRunner] = {}  # in a worker: id(main runner) -> its runner on this worker's device


def turn_duration_s(work: turn_call.TurnWork) -> int:
    """Seconds a turn's call asks for: its prefill, its decode forwards, its KV in and out."""
    s = (CALL_BASE_S + (WORKER_START_S if work.cold else 0.0) + len(work.ids) * PREFILL_S_PER_TOKEN
         + work.new_tokens * DECODE_S_PER_TOKEN + work.kv_bytes / BYTES_PER_S)
    return min(MAX_S, math.ceil(s))


def step_duration_s(work: step_call.StepWork) -> int:
    """Seconds a forward outside any turn asks for."""
    return min(MAX_S, math.ceil(CALL_BASE_S + work.tokens * PREFILL_S_PER_TOKEN + 2 * work.nbytes / BYTES_PER_S))


def device_runner(main: ModelRunner) -> ModelRunner:
    """This worker's runner for ``main``: its model where this worker holds the weights (the GPU
    on a Space), built on the first call a worker takes and kept for the calls it takes after."""
    runner = _WORKER_RUNNERS.get(id(main))
    if runner is None:
        device = next(main.model.parameters()).device
        if device.type == "cpu":  # a CPU as the device (tests): GNU OpenMP's pool does not survive the fork
            torch.set_num_threads(1)
        runner = _WORKER_RUNNERS[id(main)] = ModelRunner(dataclasses.replace(main.loaded, device=device), main.kernels)
    return runner


def place_on_gpu(runner: ModelRunner) -> None:
    """The model on ``cuda`` in the main process, once, at start (under ``spaces``' emulation:
    ``spaces`` packs it at launch and hands it to each worker on its GPU)."""
    runner.model.to("cuda")


class ZeroGPURunner:
    """Wraps a built ``ModelRunner`` (its model already placed); attribute reads fall through to it."""

    in_process_forwards = False  # Engine: no paired prefill timing in this mode

    def __init__(self, inner: ModelRunner) -> None:
        import spaces  # the caller imported it before anything touched CUDA (app.main, the tests)

        from engine.zerogpu.turns import TurnScheduler

        self.inner = inner
        self.scheduler_class = TurnScheduler

        def gpu_turn(work: turn_call.TurnWork) -> Iterator[turn_call.Step]:
            """The body of a turn's call: its forwards, streamed out as they are done."""
            yield from turn_call.run(device_runner(inner), work)

        def gpu_step(work: step_call.StepWork) -> step_call.StepOut:
            """The body of a call for one forward outside any turn."""
            return step_call.run(device_runner(inner), work)

        self.turn_call = spaces.GPU(duration=turn_duration_s)(gpu_turn)
        self._step_call = spaces.GPU(duration=step_duration_s)(gpu_step)
        self.calls = 0  # calls made for forwards outside any turn
        self.last_device_ms = 0.0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    @property
    def device(self) -> torch.device:
        """Where the KV of record lives: the main process's host memory."""
        return torch.device("cpu")

    def synchronize(self) -> None:
        """Nothing runs on a device in this process."""

    def forward_paged(self, pool: KVPool, segments: Sequence[PagedSegment], every_position: bool = False,
                      ahead: Sequence[RowFuture] | None = None):
        """``ModelRunner.forward_paged`` for a forward outside any turn, in a GPU call of its own
        (made from the compute thread: no visitor's context, so no visitor is charged)."""
        if not segments or any(not s.ids for s in segments):
            raise EngineError("nothing to compute: every segment needs at least one token")
        if every_position and len(segments) != 1:
            raise EngineError("every_position takes one segment")
        return self.inner.compute.call(self._forward_paged, pool, segments, every_position)

    def _forward_paged(self, pool: KVPool, segments: Sequence[PagedSegment], every_position: bool):
        work, to_local = step_call.pack(pool, segments, every_position)
        release_signals()  # the call blocks for a while: held wake-ups go out now
        from engine.zerogpu.turns import as_visitor_fault

        try:
            result = self._step_call(work)
        except Exception as exc:  # quota, a dead worker: one sentence, never a traceback
            raise as_visitor_fault(exc) from exc
        self.calls += 1
        self.last_device_ms = result.device_ms
        return step_call.apply(pool, {v: k for k, v in to_local.items()}, result)

    def forward(self, *args, **kwargs):
        raise EngineError("ZeroGPU mode computes in GPU calls only (forward_paged)")

    forward_last = reference_prefill = forward

    @property
    def where(self) -> str:
        return "ZeroGPU (a GPU lent to each visitor's turn)"

    @property
    def forward_kind(self) -> str:
        return f"each visitor turn in one ZeroGPU call, on the Space's GPU; there: {self.inner.forward_kind}"

    def forward_ms(self, wall_ms: float) -> float:
        """The last forward's time on the device, not the call's start and transfers around it."""
        return self.last_device_ms
