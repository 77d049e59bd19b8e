"""A finished request's figures: ``request_metrics``, its ``RequestMetrics`` (the record the page,
``/v1``'s usage and the analysis read) from the scheduler's ``Request`` and the cache's totals at
its end. Pure: reads, changes nothing; the engine calls it under its stats lock and keeps the
record. Knows nothing of streams, the inbox or the UI.
"""

from __future__ import annotations

import time

from engine.kvcache.prefix_cache import FullPrefixCache
from engine.scheduler.request import Request
from engine.types import RequestMetrics


def request_metrics(r: Request, cache: FullPrefixCache) -> RequestMetrics:
    """``r``'s figures, times counted from its arrival (as vLLM counts them, so queueing shows)."""
    req, ids, out_ids, t, kv = r.req, r.ids, r.answer.out_ids, r.timings, r.kv
    now = time.perf_counter()
    arrived = r.handle.submitted_at
    admitted = t.admitted_at if t.admitted_at is not None else now
    queue_ms = (admitted - arrived) * 1000
    # From arrival, as vLLM counts it, so queueing shows; None for a request cancelled
    # before its first token (it never had one).
    ttft_ms = (t.first_token_at - arrived) * 1000 if t.first_token_at is not None else None
    decode_tps = None
    if len(out_ids) > 1 and t.first_token_at is not None and t.last_token_at is not None:
        span = t.last_token_at - t.first_token_at
        decode_tps = (len(out_ids) - 1) / span if span > 0 else None
    cached = kv.cached_tokens
    sizes = t.batch_sizes or [1]
    return RequestMetrics(
        request_id=r.request_id, tag=req.tag, namespace=r.key.namespace, prompt_tokens=len(ids),
        cached_tokens=cached, computed_tokens=len(ids) - cached, prefill_ms=t.prefill_ms,
        baseline_prefill_ms=None, ttft_ms=ttft_ms, queue_ms=queue_ms,
        decode_tokens_per_s=decode_tps, output_tokens=len(out_ids), finish_reason=r.finish_reason,
        cache_bytes=cache.bytes_in_use, cache_budget_bytes=cache.budget_bytes,
        evicted_tokens=cache.evicted_tokens, inserted_tokens=kv.inserted_tokens,
        matched_path=list(kv.path), prompt_ids=list(ids), output_ids=list(out_ids),
        output_text=r.answer.text, finished_at=time.time(), batch_size_max=max(sizes),
        batch_size_mean=sum(sizes) / len(sizes), prefill_chunks=max(1, t.prefill_chunks),
        prefill_shared_step=t.prefill_shared_step, tier_tokens=kv.tier_tokens, tier_load_ms=kv.tier_load_ms,
        output_logprobs=None if req.logprobs is None else list(r.answer.logprobs))
