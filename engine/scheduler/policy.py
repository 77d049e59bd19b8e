"""Who goes first: the order of the waiting list, and who may not run yet.

Owns: the waiting order (longest cached prefix first, SGLang's LPM; first come, first
served when the list is longer than ``lpm_queue_limit``; anyone waiting over
``max_wait_s`` first, in arrival order, the ageing guard; round-robin across visitors,
fewest running first) and the isolation rule (on a public deployment at most one
running request per visitor; more wait behind it). Knows the cache only through
``match_len``; it admits nobody (``admission``) and runs nothing.
"""

from __future__ import annotations

import time

from engine.kvcache.prefix_cache import PrefixCache
from engine.namespaces import owner_of
from engine.scheduler.config import SchedulerConfig
from engine.scheduler.request import Request


def running_per_visitor(running: list[Request]) -> dict[str, int]:
    active: dict[str, int] = {}
    for r in running:
        v = owner_of(r.namespace)
        active[v] = active.get(v, 0) + 1
    return active


def ordered_waiting(waiting: list[Request], running: list[Request], cache: PrefixCache,
                    config: SchedulerConfig) -> list[Request]:
    """``waiting`` in the order admission tries it (cached-prefix lengths refreshed at most
    every ``match_refresh_s``, and not at all when the list is served FCFS)."""
    now = time.perf_counter()
    fcfs = len(waiting) > config.lpm_queue_limit
    if not fcfs:
        for r in waiting:
            if now - r.memo.match_checked_at > config.match_refresh_s:
                r.memo.matched(cache.match_len(r.key), now)
    active = running_per_visitor(running)

    def order(r: Request) -> tuple:
        if now - r.handle.submitted_at > config.max_wait_s:
            return (0, 0, 0, r.seq)
        return (1, active.get(owner_of(r.namespace), 0), 0 if fcfs else -r.memo.match_len, r.seq)

    return sorted(waiting, key=order)


def held_back(r: Request, active: dict[str, int], config: SchedulerConfig) -> bool:
    """With isolation on, a visitor with a running request waits for it to finish."""
    return config.isolation and active.get(owner_of(r.namespace), 0) > 0
