"""The prefix cache: the radix tree and the KV pool kept in step, behind one lock.

Owns: the consistency of tree and pool (every tree token holds exactly one
pool slot), eviction to make room, budget changes and snapshots. Two
implementations share one interface, so comparing with and without reuse is
one constructor argument:

- ``RadixCache``: any prefix of anything cached before is reused.
- ``NoPrefixCache``: nothing is ever reused or stored.

Contract of ``acquire``: the matched prefix's KV is copied into the request's
buffer and its nodes are locked (never evicted) until ``release``. Slot
numbers never leave this module, so a budget change can move them freely.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.kv_pool import KVPool
from engine.radix_tree import PUBLIC, CacheKey, Node, RadixTree
from engine.request_kv import RequestKV
from engine.types import EngineError, NodeInfo, TreeSnapshot


@dataclass(frozen=True)
class CacheHandle:
    """What ``acquire`` hands back: the reused length and the locked node."""

    cached_tokens: int
    path: tuple[int, ...]
    node: Node | None


def _visible_to(namespace: str, viewer: str) -> bool:
    """Public content, the viewer's own namespace and its sub-namespaces (``<viewer>/...``)."""
    return namespace in (PUBLIC, viewer) or namespace.startswith(viewer + "/")


class PrefixCache(Protocol):
    """What the engine asks of a prefix cache. ``RadixCache`` and ``NoPrefixCache``
    implement it; the engine and the UI (through the engine) see nothing else.

    Every method is thread-safe. Token counts are in tokens of ``key.ids``.
    """

    enabled: bool
    bytes_per_token: int

    def acquire(self, key: CacheKey, max_len: int, kv: RequestKV) -> CacheHandle:
        """Find the longest cached prefix of ``key.ids[:max_len]``, copy its KV into the
        empty buffer ``kv`` and lock it: it cannot be evicted until ``release(handle)``.
        Returns the reused length (0 on a miss; then nothing is locked)."""

    def release(self, handle: CacheHandle) -> None:
        """Unlock what ``acquire`` locked. Call exactly once per handle."""

    def insert(self, key: CacheKey, kv: RequestKV) -> int:
        """Store the first ``min(len(key.ids), kv.length)`` tokens of ``kv`` under ``key``,
        evicting unlocked least-recently-used entries for room; stores the longest prefix
        that fits and never exceeds the budget. Returns tokens newly stored."""

    def match_len(self, key: CacheKey) -> int:
        """Cached length of ``key.ids`` now. Does not modify the tree or access times."""

    def clear(self, namespace: str | None = None) -> int:
        """Evict every unlocked entry (only ``namespace``'s, if given); returns tokens freed."""

    def set_budget(self, budget_bytes: int) -> int:
        """Resize to ``budget_bytes``, evicting as needed; returns tokens evicted. Raises
        ``EngineError`` when locked entries alone exceed the new budget."""

    @property
    def budget_bytes(self) -> int: ...

    @property
    def bytes_in_use(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_nodes(self) -> int: ...

    @property
    def evicted_tokens(self) -> int:
        """Tokens evicted since start (a running total)."""

    def locked_tokens(self) -> int:
        """Cached tokens pinned by running requests right now."""

    def check_invariants(self) -> None:
        """Assert the cache is consistent (tests call it after every operation)."""

    def snapshot(self, decode: Callable[[Sequence[int]], str] | None = None, viewer: str | None = None,
                 max_text_tokens: int = 256) -> TreeSnapshot:
        """A read-only copy as plain data; with ``viewer`` set, other namespaces' nodes
        are hidden (shape and size only)."""


class NoPrefixCache:
    """The cache-off twin: same interface, nothing reused, nothing stored."""

    enabled = False

    def __init__(self, bytes_per_token: int, budget_bytes: int = 0) -> None:
        self.bytes_per_token = bytes_per_token
        self.budget_bytes = budget_bytes
        self.evicted_tokens = 0

    def acquire(self, key: CacheKey, max_len: int, kv: RequestKV) -> CacheHandle:
        return CacheHandle(0, (), None)

    def match_len(self, key: CacheKey) -> int:
        return 0

    def insert(self, key: CacheKey, kv: RequestKV) -> int:
        return 0

    def release(self, handle: CacheHandle) -> None:
        pass

    def clear(self, namespace: str | None = None) -> int:
        return 0

    def set_budget(self, budget_bytes: int) -> int:
        self.budget_bytes = int(budget_bytes)
        return 0

    @property
    def bytes_in_use(self) -> int:
        return 0

    @property
    def num_tokens(self) -> int:
        return 0

    @property
    def num_nodes(self) -> int:
        return 0

    def check_invariants(self) -> None:
        pass

    def locked_tokens(self) -> int:
        return 0

    def snapshot(self, decode=None, viewer: str | None = None, max_text_tokens: int = 256) -> TreeSnapshot:
        return TreeSnapshot((), 0, 0, self.budget_bytes, 0, 0, self.bytes_per_token)


class RadixCache:
    enabled = True

    def __init__(self, pool: KVPool, fair_share: bool = False) -> None:
        """``fair_share`` (isolation mode): a visitor's insert evicts by the tree's fair
        share policy, and never evicts ``PUBLIC`` (shipped) content."""
        self.pool = pool
        self.tree = RadixTree()
        self.fair_share = fair_share
        self._lock = threading.RLock()

    @property
    def bytes_per_token(self) -> int:
        return self.pool.bytes_per_token

    @property
    def budget_bytes(self) -> int:
        return self.pool.budget_bytes

    @property
    def bytes_in_use(self) -> int:
        return self.pool.bytes_in_use

    @property
    def num_tokens(self) -> int:
        return self.tree.num_tokens

    @property
    def num_nodes(self) -> int:
        with self._lock:
            return len(self.tree.nodes())

    @property
    def evicted_tokens(self) -> int:
        return self.tree.evicted_tokens

    # ------------------------------------------------------------- requests
    def acquire(self, key: CacheKey, max_len: int, kv: RequestKV) -> CacheHandle:
        """Match ``key.ids[:max_len]``, lock the path and copy its KV into ``kv``."""
        with self._lock:
            m = self.tree.match(key, max_len=max_len)
            if m.length == 0:
                return CacheHandle(0, (), None)
            node, path = m.node, list(m.path)
            # Where the prompt leaves the cached path mid-node, lock only the matched part: the
            # node's unmatched rest must stay evictable to make room for this request's own
            # tokens. (A match capped by ``max_len`` continues along the node: lock it whole.)
            if self.tree.match(key, touch=False).length == m.length:
                node = self._split_at(key, m.length)
                path[-1] = node.id
            self.tree.lock(node)
            k_dst, v_dst = kv.prefill_from(m.length)
            self.pool.read_into(m.values, k_dst, v_dst)
            return CacheHandle(m.length, tuple(path), node)

    def release(self, handle: CacheHandle) -> None:
        if handle.node is not None:
            with self._lock:
                self.tree.unlock(handle.node)

    def _split_at(self, key: CacheKey, length: int) -> Node:
        """The node that ends exactly ``length`` (cached) tokens into ``key``, splitting the
        node a match ends in: inserting an already-cached prefix only splits."""
        return self.tree.insert(key.prefix(length), [None] * length).node

    def match_len(self, key: CacheKey) -> int:
        """Cached length of ``key`` right now; does not touch access times."""
        with self._lock:
            return self.tree.match(key, touch=False).length

    def insert(self, key: CacheKey, kv: RequestKV) -> int:
        """Cache the first ``len(key.ids)`` tokens of ``kv``; returns tokens newly stored.

        Evicts unlocked leaves to make room; if still short, stores the longest
        prefix that fits, so the budget is never exceeded.
        """
        n = min(len(key.ids), kv.length)
        with self._lock:
            existing = self.tree.match(key, max_len=n, touch=False)
            need = n - existing.length
            if need <= 0:
                return 0
            # Protect the path we extend (exactly: not the rest of a node we leave mid-way)
            # while evicting for room.
            anchor = self._split_at(key, existing.length) if existing.length else None
            if anchor is not None:
                self.tree.lock(anchor)
            try:
                short = need - self.pool.num_free
                if short > 0:
                    fair = self.fair_share and key.namespace != PUBLIC
                    self.pool.free(self.tree.evict(short, fair_for=key.namespace if fair else None,
                                                   capacity_tokens=self.pool.capacity, incoming_tokens=need))
            finally:
                if anchor is not None:
                    self.tree.unlock(anchor)
            take = min(need, self.pool.num_free)
            if take <= 0:
                return 0
            slots = self.pool.alloc(take)
            end = existing.length + take
            self.pool.write_from(slots, kv.k[:, :, existing.length:end], kv.v[:, :, existing.length:end])
            self.tree.insert(key.prefix(end), [-1] * existing.length + slots)
            return take

    # ------------------------------------------------------------- controls
    def clear(self, namespace: str | None = None) -> int:
        """Evict everything not in use by a running request (only ``namespace``'s
        nodes, if given); returns tokens freed."""
        with self._lock:
            freed = self.tree.clear(namespace)
            self.pool.free(freed)
            return len(freed)

    def set_budget(self, budget_bytes: int) -> int:
        """Change the budget, evicting LRU leaves if it shrinks. Returns tokens evicted."""
        budget_bytes = int(budget_bytes)
        if budget_bytes < 0:
            raise EngineError("the cache budget cannot be negative")
        with self._lock:
            new_capacity = budget_bytes // self.pool.bytes_per_token
            evicted = 0
            over = self.tree.num_tokens - new_capacity
            if over > 0:
                freed = self.tree.evict(over)
                self.pool.free(freed)
                evicted = len(freed)
            if self.tree.num_tokens > new_capacity:
                raise EngineError(
                    f"cannot shrink to {budget_bytes / 2**20:.1f} MB now: running requests hold "
                    f"{self.tree.num_tokens * self.pool.bytes_per_token / 2**20:.1f} MB; try again when idle")
            mapping = self.pool.rebuild(budget_bytes, self.tree.all_values())
            self.tree.remap_values(lambda vals: [mapping[v] for v in vals])
            return evicted

    # ------------------------------------------------------------- checking
    def check_invariants(self) -> None:
        with self._lock:
            self.tree.check_invariants()
            values = self.tree.all_values()
            assert len(values) == len(set(values)), "a pool slot is held twice"
            assert all(0 <= v < self.pool.capacity for v in values), "slot out of range"
            assert self.pool.num_used == len(values), (
                f"pool slots in use {self.pool.num_used} != tree tokens {len(values)}")
            assert self.pool.bytes_in_use <= self.pool.budget_bytes

    def locked_tokens(self) -> int:
        with self._lock:
            return sum(len(n.key) for n in self.tree.nodes() if n.lock_ref > 0)

    def snapshot(self, decode: Callable[[Sequence[int]], str] | None = None, viewer: str | None = None,
                 max_text_tokens: int = 256) -> TreeSnapshot:
        """A read-only copy of the tree. With ``viewer`` set, nodes of other
        namespaces are ``hidden``: no ids, no text, only shape and size."""
        now = time.monotonic()
        with self._lock:
            infos = []
            for node in self.tree.nodes():
                hidden = viewer is not None and not _visible_to(node.namespace, viewer)
                ids = () if hidden else tuple(node.key)
                text = ""
                if not hidden and decode is not None:
                    shown = ids if len(ids) <= max_text_tokens else ids[:max_text_tokens]
                    text = decode(shown) + ("…" if len(ids) > max_text_tokens else "")
                infos.append(NodeInfo(
                    node_id=node.id, parent_id=node.parent.id, num_tokens=len(node.key),
                    depth_tokens=node.depth_tokens(), num_bytes=len(node.key) * self.pool.bytes_per_token,
                    lock_ref=node.lock_ref, hits=node.hits, last_access_s_ago=max(0.0, now - node.last_access),
                    namespace=node.namespace if not hidden else "other", hidden=hidden,
                    token_ids=ids, text=text))
            return TreeSnapshot(tuple(infos), self.tree.num_tokens, self.pool.bytes_in_use,
                                self.pool.budget_bytes, self.pool.capacity, self.tree.evicted_tokens,
                                self.pool.bytes_per_token)
