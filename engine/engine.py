"""The engine facade: requests in, streamed events and metrics out.

Owns: the request queue and the one worker thread that runs the model (model
runs are serialised), validation of requests, the flow of one request
(match -> prefill the rest -> insert -> decode -> insert), metrics and
running totals. Knows nothing about the UI.

One request, in token positions::

    prompt ids:  [0 ........ cached) [cached ....... n)   generated ...
                  copied from pool     prefilled now      decoded one by one
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from engine import sampling, validation
from engine.kv_pool import KVPool
from engine.model_runner import ModelRunner
from engine.prefix_cache import NoPrefixCache, PrefixCache, RadixCache
from engine.radix_tree import CacheKey
from engine.types import (
    EngineBusy,
    EngineError,
    EngineInfo,
    EngineStats,
    GenerationEvent,
    GenerationRequest,
    RequestMetrics,
    TreeSnapshot,
)

log = logging.getLogger(__name__)

_DONE = object()


def default_budget_bytes(device: torch.device) -> int:
    """1 GiB on CPU and MPS; on CUDA a quarter of free memory, at most 8 GiB."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(min(free // 4, 8 * 2**30))
    return 2**30


class PrefillResult(NamedTuple):
    logits: torch.Tensor  # fp32 logits of the last prompt position
    cached_tokens: int
    prefill_ms: float
    inserted_tokens: int
    path: tuple[int, ...]


class RequestHandle:
    """A submitted request: iterate it for events; ``cancel()`` stops it at the next token."""

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self.events: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()
        self.submitted_at = time.perf_counter()

    def cancel(self) -> None:
        self.cancelled.set()

    def __iter__(self) -> Iterator[GenerationEvent]:
        try:
            while True:
                item = self.events.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.cancel()  # a consumer that stops listening stops the work


class Engine:
    def __init__(self, runner: ModelRunner, budget_bytes: int | None = None, enable_cache: bool = True,
                 isolation: bool = False, max_queue: int = 32, max_prompt_tokens: int | None = None,
                 max_new_tokens_cap: int = 512, history_size: int = 1000) -> None:
        self.runner = runner
        budget = default_budget_bytes(runner.device) if budget_bytes is None else int(budget_bytes)
        if enable_cache:
            pool = KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype,
                          runner.device, budget)
            self.cache: PrefixCache = RadixCache(pool, fair_share=isolation)
        else:
            self.cache = NoPrefixCache(runner.kv_bytes_per_token, budget)
        self.isolation = isolation
        self.max_prompt_tokens = min(max_prompt_tokens or runner.max_context, runner.max_context)
        self.max_new_tokens_cap = max_new_tokens_cap
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._stats_lock = threading.Lock()
        self._next_id = 1
        self.history: deque[RequestMetrics] = deque(maxlen=history_size)
        self._totals = dict(requests=0, prompt_tokens=0, cached_tokens=0, computed_tokens=0, prefill_ms=0.0,
                            baseline_prefill_ms=0.0, reuse_prefill_ms_measured=0.0)
        self._worker = threading.Thread(target=self._work, name="engine-worker", daemon=True)
        self._worker.start()

    # ---------------------------------------------------------------- public
    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; raises EngineError for bad input and EngineBusy when full.

        Validation happens here, before anything touches the cache.
        """
        ids = self.prompt_ids(request)
        request = dataclasses.replace(request, sampling=validation.check_sampling(request.sampling))
        handle = RequestHandle(request)
        handle.ids = ids
        try:
            self._queue.put_nowait(handle)
        except queue.Full:
            raise EngineBusy("The engine is busy: too many requests are waiting. Please try again in a "
                             "moment.") from None
        return handle

    def generate(self, request: GenerationRequest) -> Iterator[GenerationEvent]:
        yield from self.submit(request)

    def run(self, request: GenerationRequest) -> RequestMetrics:
        """Run a request to the end; return its metrics."""
        last = None
        for event in self.generate(request):
            last = event
        assert last is not None and last.metrics is not None
        return last.metrics

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        given = [request.messages is not None, request.prompt is not None, request.prompt_ids is not None]
        if sum(given) != 1:
            raise EngineError("give exactly one of messages, prompt or prompt_ids")
        runner = self.runner
        if request.messages is not None:
            messages = validation.check_messages(request.messages)
            validation.check_text_tokens([m["content"] for m in messages], self.max_prompt_tokens,
                                         runner.max_token_chars, runner.encode)
            try:
                ids = runner.encode_chat(messages)
            except Exception as exc:  # a chat template may refuse a role order (jinja raises)
                raise EngineError(f"This model's chat template refused the messages: {exc}"[:300]) from None
        elif request.prompt is not None:
            if not isinstance(request.prompt, str):
                raise EngineError("The prompt must be text.")
            if not request.prompt.strip():
                raise EngineError(validation.EMPTY_PROMPT)
            validation.check_text_tokens([request.prompt], self.max_prompt_tokens, runner.max_token_chars,
                                         runner.encode)
            ids = runner.encode(request.prompt)
        else:
            ids = validation.check_prompt_ids(request.prompt_ids, runner.vocab_size)
        if not ids:
            raise EngineError("The prompt is empty: type something first.")
        if len(ids) > self.max_prompt_tokens:
            raise EngineError(f"The prompt is {len(ids):,} tokens long; the limit is "
                              f"{self.max_prompt_tokens:,} tokens. Shorten it and try again.")
        return ids

    # ------------------------------------------------- text, for the UI and the lab
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as is (no chat template, no BOS)."""
        return self.runner.encode(text)

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages``, as text."""
        return self.runner.render_chat(messages, add_generation_prompt=add_generation_prompt)

    def decode(self, ids: Sequence[int]) -> str:
        return self.runner.decode(ids)

    def token_pieces(self, ids: Sequence[int]) -> list[str]:
        """One display string per token; their concatenation is ``decode(ids)``."""
        return self.runner.token_pieces(ids)

    @property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(getattr(self.runner.tokenizer, "all_special_ids", []) or [])

    def snapshot(self, viewer: str | None = None) -> TreeSnapshot:
        """The tree as plain data; in isolation mode ``viewer`` (a namespace) sees
        other namespaces' nodes as shape and size only."""
        return self.cache.snapshot(self.runner.decode, viewer=viewer if self.isolation else None)

    def stats(self, viewer: str | None = None) -> EngineStats:
        """Running totals and the cache's state. In isolation mode, with ``viewer`` (a
        namespace), only what that visitor may see: totals over their own requests, and
        the cache's figures as their ``snapshot`` gives them (others' tokens coarse)."""
        if viewer is not None and self.isolation:
            return self._stats_for(viewer)
        with self._stats_lock:
            t = dict(self._totals)
        return EngineStats(**t, cache_bytes=self.cache.bytes_in_use, budget_bytes=self.cache.budget_bytes,
                           cached_tokens_now=self.cache.num_tokens, num_nodes=self.cache.num_nodes,
                           evicted_tokens=self.cache.evicted_tokens, queue_depth=self._queue.qsize(),
                           locked_tokens=self.cache.locked_tokens())

    def _stats_for(self, viewer: str) -> EngineStats:
        mine = [m for m in self.recent() if m.namespace == viewer or m.namespace.startswith(viewer + "/")]
        measured = [m for m in mine if m.baseline_prefill_ms is not None]
        snap = self.cache.snapshot(None, viewer=viewer)
        return EngineStats(
            requests=len(mine), prompt_tokens=sum(m.prompt_tokens for m in mine),
            cached_tokens=sum(m.cached_tokens for m in mine), computed_tokens=sum(m.computed_tokens for m in mine),
            prefill_ms=sum(m.prefill_ms for m in mine), baseline_prefill_ms=sum(m.baseline_prefill_ms for m in measured),
            reuse_prefill_ms_measured=sum(m.prefill_ms for m in measured), cache_bytes=snap.num_bytes,
            budget_bytes=snap.budget_bytes, cached_tokens_now=snap.num_tokens, num_nodes=len(snap.nodes),
            evicted_tokens=snap.evicted_tokens, queue_depth=self._queue.qsize(),
            locked_tokens=sum(n.num_tokens for n in snap.nodes if n.lock_ref > 0))

    def recent(self, n: int | None = None, namespace: str | None = None) -> list[RequestMetrics]:
        with self._stats_lock:
            items = list(self.history)
        if namespace is not None:
            items = [m for m in items if m.namespace in (namespace,)]
        return items[-n:] if n else items

    def info(self) -> EngineInfo:
        r = self.runner
        return EngineInfo(model_name=r.name, device=str(r.device), dtype=str(r.dtype).replace("torch.", ""),
                          num_layers=r.num_layers, num_kv_heads=r.num_kv_heads, head_dim=r.head_dim,
                          kv_bytes_per_token=r.kv_bytes_per_token, max_context=r.max_context,
                          cache_enabled=self.cache.enabled, isolation=self.isolation)

    def clear_cache(self, namespace: str | None = None) -> int:
        """Evict every unlocked node (of one namespace only, if given); returns tokens freed."""
        return self.cache.clear(namespace)

    def set_budget(self, budget_bytes: int) -> int:
        return self.cache.set_budget(budget_bytes)

    def check_invariants(self) -> None:
        self.cache.check_invariants()

    def cache_key(self, ids: Sequence[int], request: GenerationRequest) -> CacheKey:
        """The request's namespace is set by server code (the UI passes ``PUBLIC``
        unless isolation is on; the ordering lab uses one namespace per variant)."""
        return CacheKey(tuple(ids), request.namespace, max(0, min(request.public_len, len(ids))))

    # ---------------------------------------------------------------- worker
    def _work(self) -> None:
        while True:
            handle = self._queue.get()
            try:
                if handle.cancelled.is_set():
                    continue
                with self.runner.lock:  # engines sharing one runner take turns on the model
                    for event in self._run(handle):
                        handle.events.put(event)
            except EngineError as exc:
                handle.events.put(exc)
            except Exception as exc:  # never kill the worker; report one line
                log.exception("request failed")
                handle.events.put(EngineError(f"The request failed: {type(exc).__name__}: {exc}"[:300]))
            finally:
                handle.events.put(_DONE)

    def _run(self, handle: RequestHandle) -> Iterator[GenerationEvent]:
        req, ids, runner = handle.request, handle.ids, self.runner
        start = time.perf_counter()
        queue_ms = (start - handle.submitted_at) * 1000
        params = req.sampling
        max_new = max(0, min(int(params.max_new_tokens), self.max_new_tokens_cap,
                             runner.max_context - len(ids)))
        key = self.cache_key(ids, req)
        kv = runner.new_request_kv(len(ids) + max_new)
        pre = self.prefill(key, kv)
        logits, cached, prefill_ms, inserted = pre.logits, pre.cached_tokens, pre.prefill_ms, pre.inserted_tokens

        generator = None
        if params.temperature > 0:
            generator = torch.Generator().manual_seed(params.seed if params.seed is not None
                                                     else int(time.time_ns() % 2**31))
        out_ids: list[int] = []
        finish = "length"
        ttft_ms = None
        t_decode = time.perf_counter()
        text = ""
        for step in range(max_new):
            if handle.cancelled.is_set():
                finish = "cancelled"
                break
            if step > 0:
                logits = runner.forward_last([out_ids[-1]], kv)
            tok = sampling.sample(logits, params, generator, out_ids)
            if ttft_ms is None:
                ttft_ms = (time.perf_counter() - start) * 1000
                t_decode = time.perf_counter()
            if tok in runner.eos_ids:
                finish = "stop"
                break
            out_ids.append(tok)
            text = runner.decode(out_ids)
            yield GenerationEvent(text=text.rstrip("\ufffd"), token_id=tok)
        decode_s = time.perf_counter() - t_decode
        if ttft_ms is None:
            ttft_ms = (time.perf_counter() - start) * 1000
        # Prompt plus reply, so the next chat turn reuses the answer too.
        if kv.length > len(ids):
            inserted += self.cache.insert(self.cache_key(list(ids) + out_ids[: kv.length - len(ids)], req), kv)

        baseline_ms = None
        if req.measure_baseline and not handle.cancelled.is_set():
            _, baseline_ms = runner.baseline_prefill(ids)
        metrics = self._record(req, key, ids, out_ids, text, cached, prefill_ms, baseline_ms, ttft_ms, queue_ms,
                               (len(out_ids) - 1) / decode_s if len(out_ids) > 1 and decode_s > 0 else None,
                               finish, inserted, pre.path)
        yield GenerationEvent(text=text, done=True, metrics=metrics)

    def prefill(self, key: CacheKey, kv) -> PrefillResult:
        """Prefill ``key.ids`` into the empty buffer ``kv``, reusing the longest cached
        prefix, then cache the prompt. ``prefill_ms`` covers match, copy and forward."""
        runner = self.runner
        runner.synchronize()
        t0 = time.perf_counter()
        # At least one prompt token is always computed: its logits start the answer.
        handle = self.cache.acquire(key, len(key.ids) - 1, kv)
        try:
            logits = runner.forward_last(key.ids[handle.cached_tokens:], kv)
            runner.synchronize()
            prefill_ms = (time.perf_counter() - t0) * 1000
            inserted = self.cache.insert(key, kv)
        finally:
            self.cache.release(handle)
        return PrefillResult(logits, handle.cached_tokens, prefill_ms, inserted, handle.path)

    def _record(self, req, key, ids, out_ids, text, cached, prefill_ms, baseline_ms, ttft_ms, queue_ms,
                decode_tps, finish, inserted, path) -> RequestMetrics:
        with self._stats_lock:
            rid = self._next_id
            self._next_id += 1
            t = self._totals
            t["requests"] += 1
            t["prompt_tokens"] += len(ids)
            t["cached_tokens"] += cached
            t["computed_tokens"] += len(ids) - cached
            t["prefill_ms"] += prefill_ms
            if baseline_ms is not None:
                t["baseline_prefill_ms"] += baseline_ms
                t["reuse_prefill_ms_measured"] += prefill_ms
            m = RequestMetrics(
                request_id=rid, tag=req.tag, namespace=key.namespace, prompt_tokens=len(ids),
                cached_tokens=cached, computed_tokens=len(ids) - cached, prefill_ms=prefill_ms,
                baseline_prefill_ms=baseline_ms, ttft_ms=ttft_ms, queue_ms=queue_ms,
                decode_tokens_per_s=decode_tps, output_tokens=len(out_ids), finish_reason=finish,
                cache_bytes=self.cache.bytes_in_use, cache_budget_bytes=self.cache.budget_bytes,
                evicted_tokens=self.cache.evicted_tokens, inserted_tokens=inserted, matched_path=list(path),
                prompt_ids=list(ids), output_ids=list(out_ids), output_text=text, finished_at=time.time())
            self.history.append(m)
            return m
