"""Live refresh for panels that follow the shared engine (tree, numbers, charts).

Owns: the ``LiveView`` a panel hands back (its timer and refresh function, so
``components.demo`` can also fire it on page load and tab select, and pause
the timers of hidden tabs), a cheap signature of the engine's state (so a tick
that would redraw the same picture sends nothing), and a short-lived snapshot
shared by every visitor who sees the same thing.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import gradio as gr

from engine.engine import Engine
from engine.types import TreeSnapshot

log = logging.getLogger(__name__)

FORCE_REDRAW_S = 15.0  # redraw at least this often, so "last used 3 s ago" does not go stale


@dataclass
class LiveView:
    """A panel's refresh: ``fn(*inputs) -> outputs``, run on every ``timer`` tick."""

    timer: gr.Timer
    fn: Callable
    inputs: Sequence = ()
    outputs: Sequence = ()

    def refresh_on(self, *triggers) -> None:
        gr.on(list(triggers), _quiet(self.fn, len(self.outputs)), list(self.inputs), list(self.outputs),
              show_progress="hidden", api_visibility="private", queue=True, trigger_mode="always_last")


def _quiet(fn: Callable, num_outputs: int) -> Callable:
    """A refresh that fails keeps the last picture and logs one line: a timer must never
    show a visitor an error, let alone a traceback."""

    @functools.wraps(fn)  # Gradio reads the wrapped signature (it injects gr.Request)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # anything: once per tick, to the log only
            log.warning("panel refresh failed: %s: %s", type(exc).__name__, exc)
            skips = tuple(gr.skip() for _ in range(num_outputs))
            return skips[0] if num_outputs == 1 else skips

    return wrapper


def engine_signature(engine: Engine) -> tuple:
    """Changes whenever anything a panel shows could have changed (bar the clock)."""
    s = engine.stats()
    locked = engine.cache.locked_tokens() if hasattr(engine.cache, "locked_tokens") else 0
    return (s.requests, s.cached_tokens_now, s.num_nodes, s.evicted_tokens, s.cache_bytes, s.budget_bytes, locked)


def unchanged(seen: tuple | None, signature: tuple) -> bool:
    """True when ``seen`` (signature, time drawn) says the picture is current."""
    return bool(seen) and seen[0] == signature and time.monotonic() - seen[1] < FORCE_REDRAW_S


def drawn(signature: tuple) -> tuple:
    return (signature, time.monotonic())


_snapshots: dict[tuple[int, str | None], tuple[tuple, float, TreeSnapshot]] = {}
_snapshots_lock = threading.Lock()


def shared_snapshot(engine: Engine, viewer: str | None, max_age_s: float = 1.0) -> TreeSnapshot:
    """``engine.snapshot(viewer)``, reused for ``max_age_s`` while the engine's
    signature holds: many visitors polling the same tree cost one snapshot."""
    key = (id(engine), viewer if engine.isolation else None)
    sig = engine_signature(engine)
    with _snapshots_lock:
        hit = _snapshots.get(key)
    if hit and hit[0] == sig and time.monotonic() - hit[1] < max_age_s:
        return hit[2]
    snap = engine.snapshot(viewer=viewer)
    with _snapshots_lock:
        if len(_snapshots) > 256:
            _snapshots.clear()
        _snapshots[key] = (sig, time.monotonic(), snap)
    return snap
