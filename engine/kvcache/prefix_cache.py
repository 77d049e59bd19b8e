"""What the engine asks of a prefix cache, and the two caches that answer it.

Owns: the cache contracts, nothing else. They are narrow and composed, so each caller names
only what it uses:

- ``PrefixCache``: what the scheduler calls (admit, adopt, release, match; 8 members);
- ``CacheFigures``: what the engine's stats and the UI read (counts, bytes, ``snapshot``);
- ``CacheControls`` (clear, budget, invariants) and ``ScratchCopies`` (KV copied to and from
  scratch buffers, for the timed prefill and tools);
- ``TieredCache``: the second tier (load, offload, persist, its counters);
- ``EventSource``: ``publish_to``, KV events for a listener;
- ``FullPrefixCache``: all of them, what both caches implement and the engine holds.

Every pool slot has one owner: it is free, or held by the tree (cached KV, any request may
reuse it), or held by one running request (the KV it computes). Running requests read the
tree's slots for their cached prefix in place, never a copy; at the end their own slots pass
to the tree, no copy either. So the pool's byte count is all the KV the process holds, and
the budget is a physical bound.

Two implementations share all of it, so comparing with and without reuse is one
constructor argument:

- ``RadixCache`` (``engine.kvcache.radix_cache``): any prefix of anything cached before is
  reused; with a ``SecondTier`` (``engine.kvcache.second_tier``) evicted KV goes to disk or
  host memory and comes back on a later match.
- ``NoPrefixCache`` (``engine.kvcache.no_prefix_cache``): nothing is ever reused or stored
  (requests still hold their own KV in the pool).

Contract: slots of a ``RequestSlots`` (``engine.kvcache.request_slots``) are valid until
``release``; the tree's part cannot be evicted meanwhile. A budget change renumbers slots
and updates every live ``RequestSlots`` in place, so only the cache keeps slot numbers
across steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from engine.kvcache.kv_pool import KVPool
from engine.kvcache.no_prefix_cache import NoPrefixCache
from engine.kvcache.radix_cache import RadixCache
from engine.kvcache.request_kv import RequestKV
from engine.kvcache.request_slots import RequestSlots
from engine.types import CacheKey, TreeSnapshot

__all__ = ["CacheControls", "CacheFigures", "EventSource", "FullPrefixCache", "NoPrefixCache", "PrefixCache",
           "RadixCache", "RequestSlots", "ScratchCopies", "TieredCache"]


@runtime_checkable
class PrefixCache(Protocol):
    """What the scheduler asks of a prefix cache (``engine.scheduler``), and nothing else.
    ``RadixCache`` and ``NoPrefixCache`` implement it (and the rest, ``FullPrefixCache``).

    Every method is thread-safe. Token counts are in tokens of ``key.ids``.
    """

    enabled: bool
    pool: KVPool

    def acquire(self, key: CacheKey, max_len: int, total_tokens: int) -> RequestSlots | None:
        """Admit a request of ``total_tokens`` positions (prompt plus new tokens): reuse the
        longest cached prefix of ``key.ids[:max_len]`` (locked until ``release``) and take
        slots of its own for the rest, evicting unlocked entries for room (by fair share for
        ``key.namespace`` in isolation mode: a visitor never evicts shipped content, nor a
        visitor within their share). None, with nothing changed (no hit counted, no access
        time, no split, nothing evicted), when there is no room."""

    def adopt(self, rs: RequestSlots, key: CacheKey) -> int:
        """Cache the first ``min(len(key.ids), rs.length)`` positions of ``rs`` under ``key``:
        its own slots pass to the tree (no copy), positions someone else cached meanwhile
        switch to the tree's slots (its duplicates are freed), and the lock moves to the
        node ending there. Returns tokens newly stored."""

    def release(self, rs: RequestSlots) -> None:
        """Free ``rs``'s own slots and unlock its cached part. Exactly once per ``acquire``."""

    def match_len(self, key: CacheKey) -> int:
        """Cached length of ``key.ids`` now. Does not modify the tree or access times."""

    @property
    def budget_bytes(self) -> int: ...

    @property
    def bytes_per_token(self) -> int: ...


@runtime_checkable
class ScratchCopies(Protocol):
    """KV copied between the tree and scratch buffers (``RequestKV``), outside any request's slots."""

    def insert(self, key: CacheKey, kv: RequestKV) -> int:
        """Store the first ``min(len(key.ids), kv.length)`` tokens of a scratch buffer under
        ``key`` (copied into free slots), evicting unlocked least-recently-used entries for
        room; stores the longest prefix that fits. Returns tokens newly stored."""

    def copy_prefix(self, key: CacheKey, max_len: int, kv: RequestKV, touch: bool = False) -> int:
        """Copy the KV of the longest cached prefix of ``key.ids[:max_len]`` into the empty
        scratch buffer ``kv`` (for timings and tools). With ``touch`` the match counts as a
        hit (access time, hits); nothing is locked. Returns the copied length."""


@runtime_checkable
class CacheControls(Protocol):
    """What a person (through the engine) or a test may do to the whole cache."""

    def clear(self, namespace: str | None = None) -> int:
        """Evict every unlocked entry (only ``namespace``'s, if given); returns tokens freed."""

    def set_budget(self, budget_bytes: int) -> int:
        """Resize to ``budget_bytes``, evicting as needed; returns tokens evicted. Raises
        ``EngineError`` when running requests and locked entries alone exceed it."""

    def check_invariants(self) -> None:
        """Assert the cache is consistent (tests call it after every operation)."""


@runtime_checkable
class CacheFigures(Protocol):
    """What the engine's stats and the UI read. Reads only: nothing here changes the cache."""

    version: int  # changes whenever anything ``snapshot`` or the counters show could have

    @property
    def bytes_in_use(self) -> int:
        """Pool bytes held: by the tree and by running requests."""

    @property
    def tree_bytes(self) -> int: ...

    @property
    def running_tokens(self) -> int:
        """Slots held by running requests themselves (not the tree's)."""

    @property
    def shared_tokens(self) -> int:
        """Cached tokens read by more than one running request right now."""

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_nodes(self) -> int: ...

    @property
    def evicted_tokens(self) -> int:
        """Tokens evicted since start (a running total)."""

    def locked_tokens(self) -> int:
        """Cached tokens pinned by running requests right now."""

    def snapshot(self, decode: Callable[[Sequence[int]], str] | None = None, viewer: str | None = None,
                 max_text_tokens: int = 256) -> TreeSnapshot:
        """A read-only copy as plain data; with ``viewer`` set, other namespaces' nodes
        are hidden (shape and size only). Nodes whose KV is in the second tier, not in the
        pool, are there too, marked ``spilled`` (never counted in the pool's tokens)."""


@runtime_checkable
class TieredCache(Protocol):
    """The second tier's operations and counters (each a no-op or 0 without a tier)."""

    def load_prefix(self, key: CacheKey, max_len: int) -> int:
        """Bring what the second tier holds of ``key.ids[:max_len]`` (after the part in memory)
        back into the pool and the tree, holding the match while making room; tokens loaded
        (0 without a tier, without room, or when nothing is there)."""

    def offload(self) -> int:
        """Evict every unlocked entry to the second tier (benchmarks and tests); tokens evicted."""

    def persist(self) -> int:
        """Write what the tree holds to the second tier, with the paths (for a restart); chunks written."""

    @property
    def tier_loaded_tokens(self) -> int:
        """Tokens loaded back from the second tier since start."""

    @property
    def tier_spilled_tokens(self) -> int:
        """Tokens written to the second tier since start."""

    def tier_stats(self) -> dict:
        """The second tier's figures for ``EngineStats`` (empty without one)."""


@runtime_checkable
class EventSource(Protocol):
    """KV events (``engine.kvcache.kv_events``): what the tree caches and evicts, for a listener."""

    def publish_to(self, listener) -> None:
        """Report what the tree caches and evicts to ``listener``; a no-op without reuse."""


@runtime_checkable
class FullPrefixCache(PrefixCache, ScratchCopies, CacheControls, CacheFigures, TieredCache, EventSource, Protocol):
    """Everything a cache implements: ``RadixCache`` and ``NoPrefixCache`` both do, and the
    engine holds one as this; each caller takes only the part it uses."""
