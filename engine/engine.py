"""The local engine: requests in, streamed events and metrics out.

Owns: the inbox (bounded: ``EngineBusy``), the one worker thread that drives the
scheduler one step at a time under the runner's lock (engines sharing a runner take
turns step by step), each finished request's metrics, and the cache's figures for
``stats``. What it shares with the remote engine (validating and tokenizing a request,
the records and running totals, building ``EngineStats``) is ``engine.facade``'s; the
second tier's choice at start is ``engine.tier_setup``'s. The scheduling itself
(admission, batching, chunked prefill, fairness, memory) is ``engine/scheduler/``; one
running request is ``engine/scheduler/request.py``. Knows nothing about the UI.

One request, in token positions::

    prompt ids:  [0 ........ cached) [cached ....... n)   generated ...
                  the tree's slots,    prefilled in       decoded one per step,
                  read in place        chunks              batched with others
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import queue
import threading
import time
from typing import Any

from engine import validation
from engine.api import LOCAL, Capabilities, EngineAPI
from engine.config import EngineConfig
from engine.device_defaults import default_budget_bytes, default_chunk_tokens
from engine.facade import FacadeBase
from engine.handle import END_OF_STREAM, RequestHandle
from engine.kvcache.eviction import make_policy
from engine.kvcache.kv_pool import KVPool
from engine.kvcache.prefix_cache import FullPrefixCache, NoPrefixCache, RadixCache
from engine.kvcache.second_tier import SecondTier
from engine.model.runner import ModelRunner
from engine.namespaces import owner_of
from engine.prefill_ops import PrefillOps, PrefillResult
from engine.request_metrics import request_metrics
from engine.scheduler.config import SchedulerConfig
from engine.scheduler.postprocess import as_engine_error
from engine.scheduler.request import Request
from engine.scheduler.scheduler import Scheduler
from engine.tier_setup import make_tier, tier_fingerprint
from engine.types import (
    CacheKey,
    EngineBusy,
    EngineError,
    EngineFault,
    EngineInfo,
    GenerationRequest,
    RequestMetrics,
    StepRecord,
    TreeSnapshot,
)
from engine.visibility import new_request_id

log = logging.getLogger(__name__)

_STOP = object()  # inbox marker: the worker ends (Engine.close)

__all__ = ["Engine", "PrefillResult", "RequestHandle", "default_budget_bytes", "default_chunk_tokens"]


class Engine(FacadeBase, PrefillOps):
    """Requests in, events out. ``max_batch`` requests run together (1 gives the
    one-at-a-time engine); ``chunk_tokens`` bounds the prompt tokens computed per step."""

    def __init__(self, runner: ModelRunner, config: EngineConfig | None = None, **settings: Any) -> None:
        """``config`` (``engine.config.EngineConfig``: every setting, each with its rule), or its
        fields as keywords, the shorthand (``Engine(runner, max_batch=1)``), checked alike; both at
        once, or a keyword ``EngineConfig`` lacks, is a ``TypeError``."""
        if config is None:
            config = EngineConfig(**settings)
        elif settings or not isinstance(config, EngineConfig):
            raise TypeError("Engine(runner, config) takes an EngineConfig, or its fields as keywords, not both")
        self.config = c = config
        self.runner = runner
        self.text = runner.text
        self.eviction_policy = make_policy(c.eviction_policy)
        budget = default_budget_bytes(runner.device) if c.budget_bytes is None else c.budget_bytes
        # One pool holds all KV, cached and running; without a cache it holds the running only.
        pool = KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype, runner.device, budget)
        fp = tier_fingerprint(runner, c.tier_dir) if c.enable_cache and c.tier_bytes > 0 else ""
        self.tier = make_tier(runner, c.tier_bytes, c.tier_dir, fp, c.isolation) if fp else None
        self._capabilities = dataclasses.replace(  # fixed at start
            LOCAL, second_tier=self.tier is not None,
            prefill_timing=runner.in_process_forwards,  # ZeroGPU: forwards run in GPU calls, timed in-step only
            gpu_calls=not runner.in_process_forwards)
        second = SecondTier(self.tier, fp, public_only=c.isolation) if self.tier is not None else None
        self.cache: FullPrefixCache = (RadixCache(pool, fair_share=c.isolation, tier=second, policy=self.eviction_policy)
                                       if c.enable_cache else NoPrefixCache(pool))
        self.kv_events = None
        if c.kv_events_config and c.enable_cache:
            from engine.kvcache.kv_events import KVEventPublisher

            self.kv_events = KVEventPublisher.from_config(c.kv_events_config, private_tokens=not c.isolation)
            self.cache.publish_to(self.kv_events)
        self.isolation = c.isolation
        self.max_prompt_tokens = min(c.max_prompt_tokens or runner.max_context, runner.max_context)
        self.max_new_tokens_cap = c.max_new_tokens_cap
        self.max_queue = c.max_queue
        self._queue: queue.Queue = queue.Queue(maxsize=c.max_queue)  # the inbox; the scheduler drains it
        # On a public deployment one address (or API client) may hold at most half the waiting
        # places, so it can never fill the inbox for everyone else, while a classroom behind it
        # (many tabs asking at once) still fits; a running request holds no place.
        self.max_waiting_per_owner = max(1, c.max_queue // 2)
        self._submit_lock = threading.Lock()
        self._in_hand: list[RequestHandle] = []  # the worker's handles between the inbox and the scheduler
        self._stats_lock = threading.Lock()
        self._submitted = 0  # requests accepted for validation so far (ids are random: ``new_request_id``)
        self._seq = 0
        self._start_records(c.history_size, self._stats_lock)
        config = SchedulerConfig(max_batch=c.max_batch, isolation=c.isolation,
                                 chunk_tokens=c.chunk_tokens or default_chunk_tokens(runner.device))
        # ZeroGPU mode brings its own (engine.zerogpu.turns: one GPU call per visitor turn)
        self.scheduler = getattr(runner, "scheduler_class", Scheduler)(runner, self.cache, config)
        self._closed = self._stopping = False
        self._worker = threading.Thread(target=self._work, name="engine-worker", daemon=True)
        self._worker.start()

    # ---------------------------------------------------------------- public
    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; raises EngineError for bad input and EngineBusy when full.

        Validation happens here, before anything touches the cache.
        """
        if self._closed or self.runner.compute.stopped:
            raise EngineFault("This engine has been shut down.")
        ids = self.prompt_ids(request)
        capacity = self.cache.pool.capacity
        if len(ids) + 1 > capacity:  # the prompt and one new token must fit in the pool
            raise EngineError(
                f"This prompt needs {(len(ids) + 1) * self.cache.bytes_per_token / 2**20:,.1f} MiB of KV and the "
                f"cache budget is {self.cache.budget_bytes / 2**20:,.1f} MiB: shorten it or raise the budget.")
        request = dataclasses.replace(request, sampling=validation.check_sampling(request.sampling))
        validation.check_logprobs(request)
        with self._stats_lock:
            rid = new_request_id()
            self._submitted += 1
        handle = RequestHandle(request, ids, rid)
        handle.context = contextvars.copy_context()  # the caller's (a page visitor's request): ZeroGPU calls carry it
        busy = EngineBusy("The engine is busy: too many requests are waiting. Please try again in a moment.")
        with self._submit_lock:  # the counts and the put as one: two submits cannot both take the last place
            waiting = self._waiting_namespaces()
            if len(waiting) >= self.max_queue:
                raise busy
            mine = sum(owner_of(ns) == owner_of(request.namespace) for ns in waiting) if self.isolation else 0
            if mine >= self.max_waiting_per_owner:
                raise EngineBusy(f"The engine is busy: you already have {mine} requests waiting (at most "
                                 f"{self.max_waiting_per_owner} from one address). Wait for one to start, then "
                                 "try again.")
            try:
                self._queue.put_nowait(handle)
            except queue.Full:
                raise busy from None
        return handle

    def snapshot(self, viewer: str | None = None) -> TreeSnapshot:
        """The tree as plain data; in isolation mode ``viewer`` (a namespace) sees
        other namespaces' nodes as shape and size only."""
        return self.cache.snapshot(self.text.decode, viewer=viewer if self.isolation else None)

    def _matched_len(self, key: CacheKey) -> int:
        """The radix cache's memory match now (the cache's own lock; the tree is not touched)."""
        return self.cache.match_len(key)

    def _cache_figures(self) -> dict[str, object]:
        cache, sched, waiting = self.cache, self.scheduler, self._waiting()
        return dict(cache_bytes=cache.bytes_in_use, budget_bytes=cache.budget_bytes, cached_tokens_now=cache.num_tokens,
                    num_nodes=cache.num_nodes, evicted_tokens=cache.evicted_tokens, queue_depth=waiting,
                    locked_tokens=cache.locked_tokens(), running=len(sched.running), waiting=waiting,
                    tokens_per_s=sched.tokens_per_s(), max_batch=sched.config.max_batch,
                    running_bytes=cache.running_tokens * cache.bytes_per_token, tree_bytes=cache.tree_bytes,
                    shared_tokens=cache.shared_tokens, **cache.tier_stats(),
                    kv_events_dropped_batches=None if self.kv_events is None else self.kv_events.dropped_batches)

    def _view(self, viewer: str | None) -> TreeSnapshot:
        return self.cache.snapshot(None, viewer=viewer)

    def offload_cache(self) -> int:
        """Evict every unlocked entry to the second tier (the prefill bench's tier row); tokens evicted."""
        return self.runner.compute.call(self.cache.offload)

    def persist_cache(self) -> int | None:
        """Write what the cache holds to the second tier, so a restart finds it; chunks written.
        None when nothing outlives this process: no tier, or one in host memory (a GPU's)."""
        if self.tier is None or not self.tier.persistent:
            return None
        return self.runner.compute.call(self.cache.persist)

    def configure_scheduler(self, **changes) -> None:
        """Change the scheduler's policy knobs (fields of ``SchedulerConfig``: ``max_batch``,
        ``lpm_queue_limit``, ``max_wait_s``, ...) from the next step on. The request-order
        demo uses it to run one queue first-come-first-served (``lpm_queue_limit=0``) and
        longest-prefix-match first on the scheduler's own admission code."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(SchedulerConfig)}
        if unknown:
            raise EngineError(f"unknown scheduler setting(s): {', '.join(sorted(unknown))}")
        self.scheduler.config = dataclasses.replace(self.scheduler.config, **changes)

    def step_log(self, n: int | None = None) -> list[StepRecord]:
        """The scheduler's last ``n`` forwards (all kept ones if None), oldest first."""
        return self.scheduler.step_log(n)

    def healthy(self) -> bool:
        """Takes requests now: not closed and its worker thread alive (a step that fails only fails
        its requests: the worker lives on)."""
        return not self._closed and self._worker.is_alive() and not self.runner.compute.stopped

    def busy(self) -> bool:
        """A request waits or runs, or a step is under way: background measurements wait for
        this to be False (``analysis.prefill_timing``), so visitors never queue behind them."""
        return bool(self._waiting() or self.scheduler.has_work() or self.runner.lock.locked())

    def _waiting_namespaces(self) -> list[str]:
        """The namespace of each request submitted and not admitted yet (the inbox, the worker's hand,
        the scheduler's waiting list): what the inbox cap and each owner's places count."""
        with self._queue.mutex:
            queued = [h.request.namespace for h in self._queue.queue if h is not _STOP]
        # Copies: the worker and the compute thread change these lists.
        in_hand = [h.request.namespace for h in list(self._in_hand) if h is not _STOP]
        return queued + in_hand + [r.namespace for r in list(self.scheduler.waiting)]

    def _waiting(self) -> int:
        """How many requests wait (``_waiting_namespaces``): what ``queue_depth`` means everywhere."""
        return len(self._waiting_namespaces())

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    def backend_metrics(self) -> dict[str, float]:
        """No server behind this engine: its own metrics are ``server.metrics``' (``/metrics``)."""
        return {}

    def version(self) -> int:
        """Changes whenever the tree, its locks, the budget or the request records change."""
        # Both counters only grow, so their sum moves whenever either does.
        return self.cache.version + self._totals.requests

    def spawn(self, budget_bytes: int, max_batch: int = 1, max_queue: int = 64) -> EngineAPI:
        """A small engine of its own on this one's model (the request-order demo's); steps of
        the two take turns on the runner. Its cache is separate and starts empty."""
        return Engine(self.runner, budget_bytes=budget_bytes, max_queue=max_queue, max_batch=max_batch,
                      eviction_policy=self.eviction_policy.name)

    def info(self) -> EngineInfo:
        r = self.runner
        return EngineInfo(model_name=r.name, device=r.where, dtype=str(r.dtype).replace("torch.", ""),
                          num_layers=r.num_layers, num_kv_heads=r.num_kv_heads, head_dim=r.head_dim,
                          kv_bytes_per_token=r.kv_bytes_per_token, max_context=r.max_context,
                          cache_enabled=self.cache.enabled, isolation=self.isolation,
                          linear_kernels=r.linear_kernels, forward=r.forward_kind, plan=r.plan.summary(),
                          attention=r.attention.describe(), isa=r.kernel_isa,
                          eviction=self.eviction_policy.describe() if self.cache.enabled else "")

    def clear_cache(self, namespace: str | None = None) -> int:
        """Evict every unlocked node (of one namespace only, if given); returns tokens freed."""
        return self.runner.compute.call(self.cache.clear, namespace)

    def set_budget(self, budget_bytes: int) -> int:
        return self.runner.compute.call(self.cache.set_budget, budget_bytes)

    def check_invariants(self) -> None:
        self.cache.check_invariants()

    # ---------------------------------------------------------------- worker
    def cancel_all(self) -> int:
        """Cancel every request submitted and not finished (a shutdown: SIGTERM); each ends as
        ``cancelled`` at the next step, its locks freed. Returns how many were asked."""
        with self._queue.mutex:
            handles = [h for h in self._queue.queue if h is not _STOP]
        handles += [h for h in list(self._in_hand) if h is not _STOP]
        handles += [r.handle for r in [*list(self.scheduler.running), *list(self.scheduler.waiting)]]
        for h in handles:
            h.cancel()
        return len(handles)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """``ControlAPI.shutdown``: ``cancel_all``, then the worker and the compute thread end (a
        native thread pool still inside a forward at exit aborts the process, issue 58)."""
        self.cancel_all()
        for stop in (self.close, self.runner.close):
            try:
                stop(timeout_s=timeout_s)
            except Exception as exc:  # best effort: one line, never a traceback
                log.warning("while stopping: %s: %s", type(exc).__name__, exc)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the worker once the requests already submitted are done; later submits raise
        ``EngineError``. For command lines that build engines one after another."""
        self._closed = True
        self._queue.put(_STOP)
        self._worker.join(timeout_s)
        if self.tier is not None:
            self.persist_cache()
            self.tier.close()  # releases the folder's lock: the next engine on it may open it
        if self.kv_events is not None:
            self.kv_events.close()

    def _work(self) -> None:
        while True:
            first = self._queue.get()  # sleeps while idle
            if first is _STOP:
                return
            pending = [first]
            self._in_hand = pending  # taken from the inbox, not yet in the scheduler: still waiting
            while True:
                try:
                    with self.runner.lock:  # engines sharing one runner take turns, step by step
                        taken, pending = pending, []
                        self._end(self.runner.compute.call(self._steps, taken))  # torch runs on one thread
                        idle = not self.scheduler.has_work()
                except Exception as exc:  # never kill the worker; fail what was running, report one line
                    log.exception("scheduler step failed")
                    self.scheduler.fail_all(exc)
                    self._refuse_in_hand(exc)  # taken from the inbox, never reached the scheduler
                    self._end(self.scheduler.take_finished())  # those that finished before it failed
                    idle = not self.scheduler.has_work()
                if idle and self._stopping:
                    return
                if idle and self._queue.empty():
                    break
                # Locks are not fair: when other engines sharing the runner (or anyone else) wait
                # for its lock, pause a moment so that they get their turn between our steps.
                if self.runner.lock.waiting:
                    time.sleep(0.001)

    def _steps(self, pending: list[RequestHandle]) -> list[Request]:
        """Scheduler steps back to back on the compute thread (new arrivals taken in before each),
        until one finishes a request (recorded by the worker, off this thread), the work runs
        out, a stop comes, or another engine waits for the runner or another call for the compute
        thread. One hand-over between the worker and the compute thread per run of steps, not two
        per step (one stream through /v1 measured the same within the noise either way)."""
        compute = self.runner.compute
        while True:
            self._take(pending)
            pending = self._in_hand = []
            finished = self.scheduler.step()
            if (finished or self._stopping or not self.scheduler.has_work() or self.runner.lock.waiting
                    or compute.busy_elsewhere):
                return finished

    def _take(self, pending: list[RequestHandle]) -> None:
        """Move the inbox into the scheduler's waiting list."""
        self._drain_inbox(pending)
        for handle in pending:
            if handle is _STOP:
                self._stopping = True
                continue
            if handle.cancelled.is_set():
                handle.events.put(END_OF_STREAM)
                continue
            try:
                req, ids = handle.request, handle.ids
                max_new = validation.new_token_limit(req.sampling.max_new_tokens, self.max_new_tokens_cap,
                                                     self.runner.max_context - len(ids),
                                                     self.cache.pool.capacity - len(ids))
                self._seq += 1
                self.scheduler.add(Request(handle, self.cache_key(ids, req), max_new, self._seq))
            except Exception as exc:  # this request only: its stream ends with the error, never left waiting
                log.warning("request %s refused at intake: %s", handle.request_id, exc)
                handle.events.put(as_engine_error(exc))
                handle.events.put(END_OF_STREAM)

    def _drain_inbox(self, into: list) -> None:
        """Move every handle in the inbox onto ``into``, without waiting."""
        while True:
            try:
                into.append(self._queue.get_nowait())
            except queue.Empty:
                return

    def _refuse_in_hand(self, exc: BaseException) -> None:
        """End with ``exc`` each handle taken from the inbox that no step took in (its compute thread stopped)."""
        handles, self._in_hand = self._in_hand, []
        if self.runner.compute.stopped:  # nothing will ever run here: the inbox ends too
            self._drain_inbox(handles)
        self._stopping = self._stopping or _STOP in handles
        for handle in (h for h in handles if h is not _STOP):
            handle.events.put(as_engine_error(exc))
            handle.events.put(END_OF_STREAM)

    def _end(self, finished: list[Request]) -> None:
        """Record the requests the scheduler finished and close their streams with the metrics."""
        for r in finished:
            try:
                metrics = self._record(r)
            except Exception:  # its figures failed: the stream still ends, never left waiting
                log.exception("request %s: its metrics failed", r.request_id)
                metrics = None
            r.end(metrics)

    def _record(self, r: Request) -> RequestMetrics:
        with self._stats_lock:
            return self._add_record(request_metrics(r, self.cache))
