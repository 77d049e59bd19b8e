"""The no-reuse baseline: the same prompt prefilled from scratch, as timing work of its own.

Owns: whether a finished request measures it (asked for, not cancelled, and with
isolation on not above ``baseline_max_tokens_isolated`` prompt tokens: on a public
deployment a long from-scratch prefill is costly work that only shows a figure, and the
metrics then say None), its pool slots (taken after the answer; without room it is
skipped) and its bounded share of each step: what the step's prefills left of the token
budget, and at least ``baseline_min_tokens``, so that under steady prefill load baselines
still finish. Never inside anyone's prefill, so both figures are clean. Knows nothing
about sampling or the metrics it feeds.
"""

from __future__ import annotations

from collections.abc import Iterator

from engine.kvcache.prefix_cache import PrefixCache
from engine.scheduler.batch import Batch, Chunk
from engine.scheduler.config import SchedulerConfig
from engine.scheduler.request import Request, State
from engine.types import CacheKey, GenerationEvent


def wanted(r: Request, config: SchedulerConfig) -> bool:
    if not r.req.measure_baseline or r.finish_reason == "cancelled":
        return False
    return not (config.isolation and len(r.ids) > config.baseline_max_tokens_isolated)


def start(r: Request, cache: PrefixCache) -> bool:
    """Take slots for the from-scratch prefill (its slots of its own, no cached prefix) and
    enter ``State.BASELINE``; False (skipped) when the pool has no room for it."""
    # Charged to the visitor who asked: in isolation mode, room comes from their own share
    # (fair eviction), never from shipped content or another visitor within theirs.
    rs = cache.acquire(CacheKey((), r.namespace), 0, len(r.ids))
    if rs is None:
        return False
    r.start_baseline(rs)
    r.emit(GenerationEvent(text=r.answer.text, phase="baseline", prompt_tokens=len(r.ids),
                           cached_tokens=r.kv.cached_tokens, prefilled_tokens=len(r.ids)))
    return True


def batches(running: list[Request], budget: int, config: SchedulerConfig) -> Iterator[Batch]:
    """One forward per request in baseline, within the step's share. Lazy: the running set
    is read when the first is asked for, so a request whose answer ended earlier in this
    step starts its baseline in this step too."""
    budget = max(budget, config.baseline_min_tokens)  # a bounded share even under prefill load
    for r in [r for r in running if r.state is State.BASELINE]:
        if budget <= 0:
            return
        assert r.kv.baseline_slots is not None
        start_at = r.kv.baseline_slots.length
        n = min(len(r.ids) - start_at, budget)
        budget -= n
        yield Batch("baseline", (Chunk(r, start_at, n),))
