"""A finished request's no-reuse figure: its prompt prefilled again from scratch, after the answer.

Owns the side-by-side figure the page shows next to a request's own prefill (``RequestMetrics``'s
``baseline_prefill_ms``): when it is measured (asked for with ``measure_baseline``, the answer not
cancelled, and on a public deployment, ``isolation``, not above ``NO_REUSE_MAX_TOKENS`` prompt
tokens: a long second prefill is costly work that only shows a figure), how (``EngineAPI``'s one
primitive, ``scratch_prefill`` with no reuse: a scratch pool that neither reads nor writes the
cache, one block per compute-thread call, so other visitors' streams flow between blocks), one at
a time per engine (one scratch pool at most), stopping at a caller's Stop, and the figures kept by
request id for the history's panels (``figures_of``). Knows nothing about the UI.

A request's own prefill (with reuse) is timed inside the step that ran it; a request with
``measure_baseline`` prefills in forwards of its own, so that figure is its work only. Here the
other side comes after it::

    the answer:   [cached ...... ) [computed ..... n)  prefill_ms, inside the engine's steps
    no reuse:     [0 ........................... n)    forward_ms of scratch_prefill, block by block

A remote engine (no ``capabilities.scratch_prefill``) measures its own way (the prompt again under
a fresh cache salt) and returns the figure on the metrics; it is left as it is.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from contextlib import suppress

from analysis.per_engine import per_engine
from analysis.prefill_records import default_policy
from engine.api import EngineAPI
from engine.types import CacheKey, EngineError, GenerationRequest, RequestMetrics

__all__ = ["NO_REUSE_MAX_TOKENS", "NoReuseTimer", "no_reuse_for", "run_measured", "with_no_reuse"]

NO_REUSE_MAX_TOKENS = 2048  # prompt tokens; above this a public deployment skips the no-reuse timing
MAX_FIGURES = 1000  # figures kept by request id (the history's panels read them back)


class _Stopped(Exception):
    """The caller stopped the measurement between two blocks."""


class NoReuseTimer:
    """No-reuse figures of finished requests on one engine (``no_reuse_for(engine)``), held weakly."""

    def __init__(self, engine: EngineAPI) -> None:
        self._engine = weakref.ref(engine)
        self.isolation = bool(engine.isolation)
        self.max_tokens_isolated = NO_REUSE_MAX_TOKENS  # the cutoff in force here (tests lower it)
        info = engine.info()
        self.block_tokens = default_policy(info.device.split(":")[0], self.isolation).block_tokens
        self.kv_bytes_per_token = info.kv_bytes_per_token
        self.max_context = info.max_context
        self._one_at_a_time = threading.Lock()  # one scratch pool per engine at most
        self._lock = threading.Lock()
        self._figures: OrderedDict[int, float] = OrderedDict()  # request id -> no-reuse ms
        self.scratch_bytes = 0  # the scratch pool alive now (outside the cache budget)

    @property
    def scratch_bound_bytes(self) -> int:
        """The most one scratch pool holds: the longest prompt it may time (one at a time)."""
        tokens = min(self.max_tokens_isolated, self.max_context) if self.isolation else self.max_context
        return tokens * self.kv_bytes_per_token

    def skip_reason(self, m: RequestMetrics) -> str | None:
        """Why ``m``'s no-reuse figure is not measured, or None when it is."""
        if m.finish_reason == "cancelled":
            return "the request was stopped"
        if self.isolation and m.prompt_tokens > self.max_tokens_isolated:
            return (f"the prompt is {m.prompt_tokens:,} tokens (over {self.max_tokens_isolated:,}): timing it would "
                    "prefill the whole prompt a second time")
        return None

    def measure(self, m: RequestMetrics, should_stop: Callable[[], bool] | None = None) -> float | None:
        """``m``'s prompt prefilled from scratch, in ms (kept under ``m.request_id``); None when
        skipped (``skip_reason``) or stopped (``should_stop`` is asked before each block)."""
        engine = self._engine()
        if engine is None or not m.prompt_ids or self.skip_reason(m) is not None:
            return None

        def before_block() -> None:
            if should_stop is not None and should_stop():
                raise _Stopped

        # The scratch pool neither reads nor writes the cache: the namespace plays no part.
        key = CacheKey(tuple(m.prompt_ids), m.namespace, 0)
        with self._one_at_a_time:
            self.scratch_bytes = len(key.ids) * self.kv_bytes_per_token
            try:
                ms = engine.scratch_prefill(key, 0, self.block_tokens, before_block).forward_ms
            except _Stopped:
                return None
            finally:
                self.scratch_bytes = 0
        with self._lock:
            self._figures[m.request_id] = ms
            while len(self._figures) > MAX_FIGURES:
                self._figures.popitem(last=False)
        return ms

    def figures_of(self, request_ids: Iterable[int]) -> dict[int, float]:
        """The no-reuse figures ``measure`` kept, for those of ``request_ids`` that have one."""
        with self._lock:
            return {rid: self._figures[rid] for rid in request_ids if rid in self._figures}


def no_reuse_for(engine: EngineAPI) -> NoReuseTimer | None:
    """The engine's one ``NoReuseTimer`` (made on first use); None without
    ``capabilities.scratch_prefill`` (remote: its figure comes on the metrics)."""
    if not engine.capabilities.scratch_prefill:
        return None
    return per_engine(engine, "no_reuse", lambda: NoReuseTimer(engine))


def with_no_reuse(engine: EngineAPI, m: RequestMetrics,
                  should_stop: Callable[[], bool] | None = None) -> RequestMetrics:
    """``m`` with its no-reuse figure (``baseline_prefill_ms``) measured now, for a request that
    asked (``measure_baseline``); ``m`` as it is where it has one already (remote), is skipped,
    stopped, or the engine cannot run it."""
    if m.baseline_prefill_ms is not None:
        return m
    timer = no_reuse_for(engine)
    if timer is None:
        return m
    ms = None
    with suppress(EngineError):  # a figure, never the answer's failure
        ms = timer.measure(m, should_stop)
    return m if ms is None else dataclasses.replace(m, baseline_prefill_ms=ms)


def run_measured(engine: EngineAPI, request: GenerationRequest) -> RequestMetrics:
    """``engine.run(request)``, then its no-reuse figure where the request asks for one."""
    m = engine.run(request)
    return with_no_reuse(engine, m) if request.measure_baseline else m
