"""The scheduler: which requests run, and one step of work at a time.

Owns: the waiting list and the running set, admission (policy, fairness,
memory, in-batch prefix sharing), the work of one step, finishing requests
(cache insert, lock release, the no-reuse baseline) and the step log. Knows
the model only through ``ModelRunner`` (forwards, sampling input) and the
cache only through ``PrefixCache``; it never sees threads or the UI: the
engine facade calls ``step()`` under the runner's lock.

One step, in order:

1. Requests that were cancelled leave (waiting ones silently; running ones
   finish as ``cancelled``, their reply so far is cached, locks and budget freed).
2. Admission, while rows are free (``max_batch``): the waiting list is ordered
   by longest cached prefix first (SGLang's LPM), first-come-first-served when
   the list is long, anyone waiting over ``max_wait_s`` first (ageing guard),
   and round-robin across namespaces (fewest running first). With isolation on
   at most one request per visitor runs; more wait behind it. A request whose
   uncached prefix another request is prefilling right now waits until that
   prompt is cached, then hits (in-batch prefix sharing). Admission matches the
   tree, locks the match (read in place, never copied) and takes pool slots for
   the rest of the request (uncached prompt plus new tokens), evicting unlocked
   cache for room; if that is not enough the request waits until a running one
   gives slots back (a request that alone could never fit is refused at submit,
   or fails with a clear error if the budget shrank since).
3. One forward: prefill chunks, at most ``chunk_tokens`` prompt tokens per step
   (chunked prefill: a 4,000-token prompt cannot freeze the others' streams;
   prompts with fewer chunks done go first, so a short newcomer is not stuck
   behind a long prompt), packed with one decode token for every request in
   decode. A finished prompt passes to the tree (its slots, no copy: later
   arrivals hit it) and stays locked while its request runs; its first token
   comes from the prefill's logits. A
   request measuring the no-reuse baseline prefills in forwards of its own, so
   its with-reuse figure is its own work only.
4. No-reuse baselines with what is left of the step's token budget, and at
   least ``baseline_min_tokens`` of them per step so that under steady prefill
   load they still finish (work of their own: never inside someone's prefill).
   With isolation on (a public deployment) the baseline is skipped above
   ``baseline_max_tokens_isolated`` (2,000) prompt tokens and the metrics say
   None: a long from-scratch prefill is costly work that only shows a figure.

Every forward is logged as a ``StepRecord`` (bounded), for the scheduler view.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.model import sampling
from engine.model.paged_attention import PagedSegment
from engine.model.runner import ModelRunner
from engine.prefix_cache import PrefixCache
from engine.radix_tree import CacheKey, common_prefix_len
from engine.request import DONE, Request, State
from engine.types import EngineError, EngineFault, GenerationEvent, RequestMetrics, StepRecord

log = logging.getLogger(__name__)

ACTIVE = (State.PREFILL, State.DECODE, State.BASELINE)


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 16  # requests in prefill or decode at once (a decode forward's batch size at most)
    chunk_tokens: int = 256  # prompt tokens computed per step, over all prefills and baselines
    isolation: bool = False  # a public deployment: one running request per visitor namespace
    lpm_queue_limit: int = 16  # a longer waiting list is served first-come-first-served
    max_wait_s: float = 10.0  # waited longer: admitted first, in arrival order (ageing guard)
    share_min_tokens: int = 16  # hold a request back while another prefills this many of its uncached tokens
    baseline_max_tokens_isolated: int = 2000  # with isolation, no no-reuse baseline above this prompt length
    baseline_min_tokens: int = 64  # no-reuse baseline tokens computed per step even when prefills use the budget
    match_refresh_s: float = 0.25  # a waiting request's cached-prefix length is re-matched this often
    step_log_size: int = 600
    rate_window_s: float = 10.0  # tokens/s is measured over this window


def visitor_of(namespace: str) -> str:
    """A visitor's namespace without the sub-namespace (``v-abc/variant`` -> ``v-abc``)."""
    return namespace.split("/", 1)[0]


class Scheduler:
    def __init__(self, runner: ModelRunner, cache: PrefixCache, config: SchedulerConfig,
                 cache_key: Callable[[list[int], Request], CacheKey],
                 record: Callable[[Request], RequestMetrics]) -> None:
        self.runner, self.cache, self.config = runner, cache, config
        self._cache_key, self._record = cache_key, record
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # prefill, decode and baseline, in admission order
        self._steps: deque[StepRecord] = deque(maxlen=config.step_log_size)
        self._log_lock = threading.Lock()
        self._step_id = 0
        self._rate: deque[tuple[float, int]] = deque()  # (time, output tokens) per step
        self._memory_short = False  # admission found no room; retried once slots are given back

    # ---------------------------------------------------------------- facts
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step_log(self, n: int | None = None) -> list[StepRecord]:
        with self._log_lock:
            items = list(self._steps)
        return items[-n:] if n else items

    def tokens_per_s(self) -> float:
        """Output tokens per second over the last ``rate_window_s`` (all requests together)."""
        now = time.perf_counter()
        with self._log_lock:
            recent = [(t, n) for t, n in self._rate if now - t <= self.config.rate_window_s]
        if not recent:
            return 0.0
        span = max(now - recent[0][0], 1e-3)
        return sum(n for _, n in recent) / span if span >= 0.5 else 0.0

    def add(self, r: Request) -> None:
        self.waiting.append(r)

    # ----------------------------------------------------------------- step
    def step(self) -> None:
        self._step_id += 1
        self._drop_cancelled()
        self._admit()
        budget = self._forward(self.config.chunk_tokens)
        self._baseline_work(budget)
        self._report_queue()

    def fail_all(self, exc: BaseException) -> None:
        """Something outside any one request's work failed: end every request with an error."""
        for r in list(self.running):
            self._fail(r, exc)
        for r in self.waiting:
            r.emit(_as_engine_error(exc))
            r.emit(DONE)
        self.waiting.clear()

    # ----------------------------------------------------------- cancelling
    def _drop_cancelled(self) -> None:
        keep = []
        for r in self.waiting:
            if r.cancelled:
                r.emit(DONE)  # never started: no events, nothing recorded
            else:
                keep.append(r)
        self.waiting = keep
        for r in list(self.running):
            if r.cancelled:
                if r.state is State.BASELINE:
                    r.baseline_ms = None
                    self._complete(r)
                else:
                    self._finish(r, "cancelled")

    # ------------------------------------------------------------ admission
    def _ordered_waiting(self) -> list[Request]:
        cfg, now = self.config, time.perf_counter()
        fcfs = len(self.waiting) > cfg.lpm_queue_limit
        if not fcfs:
            for r in self.waiting:
                if now - r.match_checked_at > cfg.match_refresh_s:
                    r.match_len = self.cache.match_len(r.key)
                    r.match_checked_at = now
        active = self._active_per_visitor()

        def order(r: Request) -> tuple:
            if now - r.handle.submitted_at > cfg.max_wait_s:
                return (0, 0, 0, r.seq)
            return (1, active.get(visitor_of(r.namespace), 0), 0 if fcfs else -r.match_len, r.seq)

        return sorted(self.waiting, key=order)

    def _active_per_visitor(self) -> dict[str, int]:
        active: dict[str, int] = {}
        for r in self.running:
            v = visitor_of(r.namespace)
            active[v] = active.get(v, 0) + 1
        return active

    def _rows_used(self) -> int:
        return sum(1 for r in self.running if r.state in (State.PREFILL, State.DECODE))

    def _admit(self) -> None:
        if self._memory_short and self.running:
            return  # nothing was given back since admission last ran out of room
        self._memory_short = False
        admitted_any = True
        while admitted_any and self.waiting and self._rows_used() < self.config.max_batch:
            admitted_any = False
            active = self._active_per_visitor()
            for r in self._ordered_waiting():
                if self.config.isolation and active.get(visitor_of(r.namespace), 0) > 0:
                    continue  # one request per visitor at a time on a public deployment
                if self._prefix_being_computed(r):
                    continue  # wait for the other request's prompt to be cached, then hit it
                result = self._try_admit(r)
                if result is None:
                    self._memory_short = True
                    return  # out of memory until something finishes: keep the order, admit nobody else
                if result:
                    admitted_any = True
                    break  # re-order: fairness counts changed

    def _prefix_being_computed(self, r: Request) -> bool:
        """Would ``r`` compute tokens that a running prefill is computing now (and will cache)?"""
        if not self.cache.enabled:
            return False
        cached = self.cache.match_len(r.key)
        r.match_len, r.match_checked_at = cached, time.perf_counter()
        for p in self.running:
            if p.state is not State.PREFILL:
                continue
            shared = common_prefix_len(r.ids, p.ids)
            if p.namespace != r.namespace:
                shared = min(shared, r.key.public_len, p.key.public_len)
            shared = min(shared, len(r.ids) - 1)  # the last prompt token is always computed
            if shared - cached >= self.config.share_min_tokens:
                return True
        return False

    def _try_admit(self, r: Request) -> bool | None:
        """Admit ``r``: True; None when memory is short (it keeps waiting); False when it
        failed (and has left)."""
        t0 = time.perf_counter()
        try:
            rs = self.cache.acquire(r.key, len(r.ids) - 1, r.capacity_tokens)
        except Exception as exc:  # only this request fails (out of memory, a bug): the others go on
            self.waiting.remove(r)
            self._fail(r, exc)
            return False
        if rs is None:
            if self.running:
                return None
            self.waiting.remove(r)  # nothing runs, so nothing will give room back: it cannot run now
            need = r.capacity_tokens * self.cache.bytes_per_token / 2**20
            where = (f"the cache budget is {self.cache.budget_bytes / 2**20:,.1f} MiB" if not self.config.isolation else
                     "on this shared deployment the rest of the cache is shipped content and other visitors' share")
            self._fail(r, EngineError(f"This request needs {need:,.1f} MiB of KV (prompt plus new tokens) and {where}: "
                                      "shorten the prompt or ask for fewer new tokens."))
            return False
        self.waiting.remove(r)
        r.slots = rs
        r.cached_tokens, r.path = rs.cached_tokens, rs.path
        r.tier_tokens, r.tier_load_ms = rs.tier_tokens, rs.tier_load_ms
        r.admitted_at = t0
        r.state = State.PREFILL
        r.prefill_ms = (time.perf_counter() - t0) * 1000  # match and slot bookkeeping
        r.seed_generator()
        self.running.append(r)
        return True

    # ---------------------------------------------------------------- work
    def _forward(self, budget: int) -> int:
        """This step's model work: prefill chunks (at most ``budget`` tokens, newcomers first)
        and one token for every request in decode, packed into one forward. A request that
        measures the no-reuse baseline prefills in forwards of its own, so its with-reuse
        figure holds only its own work. Returns what is left of the token budget."""
        own, packed = [], []
        for r in sorted((r for r in self.running if r.state is State.PREFILL), key=lambda r: (r.prefill_chunks, r.seq)):
            if budget <= 0:
                break
            start = r.prefilled
            n = min(len(r.ids) - start, budget)
            budget -= n
            (own if r.req.measure_baseline else packed).append((r, start, n))
        decoding = [r for r in self.running if r.state is State.DECODE]
        for chunk in own:
            self._run([chunk], [])
        if packed or decoding:
            self._run(packed, decoding)
        return budget

    def _run(self, chunks: list[tuple[Request, int, int]], decoding: list[Request]) -> None:
        """One forward over prefill ``chunks`` (request, start, tokens) and ``decoding`` requests."""
        segments = [PagedSegment(r.ids[start:start + n], start, r.slots.slots, r.slots.runs())
                    for r, start, n in chunks]
        segments += [PagedSegment([r.out_ids[-1]], r.slots.length, r.slots.slots, r.slots.runs()) for r in decoding]
        everyone = [r for r, _, _ in chunks] + decoding
        try:
            t0 = time.perf_counter()
            logits = self.runner.forward_paged(self.cache.pool, segments)
            self.runner.synchronize()
            ms = (time.perf_counter() - t0) * 1000
        except Exception as exc:
            for r in everyone:
                self._fail(r, exc)
            return
        for seg, r in zip(segments, everyone, strict=True):
            r.slots.length = seg.past + len(seg.ids)
        kind = "decode" if not chunks else "prefill" if not decoding else "mixed"
        cached = sum(r.cached_tokens for r, start, _ in chunks if start == r.cached_tokens)
        self._log(kind, everyone, computed=sum(n for _, _, n in chunks) + len(decoding), cached=cached,
                  duration_ms=ms, prefilling=tuple(r.request_id for r, _, _ in chunks))
        for i, (r, _, _) in enumerate(chunks):
            r.prefill_ms += ms
            r.prefill_chunks += 1
            r.prefill_shared_step = r.prefill_shared_step or len(everyone) > 1
            if r.prefilled < len(r.ids):
                r.emit(GenerationEvent(text="", phase="prefill", prompt_tokens=len(r.ids),
                                       cached_tokens=r.cached_tokens, prefilled_tokens=r.prefilled))
            else:
                self._prefill_done(r, logits[i])
        for i, r in enumerate(decoding, start=len(chunks)):
            r.batch_sizes.append(len(everyone))
            self._take_token(r, logits[i])

    def _prefill_done(self, r: Request, logits) -> None:
        # The prompt's slots pass to the tree, where later arrivals hit it; they stay locked
        # there until the request finishes.
        if r.req.store:
            r.inserted_tokens += self.cache.adopt(r.slots, r.key)
        r.state = State.DECODE
        if r.max_new_tokens <= 0:
            r.first_token_at = time.perf_counter()
            self._finish(r, "length")
            return
        self._take_token(r, logits)

    def _take_token(self, r: Request, logits) -> None:
        """Sample ``r``'s next token from its logits row; stream it or finish."""
        tok = sampling.sample(logits, r.req.sampling, r.generator, r.out_ids)
        now = time.perf_counter()
        if r.first_token_at is None:
            r.first_token_at = now
        self._count_output(1)
        if tok in self.runner.text.eos_ids:
            self._finish(r, "stop")
            return
        r.last_token_at = now
        text = r.append_token(tok, self.runner.text.decode)
        r.emit(GenerationEvent(text=text, token_id=tok, phase="decode", prompt_tokens=len(r.ids),
                               cached_tokens=r.cached_tokens, prefilled_tokens=len(r.ids)))
        if len(r.out_ids) >= r.max_new_tokens:
            self._finish(r, "length")

    def _baseline_work(self, budget: int) -> None:
        budget = max(budget, self.config.baseline_min_tokens)  # a bounded share even under prefill load
        for r in [r for r in self.running if r.state is State.BASELINE]:
            if budget <= 0:
                return
            rs = r.baseline_slots
            start = rs.length
            n = min(len(r.ids) - start, budget)
            try:
                t0 = time.perf_counter()
                self.runner.forward_paged(self.cache.pool, [PagedSegment(r.ids[start:start + n], start, rs.slots,
                                                                         rs.runs())])
                self.runner.synchronize()
                ms = (time.perf_counter() - t0) * 1000
            except Exception as exc:
                self._fail(r, exc)
                continue
            rs.length += n
            budget -= n
            r.baseline_ms = (r.baseline_ms or 0.0) + ms
            self._log("baseline", [r], computed=n, cached=0, duration_ms=ms)
            if rs.length >= len(r.ids):
                self._complete(r)

    # ------------------------------------------------------------ finishing
    def _wants_baseline(self, r: Request) -> bool:
        if not r.req.measure_baseline or r.finish_reason == "cancelled":
            return False
        return not (self.config.isolation and len(r.ids) > self.config.baseline_max_tokens_isolated)

    def _finish(self, r: Request, reason: str) -> None:
        """The answer is over: cache prompt plus reply (its slots pass to the tree), free the
        rest of its slots, then the no-reuse baseline or done."""
        r.finish_reason = reason
        rs = r.slots
        if rs is not None and r.req.store and r.state is State.DECODE and rs.length > len(r.ids):
            # Prompt plus reply, so the next chat turn reuses the answer too.
            key = self._cache_key(r.ids + r.out_ids[: rs.length - len(r.ids)], r)
            r.inserted_tokens += self.cache.adopt(rs, key)
        self._release(r)
        if self._wants_baseline(r):
            # The no-reuse prefill holds pool slots of its own too; without room it is skipped.
            r.baseline_slots = self.cache.acquire(CacheKey(()), 0, len(r.ids))
            if r.baseline_slots is not None:
                r.state = State.BASELINE
                r.emit(GenerationEvent(text=r.text, phase="baseline", prompt_tokens=len(r.ids),
                                       cached_tokens=r.cached_tokens, prefilled_tokens=len(r.ids)))
                return
        self._complete(r)

    def _complete(self, r: Request) -> None:
        self._release(r)
        r.state = State.DONE
        if r in self.running:
            self.running.remove(r)
        r.text = self.runner.text.decode(r.out_ids)
        metrics = self._record(r)
        r.emit(GenerationEvent(text=r.text, done=True, metrics=metrics, phase="done", prompt_tokens=len(r.ids),
                               cached_tokens=r.cached_tokens, prefilled_tokens=len(r.ids)))
        r.emit(DONE)

    def _fail(self, r: Request, exc: BaseException) -> None:
        if not isinstance(exc, EngineError):
            log.error("request %s failed", r.request_id, exc_info=exc)
        self._release(r)
        r.state = State.DONE
        if r in self.running:
            self.running.remove(r)
        r.emit(_as_engine_error(exc))
        r.emit(DONE)

    def _release(self, r: Request) -> None:
        """Give back every pool slot the request holds (its cached part is unlocked)."""
        for name in ("slots", "baseline_slots"):
            rs = getattr(r, name)
            if rs is not None:
                self.cache.release(rs)
                setattr(r, name, None)
                self._memory_short = False  # room came back

    # -------------------------------------------------------------- showing
    def _report_queue(self) -> None:
        """Tell each waiting request how many are ahead of it, when that changes."""
        if not self.waiting:
            return
        for i, r in enumerate(self._ordered_waiting()):
            if i != r.last_queue_ahead:
                r.last_queue_ahead = i
                r.emit(GenerationEvent(text="", phase="queued", queue_ahead=i, prompt_tokens=len(r.ids)))

    def _log(self, kind: str, rows: list[Request], computed: int, cached: int, duration_ms: float,
             prefilling: tuple[int, ...] = ()) -> None:
        rec = StepRecord(step_id=self._step_id, kind=kind, request_ids=tuple(r.request_id for r in rows),
                         prefill_request_ids=prefilling,
                         namespaces=tuple(r.namespace for r in rows), batch_size=len(rows),
                         computed_tokens=computed, cached_tokens=cached, duration_ms=duration_ms,
                         finished_at=time.time(), running=len(self.running), waiting=len(self.waiting))
        with self._log_lock:
            self._steps.append(rec)

    def _count_output(self, n: int) -> None:
        now = time.perf_counter()
        with self._log_lock:
            self._rate.append((now, n))
            while self._rate and now - self._rate[0][0] > self.config.rate_window_s:
                self._rate.popleft()


def _as_engine_error(exc: BaseException) -> EngineError:
    """Bad input stays as it is; anything else is a fault of the server (``EngineFault``)."""
    if isinstance(exc, EngineError):
        return exc
    return EngineFault(f"The request failed: {type(exc).__name__}: {exc}"[:300])
