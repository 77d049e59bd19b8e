"""Letting waiting requests in, while batch rows and memory allow.

Owns: the admission loop (rows free under ``max_batch``, the policy's order, the
isolation rule), in-batch prefix sharing (a request whose uncached prefix another
request is prefilling right now waits until that prompt is cached, then hits), and
acquiring through the ``PrefixCache``: match the tree, lock the match (read in place,
never copied) and take pool slots for the rest (uncached prompt plus new tokens),
evicting unlocked cache for room; a request that asked for its prompt's log-probabilities
reuses nothing (``reusable_len``). Without room the request waits until a running one
gives slots back; one that could never fit fails with a clear error. Knows nothing about
forwards, sampling or finishing: a request it cannot admit is handed back to fail.
"""

from __future__ import annotations

import time

from engine.kvcache.prefix_cache import PrefixCache
from engine.kvcache.radix_tree import common_prefix_len
from engine.scheduler import policy
from engine.scheduler.batch import running_per_owner
from engine.scheduler.request import Request, State
from engine.scheduler.state import SchedulerState
from engine.types import EngineError

Failed = list[tuple[Request, BaseException]]  # left the waiting list; the scheduler fails them


def admit(state: SchedulerState, cache: PrefixCache) -> Failed:
    """Admit waiting requests into ``state.running``; returns those that must fail."""
    failed: Failed = []
    if state.memory_short and state.running:
        return failed  # nothing was given back since admission last ran out of room
    state.memory_short = False
    admitted_any = True
    while admitted_any and state.waiting and state.rows_used() < state.config.max_batch:
        admitted_any = False
        active = running_per_owner(state.running)
        for r in policy.ordered_waiting(state.waiting, state.running, cache, state.config):
            if policy.held_back(r, active, state.config):
                continue  # one request per visitor at a time on a public deployment
            if _prefix_being_computed(r, state, cache):
                continue  # wait for the other request's prompt to be cached, then hit it
            result = _try_admit(r, state, cache, failed)
            if result is None:
                state.memory_short = True
                return failed  # out of memory until something finishes: keep the order, admit nobody else
            if result:
                admitted_any = True
                break  # re-order: fairness counts changed
    return failed


def _prefix_being_computed(r: Request, state: SchedulerState, cache: PrefixCache) -> bool:
    """Would ``r`` compute tokens that a running prefill is computing now (and will cache)?"""
    if not cache.enabled or r.req.prompt_logprobs is not None:
        return False
    cached = cache.match_len(r.key)
    r.memo.matched(cached, time.perf_counter())
    for p in state.running:
        if p.state is not State.PREFILL:
            continue
        shared = common_prefix_len(r.ids, p.ids)
        if p.namespace != r.namespace:
            shared = min(shared, r.key.public_len, p.key.public_len)
        shared = min(shared, len(r.ids) - 1)  # the last prompt token is always computed
        if shared - cached >= state.config.share_min_tokens:
            return True
    return False


def _try_admit(r: Request, state: SchedulerState, cache: PrefixCache, failed: Failed) -> bool | None:
    """Admit ``r``: True; None when memory is short (it keeps waiting); False when it
    failed (it left the waiting list for ``failed``)."""
    t0 = time.perf_counter()
    try:
        rs = cache.acquire(r.key, reusable_len(r), r.capacity_tokens)
    except Exception as exc:  # only this request fails (out of memory, a bug): the others go on
        state.waiting.remove(r)
        failed.append((r, exc))
        return False
    if rs is None:
        if state.running:
            return None
        state.waiting.remove(r)  # nothing runs, so nothing will give room back: it cannot run now
        failed.append((r, _no_room(r, cache, state.config.isolation)))
        return False
    state.waiting.remove(r)
    r.admit(rs, t0, time.perf_counter())  # prefill_ms starts with the match and slot bookkeeping
    state.running.append(r)
    return True


def reusable_len(r: Request) -> int:
    """How much of ``r``'s prompt may come from the cache: all but the last token (whose logits
    pick the first new one), or nothing where it asked for the prompt's log-probabilities (every
    position's logits are then computed by this request itself)."""
    return 0 if r.req.prompt_logprobs is not None else len(r.ids) - 1


def _no_room(r: Request, cache: PrefixCache, isolation: bool) -> EngineError:
    need = r.capacity_tokens * cache.bytes_per_token / 2**20
    where = (f"the cache budget is {cache.budget_bytes / 2**20:,.1f} MiB" if not isolation else
             "on this shared deployment the rest of the cache is shipped content and other visitors' share")
    return EngineError(f"This request needs {need:,.1f} MiB of KV (prompt plus new tokens) and {where}: "
                       "shorten the prompt or ask for fewer new tokens.")
