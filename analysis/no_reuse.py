"""The one no-reuse measurement: a prompt prefilled from scratch, and whether a prompt gets one.

Owns ``no_reuse_prefill``, the one way anything here times a prompt with no reuse (``EngineAPI``'s
primitive ``scratch_prefill`` with nothing reused: a scratch pool that neither reads nor writes the
cache, one block per compute-thread call, so other visitors' streams flow between blocks). Every
no-reuse figure calls it: a finished request's figure (``with_no_reuse``: the few-shot panel, the
lab, ``tools/replay.py``), the paired timing and the growth curve (``prefill_timing.py``'s no-reuse
side: the chat's card, ``tools/family_bench.py``) and ``tools/bench.py``. It also owns the one
decision whether a prompt is measured (``skip_reason``: not when the request was stopped, nor on a
public deployment, ``isolation``, above ``NO_REUSE_MAX_TOKENS`` prompt tokens: a long second
prefill is costly work that only shows a figure) and the one sentence a visitor gets when it is
skipped (``skipped_note``). ``NoReuseTimer`` keeps a finished request's figure: one at a time per
engine (one scratch pool at most), stopping at a caller's Stop, kept by request id for the
history's panels (``figures_of``). Knows nothing about the UI.

A request's own prefill (with reuse) is timed inside the step that ran it (packed like any other
request's, so it may include other requests' rows). Here the other side comes after it::

    the answer:   [cached ...... ) [computed ..... n)  prefill_ms, inside the engine's steps
    no reuse:     [0 ........................... n)    forward_ms of scratch_prefill, block by block

A remote engine (no ``capabilities.scratch_prefill``) answers ``measure_baseline`` its own way (the
prompt again under a fresh cache salt) and returns the figure on the metrics; it is left as it is.
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
from engine.api import EngineAPI, ScratchPrefill
from engine.types import CacheKey, EngineError, GenerationRequest, RequestMetrics

__all__ = ["NO_REUSE_MAX_TOKENS", "NoReuseTimer", "no_reuse_for", "no_reuse_prefill", "run_measured",
           "skip_reason", "skipped_note", "with_no_reuse"]

NO_REUSE_MAX_TOKENS = 2048  # prompt tokens; above this a public deployment skips the no-reuse timing
MAX_FIGURES = 1000  # figures kept by request id (the history's panels read them back)


def no_reuse_prefill(engine: EngineAPI, key: CacheKey, block_tokens: int,
                     before_block: Callable[[], None] | None = None) -> ScratchPrefill:
    """``key.ids`` prefilled from scratch (nothing reused, the cache neither read nor written),
    ``block_tokens`` per compute-thread call: the one no-reuse measurement (module docstring).
    ``before_block`` is called before each block; what it raises ends the prefill."""
    return engine.scratch_prefill(key, 0, max(1, int(block_tokens)), before_block)


def cutoff_tokens(engine) -> int | None:
    """The longest prompt whose no-reuse figure is measured on ``engine``; None: no cutoff (not a
    public deployment)."""
    if not engine.isolation:
        return None
    timer = no_reuse_for(engine)
    return timer.max_tokens_isolated if timer is not None else NO_REUSE_MAX_TOKENS


def skip_reason(engine, prompt_tokens: int, finish_reason: str | None = None) -> str | None:
    """Why a prompt of ``prompt_tokens`` gets no no-reuse figure on ``engine``, or None when it
    does: the one place that decides (the page, the tools and ``NoReuseTimer`` ask here)."""
    if finish_reason == "cancelled":
        return "the request was stopped"
    cutoff = cutoff_tokens(engine)
    if cutoff is not None and prompt_tokens > cutoff:
        return (f"the prompt is {prompt_tokens:,} tokens (over {cutoff:,}), and timing it would prefill the whole "
                "prompt a second time")
    return None


def skipped_note(engine, asked, prompt_tokens: int) -> str | None:
    """The one sentence a visitor who asked for the no-reuse figure and will not get it reads."""
    reason = skip_reason(engine, prompt_tokens) if asked else None
    return None if reason is None else f"No-reuse measurement skipped: {reason}."


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

    def measure(self, m: RequestMetrics, should_stop: Callable[[], bool] | None = None) -> float | None:
        """``m``'s prompt prefilled from scratch, in ms (kept under ``m.request_id``); None when
        skipped (``skip_reason``) or stopped (``should_stop`` is asked before each block)."""
        engine = self._engine()
        if engine is None or not m.prompt_ids or skip_reason(engine, m.prompt_tokens, m.finish_reason) is not None:
            return None

        def before_block() -> None:
            if should_stop is not None and should_stop():
                raise _Stopped

        # The scratch pool neither reads nor writes the cache: the namespace plays no part.
        key = CacheKey(tuple(m.prompt_ids), m.namespace, 0)
        with self._one_at_a_time:
            self.scratch_bytes = len(key.ids) * self.kv_bytes_per_token
            try:
                ms = no_reuse_prefill(engine, key, self.block_tokens, before_block).forward_ms
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
