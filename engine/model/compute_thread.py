"""Which thread runs torch: one long-lived compute thread per model runner.

Owns: the thread every forward, sampling step and pool copy of a model runner
runs on (``ComputeThread.call``), and ``in_fresh_thread`` for one-off work
(loading a model) whose threads should not outlive it.

Why it matters on a CPU: PyTorch's CPU wheels parallelise with GNU OpenMP
(libgomp). Each thread that has run a parallel region keeps its own pool of
OpenMP threads until it exits. Once the pooled threads outnumber the cores
(the main thread loaded the model, the engine's worker runs the forwards: two
pools), libgomp stops spinning between parallel regions (its "throttled" spin
count) and each of the thousands of small regions in one forward pays a futex
wake-up. Measured on the 2-core machine with the embedded model, one batched
decode step over 8 requests: 91 ms from the only pool, 135-155 ms from a
second thread after the main thread had run the model. So the model is loaded
on a thread that then exits, and every engine's steps run on the runner's one
compute thread: one OpenMP pool in the process, whatever thread asks.

Held signals: a stream's consumer (an HTTP response on the event loop, a page's thread) is
woken when the compute thread queues its next token. Woken at once, it runs its Python for
that token (a JSON chunk, a socket write) while the compute thread runs the Python of the next
step (scheduling, the forward's set-up), and the two take turns on the one GIL, which lengthens
the gap between one stream's decode steps. So the compute thread holds those wake-ups (``engine.held_signals``) until its next
long native computation starts (``release_signals``: the stack's kernels, where it lets go of
the GIL for milliseconds) or its call ends, whichever comes first: the consumer's Python then
runs beside the kernels instead of between them (docs/CHANGELOG.md has the measurement). A token reaches its consumer at most that Python later (well under a millisecond),
or one tier load later where a step loads KV from the second tier before its forward.
"""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from engine.held_signals import holding, release_signals
from engine.types import EngineFault

T = TypeVar("T")

_STOP = object()


def _call_into(box: dict, fn: Callable, args: tuple, kwargs: dict) -> None:
    """Run ``fn`` on this thread; its value or exception goes into ``box`` for the caller's."""
    try:
        box["value"] = fn(*args, **kwargs)
    except BaseException as exc:  # re-raised in the caller, with its traceback
        box["error"] = exc


def _unbox(box: dict) -> Any:
    if "error" in box:
        raise box["error"]
    return box["value"]


def in_fresh_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``fn`` on a new thread and wait: its OpenMP pool ends with it. Exceptions re-raise here."""
    box: dict[str, Any] = {}
    t = threading.Thread(target=_call_into, args=(box, fn, args, kwargs), name="model-load", daemon=True)
    t.start()
    t.join()
    return _unbox(box)


class TurnLock:
    """A lock that knows whether another thread waits for it: a loop that takes it step after step
    (an engine's worker) pauses between its steps only when someone does (another engine sharing
    the runner), instead of after every step. Use as a ``threading.Lock`` (``with``, ``acquire``,
    ``release``, ``locked``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = threading.Lock()  # guards ``_waiting``
        self._waiting = 0

    @property
    def waiting(self) -> bool:
        """Some other thread is blocked in ``acquire`` right now."""
        return self._waiting > 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(False):
            return True
        if not blocking:
            return False
        with self._count:
            self._waiting += 1
        try:
            return self._lock.acquire(True, timeout)
        finally:
            with self._count:
                self._waiting -= 1

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class ComputeThread:
    """A daemon thread that runs submitted calls one at a time, in submission order."""

    def __init__(self, name: str = "model-compute") -> None:
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        self._stop_lock = threading.Lock()  # a call is queued before the stop marker, or refused
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        # At exit, let the call in progress finish before the interpreter tears down: a process that
        # ends while this thread is inside a torch op aborts ("terminate called without an active
        # exception"), e.g. a script that returns right after its last answer.
        atexit.register(self.stop, join_timeout_s=30.0)

    @property
    def stopped(self) -> bool:
        """``stop()`` was called: the process is shutting down and no more calls will run."""
        return self._stopped

    @property
    def busy_elsewhere(self) -> bool:
        """Another call is queued for the thread (a long call running on it should return soon)."""
        return not self._inbox.empty()

    @property
    def is_current(self) -> bool:
        return threading.current_thread() is self._thread

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the compute thread; returns its result or raises its exception.
        Called from the compute thread itself it runs directly (no deadlock on nested calls).
        After ``stop()`` it raises ``EngineFault`` at once (nothing would ever run it)."""
        if self.is_current:
            return fn(*args, **kwargs)
        done = threading.Event()
        box: dict[str, Any] = {}
        with self._stop_lock:
            if self._stopped:
                raise EngineFault(f"The compute thread '{self._thread.name}' has stopped (the process is shutting "
                                  "down): no more model work can run.")
            self._inbox.put((fn, args, kwargs, box, done))
        done.wait()
        return _unbox(box)

    def _serve(self) -> None:
        holding()  # this thread holds its consumers' wake-ups (module docstring)
        while True:
            item = self._inbox.get()
            if item is _STOP:
                return
            fn, args, kwargs, box, done = item
            _call_into(box, fn, args, kwargs)
            release_signals()  # what the call held back goes out before its caller hears of it
            # Keep nothing of the call while idle: its closure may hold a scratch KV buffer or a
            # whole engine's pool, which must go as soon as its caller lets go of it.
            del item, fn, args, kwargs, box
            done.set()

    def stop(self, join_timeout_s: float | None = None) -> None:
        """End the thread after the calls already queued; wait up to ``join_timeout_s`` for it.
        Later calls raise. Stopping twice is harmless."""
        with self._stop_lock:
            if not self._stopped:
                self._stopped = True
                self._inbox.put(_STOP)
        if join_timeout_s is not None and not self.is_current:
            self._thread.join(join_timeout_s)
