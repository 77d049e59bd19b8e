"""ZeroGPU's process model on any machine, for tests and for trying the mode on a laptop.

What a ZeroGPU call does that matters to the engine, and what this emulation does alike: the
decorated function runs in a worker forked from the main process (so the model loaded at import
is there, as a copy); its arguments go in pickled and its result comes back pickled (nothing the
worker changes reaches the caller otherwise); a call that runs past its ``duration`` is killed
("GPU task aborted"); a worker that dies takes its call with it; a visitor's daily quota refuses
calls once spent. The device is whatever the model is on here (``cpu`` in CI).

``gpu(duration=...)`` is ``spaces.GPU``'s signature: a number of seconds, or a callable of the
call's arguments. ``CALLS`` records each call's requested duration and wall time (tests read it).
Torch-free: the worker's work is the caller's function.
"""

from __future__ import annotations

import functools
import os
import pickle
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_DURATION_S = 60.0  # spaces.GPU's default


class ZeroGPUError(RuntimeError):
    """A GPU call that did not come back with a result; the text is for the visitor."""


@dataclass(frozen=True)
class CallRecord:
    name: str
    duration_s: float  # what the call asked for
    wall_s: float  # what it took, fork to result
    ok: bool


class Quota:
    """A daily quota of GPU seconds (``RADIX_ZEROGPU_QUOTA_S``; none by default). As on ZeroGPU, a
    call is refused when the duration it asks for is more than what is left; it is charged the time
    it really took."""

    def __init__(self, seconds: float | None) -> None:
        self.left = seconds
        self._lock = threading.Lock()

    def reserve(self, duration_s: float) -> None:
        with self._lock:
            if self.left is not None and duration_s > self.left:
                raise ZeroGPUError(f"You have exceeded your GPU quota ({duration_s:.0f}s requested vs. "
                                   f"{max(0.0, self.left):.0f}s left). Try again later.")

    def charge(self, seconds: float) -> None:
        with self._lock:
            if self.left is not None:
                self.left -= seconds


CALLS: list[CallRecord] = []
QUOTA = Quota(float(os.environ["RADIX_ZEROGPU_QUOTA_S"]) if os.environ.get("RADIX_ZEROGPU_QUOTA_S") else None)


def gpu(fn: Callable | None = None, *, duration: float | Callable[..., float] = DEFAULT_DURATION_S):
    """``@gpu`` or ``@gpu(duration=...)``: ``fn`` runs in a forked worker, as on ZeroGPU."""
    if fn is None:
        return lambda f: gpu(f, duration=duration)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        seconds = float(duration(*args, **kwargs) if callable(duration) else duration)
        QUOTA.reserve(seconds)
        t0 = time.monotonic()
        ok = False
        try:
            result = _in_worker(fn, pickle.dumps((args, kwargs), protocol=pickle.HIGHEST_PROTOCOL), seconds)
            ok = True
            return result
        finally:
            wall = time.monotonic() - t0
            QUOTA.charge(wall)
            CALLS.append(CallRecord(fn.__name__, seconds, wall, ok))

    return call


def _in_worker(fn: Callable, payload: bytes, duration_s: float) -> Any:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker: unpickle, run, pickle back, leave without running the parent's exit hooks
        os.close(read_fd)
        _one_openmp_thread()
        try:
            args, kwargs = pickle.loads(payload)
            out = pickle.dumps(("ok", fn(*args, **kwargs)), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as exc:  # the caller gets the worker's error as text
            out = pickle.dumps(("error", f"{type(exc).__name__}: {exc}"))
        try:
            view = memoryview(out)
            while view:
                view = view[os.write(write_fd, view):]
        finally:
            os._exit(0)
    os.close(write_fd)
    chunks: list[bytes] = []
    deadline = time.monotonic() + duration_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                raise ZeroGPUError(f"GPU task aborted: the call ran past its {duration_s:.0f} s duration.")
            ready, _, _ = select.select([read_fd], [], [], min(left, 1.0))
            if ready:
                data = os.read(read_fd, 1 << 20)
                if not data:
                    break
                chunks.append(data)
    finally:
        os.close(read_fd)
        _, status = os.waitpid(pid, 0)
    if not chunks:
        raise ZeroGPUError(f"The GPU worker died before it answered ({_exit_text(status)}).")
    try:
        kind, value = pickle.loads(b"".join(chunks))
    except Exception:  # cut off mid-answer
        raise ZeroGPUError(f"The GPU worker died while it answered ({_exit_text(status)}).") from None
    if kind == "error":
        raise ZeroGPUError(f"The GPU call failed: {value}")
    return value


def _one_openmp_thread() -> None:
    """GNU OpenMP's thread pool does not survive a fork: the worker's first parallel region would
    wait for the parent's pool threads, which the fork did not copy. One thread never asks for
    them. (A real ZeroGPU worker computes on the GPU; here the device is this CPU.)"""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def _exit_text(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit status {os.WEXITSTATUS(status)}"
