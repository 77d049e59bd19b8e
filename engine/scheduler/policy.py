"""Who goes first: the order of the waiting list, and who may not run yet.

Owns: the waiting order (longest cached prefix first, SGLang's LPM; first come, first
served when the list is longer than ``lpm_queue_limit``; anyone waiting over
``max_wait_s`` first, in arrival order, the ageing guard; round-robin across visitors,
fewest running first) and the isolation rule, which is work-conserving: on a public
deployment the visitor (owner: an address or an API client) with the fewest running
requests goes first, and one visitor may take more rows while nobody else waits for them,
up to ``owner_row_cap`` (all rows but a reserve, so that a visitor who arrives meanwhile is
admitted at once). A classroom behind one address runs its tabs in the same batches on an
idle server, and a second address still gets its turn ahead of them. Knows the cache only through
``match_len``; it admits nobody (``admission``) and runs nothing.
"""

from __future__ import annotations

import time

from engine.kvcache.prefix_cache import PrefixCache
from engine.namespaces import owner_of
from engine.scheduler.batch import running_per_owner
from engine.scheduler.config import SchedulerConfig
from engine.scheduler.request import Request


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
    active = running_per_owner(running)

    def order(r: Request) -> tuple:
        if now - r.handle.submitted_at > config.max_wait_s:
            return (0, 0, 0, r.seq)
        return (1, active.get(owner_of(r.namespace), 0), 0 if fcfs else -r.memo.match_len, r.seq)

    return sorted(waiting, key=order)


def owner_row_cap(config: SchedulerConfig) -> int:
    """Rows one visitor may hold on a public deployment: every row but a quarter of them (at
    least one), kept for a visitor who arrives meanwhile; at least one row."""
    return max(1, config.max_batch - max(1, config.max_batch // 4))


def held_back(r: Request, active: dict[str, int], config: SchedulerConfig) -> bool:
    """With isolation on, a visitor already holding ``owner_row_cap`` rows waits for one of them.
    Below the cap it is not held back: ``ordered_waiting`` puts visitors with fewer running
    requests ahead of it, so it only takes rows that nobody with less is waiting for."""
    return config.isolation and active.get(owner_of(r.namespace), 0) >= owner_row_cap(config)
