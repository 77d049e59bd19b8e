"""Prefill timed fairly: with and without reuse, back to back, on the compute thread.

Owns: paired timings of one prompt (``PrefillTimer.time_pairs``), the bound on what a timing may cost, the
memo of no-reuse figures for long shipped prefixes (one per namespace: an entry is read only by
the namespace that made it), the warm start of shipped prefixes (``warm``), the growth
curve (prefill time against cached length, ``growth_curve``) and ``timer_for``, one timer per engine kept
here (``analysis.per_engine``), never by the engine. Knows nothing about the UI, presets or visitors.

It reaches the engine through ``EngineAPI`` only: ``PrefillAPI.scratch_prefill`` for both sides (the
no-reuse side through ``no_reuse.no_reuse_prefill``, the one no-reuse measurement),
``cache_prefill`` for the warm start and the curve's filler, ``matched_len``, ``info`` and ``stats``; an
engine without ``capabilities.prefill_timing`` (remote, ZeroGPU) has no timer. Its policy and records live
in ``prefill_records.py``, re-exported here; a finished request's own no-reuse figure is ``no_reuse.py``'s.

A request's live figure is taken inside a batched step, its no-reuse figure later. Here both sides run
under the same conditions, one right after the other, on the engine's scratch pools::

    reuse:     scratch pool <- the cached prefix, copied   forward ids[cached:n]
    no reuse:  scratch pool                                forward ids[0:n]

Both sides run ``block_tokens`` at a time, each block its own compute-thread call, so other visitors'
steps run between blocks; only the forwards are timed. Pairs alternate which side goes first, no-reuse
first (whatever still runs lands on the long side). The reuse side's figure is the median of
``reuse_runs`` runs in a row, the pair shown the median pair by ratio. Nothing here changes the cache:
the copy reads it (no hit, no access time, no lock), and the scratch pools are dropped.

The growth curve is background work, so it yields: each call (``BACKGROUND_BLOCK_TOKENS`` at most) waits
for ``QUIET_S`` with no request (``engine.busy()``) and no visitor's timing under way.
"""

from __future__ import annotations

import hashlib
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from analysis.no_reuse import no_reuse_prefill
from analysis.per_engine import per_engine
from analysis.prefill_records import (
    GrowthCurve,
    GrowthPoint,
    LogitsCheck,
    PrefillPair,
    PrefillTiming,
    TimingPolicy,
    WarmPrefix,
    _median,
    _median_pair,
    default_policy,
)
from engine.api import EngineAPI
from engine.types import CacheKey, EngineError, EngineFault

__all__ = ["GrowthCurve", "GrowthPoint", "LogitsCheck", "PrefillPair", "PrefillTimer", "PrefillTiming", "TimingPolicy",
           "WarmPrefix", "default_policy", "timer_for"]

GROWTH_NAMESPACE = "growth-curve"  # the curve's filler lives here while it is measured, then is cleared
GROWTH_LENGTHS = (256, 512, 1024, 2048, 4096)
GROWTH_SUFFIX_TOKENS = 32  # the "question" after the cached part, as in a chat turn
BACKGROUND_BLOCK_TOKENS = 256  # the longest compute call of background work (the growth curve)
QUIET_S = 0.1  # background work starts a call only after visitors left the engine idle this long


LastLogits = Any  # a float32 ``torch.Tensor`` [vocab]: torch is not imported here (remote mode loads none)


def compare_logits(reuse, full) -> LogitsCheck:
    """The two sides' last-token logits (float32 CPU tensors, as ``scratch_prefill`` returns them),
    compared bit for bit and by digest. In NumPy, single-threaded: torch's ops over a vocabulary's row
    run in parallel, and a thread other than the engine's compute thread that runs one starts an OpenMP
    pool of its own on the same cores."""
    import numpy as np

    a = np.ascontiguousarray(reuse.detach().float().cpu().numpy())
    b = np.ascontiguousarray(full.detach().float().cpu().numpy())

    def digest(t) -> str:
        return hashlib.sha256(t.tobytes()).hexdigest()[:16]

    return LogitsCheck(identical=bool(np.array_equal(a, b)), max_abs_diff=float(np.abs(a - b).max()),
                       same_next_token=int(a.argmax()) == int(b.argmax()), reuse_digest=digest(a),
                       full_digest=digest(b))


class PrefillTimer:
    """Fair prefill timings on one engine (``timer_for(engine)``), held weakly. Uses its ``PrefillAPI``,
    ``info``, ``stats``, ``busy`` (where it has one) and ``clear_cache``. Timings run one at a time (a
    second waits up to ``policy.wait_s``)."""

    def __init__(self, engine: EngineAPI, policy: TimingPolicy | None = None) -> None:
        self._engine = weakref.ref(engine)  # kept per engine by ``per_engine``: never keeps it alive
        info = engine.info()
        self.max_context, self.kv_bytes_per_token = info.max_context, info.kv_bytes_per_token
        self.isolation = bool(getattr(engine, "isolation", False))
        self.policy = policy or default_policy(info.device.split(":")[0], self.isolation)
        self._busy = threading.Lock()  # one visitor's timing at a time: their buffers and their fairness
        self._curve_lock = threading.Lock()  # one growth curve at a time
        self._foreground = 0  # visitors' timings under way or waiting: background work waits for them
        self._foreground_lock = threading.Lock()
        self._scratch_bytes = 0  # scratch KV buffers alive now (outside the cache budget)
        self.peak_scratch_bytes = 0
        self._memo: OrderedDict[tuple, tuple[float, float, int]] = OrderedDict()  # -> (full ms, when, runs)
        self._memo_lock = threading.Lock()
        self._curve = GrowthCurve()
        self.warmed: tuple[WarmPrefix, ...] = ()
        self._by_request: OrderedDict[int, PrefillTiming] = OrderedDict()  # request id -> its paired timing

    @property
    def engine(self):
        engine = self._engine()
        if engine is None:
            raise EngineFault("the engine this timer measured is gone")
        return engine

    # ------------------------------------------------------- yielding
    def stopping(self) -> bool:
        """The engine is closed or gone, or the app is shutting down (``healthy()`` False): background
        work ends quietly."""
        engine = self._engine()
        return engine is None or not engine.healthy()

    def _visitors_busy(self) -> bool:
        busy = getattr(self.engine, "busy", None)
        return self._foreground > 0 or bool(busy is not None and busy())

    def _wait_for_quiet(self) -> None:
        """Background work: return once visitors have left the engine idle for ``QUIET_S``; an
        ``EngineFault`` if the process shuts down meanwhile."""
        quiet_since = None
        while True:
            if self.stopping():
                raise EngineFault("the app is shutting down")
            now = time.monotonic()
            if self._visitors_busy():
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            elif now - quiet_since >= QUIET_S:
                return
            time.sleep(0.02)

    def _foreground_add(self, n: int) -> None:
        with self._foreground_lock:
            self._foreground += n

    # ------------------------------------------------------- scratch KV
    @property
    def scratch_bytes(self) -> int:
        """Bytes of scratch KV the timings hold now: buffers outside the cache budget."""
        return self._scratch_bytes

    @property
    def scratch_bound_bytes(self) -> int:
        """The most scratch KV there can be at once: one buffer of the longest prompt for a visitor's
        timing (one at a time) and one for the growth curve (the only background work)."""
        cap = getattr(self.engine, "max_prompt_tokens", None) or self.max_context
        curve = min(self.max_context, max(GROWTH_LENGTHS) + GROWTH_SUFFIX_TOKENS)
        return (int(cap) + curve) * self.kv_bytes_per_token

    @contextmanager
    def _scratch(self, n: int) -> Iterator[None]:
        """Counts the engine's scratch KV for ``n`` tokens while a call that holds it runs."""
        nbytes = int(n) * self.kv_bytes_per_token
        with self._foreground_lock:
            self._scratch_bytes += nbytes
            self.peak_scratch_bytes = max(self.peak_scratch_bytes, self._scratch_bytes)
        try:
            yield
        finally:
            with self._foreground_lock:
                self._scratch_bytes -= nbytes

    # ---------------------------------------------------------- one prompt
    def _timed_prefill(self, key: CacheKey, cached: int, background: bool = False) -> tuple[float, int, LastLogits]:
        """Prefill ``key.ids`` on the engine's scratch pool, reusing up to ``cached`` cached tokens
        (0: none), ``block_tokens`` per compute-thread call (``EngineAPI.scratch_prefill``). Returns
        (ms of the forwards, reused, the last token's float32 logits: what the first new token is
        picked from). ``background``: blocks of at most ``BACKGROUND_BLOCK_TOKENS``, each started
        only when visitors leave the engine idle."""
        block = max(1, self.policy.block_tokens)
        if background:
            block = min(block, BACKGROUND_BLOCK_TOKENS)
        wait = self._wait_for_quiet if background else None
        with self._scratch(len(key.ids)):
            if cached == 0:  # the no-reuse side: the one no-reuse measurement
                done = no_reuse_prefill(self.engine, key, block, wait)
            else:
                done = self.engine.scratch_prefill(key, cached, block, wait)
        return done.forward_ms, done.reused_tokens, done.last_logits

    def _memo_key(self, key: CacheKey) -> tuple | None:
        """Whose memo entry a prompt may read: the shipped prefix's, the prompt's length, and the
        namespace it is asked in. A prompt's length past the shipped prefix is the asker's own, so an
        entry made for one namespace (a visitor's tab, an API salt) is never shown to another: else
        a stranger sending one length per request would read another visitor's prompt length and
        time back (issue 58)."""
        floor = self.policy.memo_min_tokens
        if floor is None or key.public_len < floor:
            return None
        digest = hashlib.sha256(repr(key.ids[: key.public_len]).encode()).hexdigest()[:16]
        return (key.namespace, digest, key.public_len, len(key.ids))

    def _memo_get(self, mk: tuple | None) -> tuple[float, float, int] | None:
        if mk is None:
            return None
        with self._memo_lock:
            hit = self._memo.get(mk)
            if hit is not None:
                self._memo.move_to_end(mk)
            return hit

    def _memo_put(self, mk: tuple | None, value: tuple[float, float, int]) -> None:
        if mk is None:
            return
        with self._memo_lock:
            self._memo[mk] = value
            while len(self._memo) > self.policy.memo_size:
                self._memo.popitem(last=False)

    MAX_REQUEST_TIMINGS = 1000  # paired timings kept by request id (the history panels read them back)

    def time_request(self, request_id: int, key: CacheKey, cached_tokens: int) -> PrefillTiming:
        """``time_pairs`` for a finished request, kept under its id (when both sides were measured)
        so the history's panels can show the paired figures the request's card shows."""
        timing = self.time_pairs(key, cached_tokens)
        if timing.reuse_ms is not None and timing.full_ms is not None:
            with self._memo_lock:
                self._by_request[request_id] = timing
                while len(self._by_request) > self.MAX_REQUEST_TIMINGS:
                    self._by_request.popitem(last=False)
        return timing

    def timings_of(self, request_ids: Iterable[int]) -> dict[int, PrefillTiming]:
        """The paired timings ``time_request`` kept for those of ``request_ids`` that have one."""
        with self._memo_lock:
            return {rid: self._by_request[rid] for rid in request_ids if rid in self._by_request}

    def time_pairs(self, key: CacheKey, cached_tokens: int, pairs: int | None = None) -> PrefillTiming:
        """Time ``key.ids`` with reuse of its first ``cached_tokens`` cached tokens (what the
        request itself reused; fewer if some were evicted since) and without, back to back,
        ``pairs`` times (default ``policy.pairs``) within the policy's token bound."""
        n = len(key.ids)
        if n == 0:
            raise EngineError("nothing to time: the prompt is empty")
        cached = max(0, min(int(cached_tokens), n - 1, self.engine.matched_len(key)))
        base = PrefillTiming(prompt_tokens=n, cached_tokens=cached, block_tokens=self.policy.block_tokens)
        if cached == 0:
            return replace(base, skipped="nothing of this prompt is cached now, so both sides would compute "
                                         "every token")
        wanted = max(1, pairs or self.policy.pairs)
        mk = self._memo_key(key)
        memo = self._memo_get(mk)
        reps = max(1, self.policy.reuse_runs)
        per_pair = reps * (n - cached) + (0 if memo else n)
        runs = min(wanted, self.policy.max_tokens // per_pair)
        if runs < 1:
            return replace(base, skipped=f"one pair would run {per_pair:,} tokens through the model, over the "
                                         f"{self.policy.max_tokens:,} a timing may cost here")
        self._foreground_add(1)  # the growth curve pauses from now on
        try:
            return self._time_pairs(key, base, cached, runs, reps, memo, mk)
        finally:
            self._foreground_add(-1)

    def _time_pairs(self, key: CacheKey, base: PrefillTiming, cached: int, runs: int, reps: int,
                    memo: tuple[float, float, int] | None, mk: tuple | None) -> PrefillTiming:
        if not self._busy.acquire(timeout=self.policy.wait_s):
            return replace(base, skipped="other timings were running; try again in a moment")
        copied = cached
        logits: dict[str, LastLogits] = {}  # each side's last run: what its first new token is picked from

        def reuse_side() -> float:
            nonlocal copied
            times = []
            for _ in range(reps):
                ms, copied, logits["reuse"] = self._timed_prefill(key, cached)
                times.append(ms)
            return _median(times)

        def full_side() -> float:
            ms, _, logits["full"] = self._timed_prefill(key, 0)
            return ms

        try:
            done: list[PrefillPair] = []
            for i in range(runs):
                if memo:
                    reuse_ms, full_ms = reuse_side(), memo[0]
                elif i % 2 == 0:  # alternate which side goes first: drift lands on both
                    full_ms = full_side()
                    reuse_ms = reuse_side()
                else:
                    reuse_ms = reuse_side()
                    full_ms = full_side()
                done.append(PrefillPair(reuse_ms, full_ms))
        finally:
            self._busy.release()
        best = _median_pair(done)
        if memo:
            full_ms, measured_at, full_runs = memo
            return replace(base, cached_tokens=copied, pairs=tuple(done), reuse_ms=_median([p.reuse_ms for p in done]),
                           full_ms=full_ms, full_measured_at=measured_at, full_from_memo=True, full_runs=full_runs,
                           reuse_runs=reps)
        now = time.time()
        self._memo_put(mk, (_median([p.full_ms for p in done]), now, len(done)))
        return replace(base, cached_tokens=copied, pairs=tuple(done), reuse_ms=best.reuse_ms, full_ms=best.full_ms,
                       full_measured_at=now, full_runs=len(done), reuse_runs=reps,
                       logits=compare_logits(logits["reuse"], logits["full"]))

    # ---------------------------------------------------------- warm start
    def warm(self, prefixes: Sequence[tuple[str, CacheKey]]) -> tuple[WarmPrefix, ...]:
        """Put shipped prefixes in the cache before anyone asks (``engine.cache_prefill``, one call per
        prefix: meant for start-up, before visitors arrive). Each ``(label, key)`` should be the
        exact key a request will use (its ids, namespace and ``public_len``). Prefixes already
        cached cost nothing; longer than the engine's prompt cap are skipped."""
        engine = self.engine
        cap = getattr(engine, "max_prompt_tokens", None) or self.max_context
        # On a public deployment shipped content is never evicted for a visitor, so it may hold at
        # most half the pool: a small budget must still leave visitors room to be answered.
        shipped_cap = engine.stats().budget_bytes // self.kv_bytes_per_token // 2 if self.isolation else None
        out = []
        for label, key in prefixes:
            n = len(key.ids)
            if shipped_cap is not None and engine.stats().cached_tokens_now + n - engine.matched_len(key) > shipped_cap:
                out.append(WarmPrefix(label, n, 0, 0.0, skipped="shipped content may take at most half the cache "
                                      "on a shared deployment"))
                continue
            if n < 2:
                out.append(WarmPrefix(label, n, 0, 0.0, skipped="too short"))
                continue
            if n > cap:
                out.append(WarmPrefix(label, n, 0, 0.0, skipped=f"{n:,} tokens, over the {cap:,}-token prompt cap"))
                continue
            if engine.matched_len(key) >= n:
                out.append(WarmPrefix(label, n, 0, 0.0))
                continue
            with self._scratch(n):
                result = engine.cache_prefill(key)
            out.append(WarmPrefix(label, n, n - result.cached_tokens, result.prefill_ms,
                                  skipped=None if result.inserted_tokens or engine.matched_len(key) >= n
                                  else "the cache had no room for it"))
        self.warmed = tuple(out)
        return self.warmed

    # -------------------------------------------------------- growth curve
    @property
    def curve(self) -> GrowthCurve:
        return self._curve

    def growth_curve(self, filler_ids: Sequence[int], lengths: Sequence[int] = GROWTH_LENGTHS,
                     suffix_tokens: int = GROWTH_SUFFIX_TOKENS, pairs: int = 1,
                     on_point: Callable[[GrowthCurve], None] | None = None) -> GrowthCurve:
        """Measure prefill with and without reuse at each cached length (``suffix_tokens`` more
        tokens computed after it), on ``filler_ids`` cached in a namespace of its own
        (``GROWTH_NAMESPACE``, cleared afterwards). Lengths that do not fit the model's context
        or the filler are left out. The result is kept (``curve``) until measured again."""
        fits = min(self.max_context, len(filler_ids)) - suffix_tokens
        lengths = tuple(sorted({int(n) for n in lengths if 0 < int(n) <= fits}))
        info = self.engine.info()
        curve = GrowthCurve(state="running", device=info.device, dtype=info.dtype, started_at=time.time(),
                            lengths=lengths)
        if not lengths:
            self._curve = replace(curve, state="failed", error="no length fits this model's context")
            return self._curve
        if not self._curve_lock.acquire(blocking=False):
            return self._curve  # one is being measured
        self._curve = curve
        ids = tuple(int(t) for t in filler_ids[: lengths[-1] + suffix_tokens])
        try:
            self._cache_filler(ids[: lengths[-1]])
            points = []
            for n in lengths:
                key = CacheKey(ids[: n + suffix_tokens], GROWTH_NAMESPACE, 0)
                runs, reused = [], n
                for i in range(max(1, pairs)):
                    order = (n, 0) if i % 2 == 0 else (0, n)
                    sides = {c: self._timed_prefill(key, c, background=True) for c in order}
                    runs.append(PrefillPair(sides[n][0], sides[0][0]))
                    reused = min(reused, sides[n][1])
                best = _median_pair(runs)
                points.append(GrowthPoint(n, suffix_tokens, best.reuse_ms, best.full_ms, len(runs), reused))
                self._curve = replace(curve, points=tuple(points))
                if on_point is not None:
                    on_point(self._curve)
            self._curve = replace(curve, state="done", points=tuple(points), finished_at=time.time())
        except Exception as exc:  # a curve is a figure: report it, never take the app down
            self._curve = replace(curve, state="failed", error=f"{type(exc).__name__}: {exc}"[:200],
                                  finished_at=time.time())
        finally:
            self._curve_lock.release()
            try:
                self.engine.clear_cache(GROWTH_NAMESPACE)
            except EngineFault:  # the process is shutting down: the cache goes with it
                pass
        return self._curve

    def _cache_filler(self, ids: tuple[int, ...]) -> None:
        """Cache ``ids`` in ``GROWTH_NAMESPACE`` one block at a time (each ``engine.prefill`` computes
        only what the previous one left), so no call holds the model for long."""
        block = max(1, min(self.policy.block_tokens, BACKGROUND_BLOCK_TOKENS))
        for stop in (*range(block, len(ids), block), len(ids)):
            key = CacheKey(ids[:stop], GROWTH_NAMESPACE, 0)
            self._wait_for_quiet()
            with self._scratch(stop):
                self.engine.cache_prefill(key)
        if self.engine.matched_len(CacheKey(ids, GROWTH_NAMESPACE, 0)) < len(ids):
            raise EngineError("the cache had no room for the curve's filler")


def timer_for(engine) -> PrefillTimer | None:
    """The engine's one ``PrefillTimer`` (made on first use; its memo and curve are kept); None where
    ``capabilities.prefill_timing`` is False (remote: the backend's prefill cannot be timed from here)."""
    timed = engine.capabilities.prefill_timing
    return per_engine(engine, "prefill_timer", lambda: PrefillTimer(engine)) if timed else None
