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


HIDDEN_BUCKET_TOKENS = 256  # others' activity shows only in whole buckets: one chat turn fits in one


def coarse_tokens(num_tokens: int) -> int:
    """``num_tokens`` rounded up to whole ``HIDDEN_BUCKET_TOKENS`` buckets."""
    return -(-num_tokens // HIDDEN_BUCKET_TOKENS) * HIDDEN_BUCKET_TOKENS


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
        """Unlock what ``acquire`` or ``pin`` locked. Call exactly once per handle."""

    def pin(self, key: CacheKey) -> CacheHandle:
        """Lock the cached prefix of ``key`` (no copy, no hit counted): a running request
        keeps its prompt in the cache while it decodes."""

    def insert(self, key: CacheKey, kv: RequestKV) -> int:
        """Store the first ``min(len(key.ids), kv.length)`` tokens of ``kv`` under ``key``,
        evicting unlocked least-recently-used entries for room; stores the longest prefix
        that fits and never exceeds the budget. Returns tokens newly stored."""

    def match_len(self, key: CacheKey) -> int:
        """Cached length of ``key.ids`` now. Does not modify the tree or access times."""

    def copy_prefix(self, key: CacheKey, max_len: int, kv: RequestKV) -> int:
        """Copy the KV of the longest cached prefix of ``key.ids[:max_len]`` into the empty
        scratch buffer ``kv`` (for timings and tools). Changes nothing in the cache: no hit,
        no access time, no lock left behind. Returns the copied length."""

    def reserve(self, num_tokens: int, namespace: str | None) -> bool:
        """Hold ``num_tokens`` of the budget for a running request's own KV (inserts then
        leave it free), evicting unlocked entries for room (by fair share for ``namespace``,
        as ``insert`` does). False, with nothing evicted, when even evicting every unlocked
        entry would not make room."""

    def unreserve(self, num_tokens: int) -> None:
        """Give back what ``reserve`` held."""

    @property
    def reserved_tokens(self) -> int: ...

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
        self.reserved_tokens = 0
        self._lock = threading.Lock()

    def reserve(self, num_tokens: int, namespace: str | None) -> bool:
        with self._lock:
            if self.reserved_tokens + num_tokens > self.budget_bytes // self.bytes_per_token:
                return False
            self.reserved_tokens += num_tokens
            return True

    def unreserve(self, num_tokens: int) -> None:
        with self._lock:
            self.reserved_tokens = max(0, self.reserved_tokens - num_tokens)

    def acquire(self, key: CacheKey, max_len: int, kv: RequestKV) -> CacheHandle:
        return CacheHandle(0, (), None)

    def match_len(self, key: CacheKey) -> int:
        return 0

    def copy_prefix(self, key: CacheKey, max_len: int, kv: RequestKV) -> int:
        return 0

    def insert(self, key: CacheKey, kv: RequestKV) -> int:
        return 0

    def release(self, handle: CacheHandle) -> None:
        pass

    def pin(self, key: CacheKey) -> CacheHandle:
        return CacheHandle(0, (), None)

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
        self.reserved_tokens = 0  # budget held by running requests' own buffers

    def _room(self) -> int:
        """Free slots that no running request has reserved."""
        return self.pool.num_free - self.reserved_tokens

    def reserve(self, num_tokens: int, namespace: str | None) -> bool:
        with self._lock:
            if num_tokens > self.pool.capacity - self.reserved_tokens - self.locked_tokens():
                return False
            short = num_tokens - self._room()
            if short > 0:
                self.pool.free(self._evict_for(short, namespace, num_tokens))
            if self._room() < num_tokens:
                return False
            self.reserved_tokens += num_tokens
            return True

    def _evict_for(self, num_tokens: int, namespace: str | None, incoming_tokens: int) -> list:
        """Evict ``num_tokens`` to make room for ``namespace``'s ``incoming_tokens``: by fair
        share in isolation mode (shipped ``PUBLIC`` content is never evicted for a visitor),
        else least recently used. Call with the lock held."""
        fair = self.fair_share and namespace is not None and namespace != PUBLIC
        return self.tree.evict(num_tokens, fair_for=namespace if fair else None,
                               capacity_tokens=self.pool.capacity, incoming_tokens=incoming_tokens)

    def unreserve(self, num_tokens: int) -> None:
        with self._lock:
            self.reserved_tokens = max(0, self.reserved_tokens - num_tokens)

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

    def pin(self, key: CacheKey) -> CacheHandle:
        with self._lock:
            m = self.tree.match(key, touch=False)
            if m.length == 0:
                return CacheHandle(0, (), None)
            node = self._split_at(key, m.length)
            self.tree.lock(node)
            return CacheHandle(m.length, tuple(m.path[:-1]) + (node.id,), node)

    def _split_at(self, key: CacheKey, length: int) -> Node:
        """The node that ends exactly ``length`` (cached) tokens into ``key``, splitting the
        node a match ends in: inserting an already-cached prefix only splits."""
        return self.tree.insert(key.prefix(length), [None] * length).node

    def match_len(self, key: CacheKey) -> int:
        """Cached length of ``key`` right now; does not touch access times."""
        with self._lock:
            return self.tree.match(key, touch=False).length

    def copy_prefix(self, key: CacheKey, max_len: int, kv: RequestKV) -> int:
        with self._lock:
            m = self.tree.match(key, max_len=max_len, touch=False)
            if m.length:
                k_dst, v_dst = kv.prefill_from(m.length)
                self.pool.read_into(m.values, k_dst, v_dst)
            return m.length

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
                short = need - self._room()
                if short > 0:
                    self.pool.free(self._evict_for(short, key.namespace, need))
            finally:
                if anchor is not None:
                    self.tree.unlock(anchor)
            take = min(need, self._room())
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
        """A read-only copy of the tree. With ``viewer`` set, what other visitors cached shows
        only in a form that does not identify it: every subtree of other namespaces hanging
        from a node is one ``hidden`` "others" node (id ``-1 - parent id``) whose size is
        rounded up to ``HIDDEN_BUCKET_TOKENS``, with no text, hits, lock or access time; shared
        (``PUBLIC``) nodes show no hits, locks or access times (others use them too); and the
        totals count hidden tokens, and evictions, in the same buckets."""
        now = time.monotonic()
        bpt = self.pool.bytes_per_token
        with self._lock:
            infos, hidden_under, depth = [], {}, {self.tree.root.id: 0}
            anchor: dict[int, Node] = {}  # hidden node id -> the visible node (or root) its subtree hangs from
            for node in self.tree.nodes():  # parents before children
                depth[node.id] = depth[node.parent.id] + len(node.key)
                if viewer is not None and not _visible_to(node.namespace, viewer):
                    top = anchor.get(node.parent.id, node.parent)
                    anchor[node.id] = top
                    hidden_under[top] = hidden_under.get(top, 0) + len(node.key)
                    continue
                ids = tuple(node.key)
                text = ""
                if decode is not None:
                    shown = ids if len(ids) <= max_text_tokens else ids[:max_text_tokens]
                    text = decode(shown) + ("…" if len(ids) > max_text_tokens else "")
                shared = viewer is not None and node.namespace == PUBLIC
                infos.append(NodeInfo(
                    node_id=node.id, parent_id=node.parent.id, num_tokens=len(node.key), depth_tokens=depth[node.id],
                    num_bytes=len(node.key) * bpt, lock_ref=0 if shared else node.lock_ref,
                    hits=0 if shared else node.hits,
                    last_access_s_ago=0.0 if shared else max(0.0, now - node.last_access),
                    namespace=node.namespace, hidden=False, token_ids=ids, text=text))
            for parent, tokens in hidden_under.items():
                size = coarse_tokens(tokens)
                infos.append(NodeInfo(
                    node_id=-1 - parent.id, parent_id=parent.id, num_tokens=size, depth_tokens=depth[parent.id] + size,
                    num_bytes=size * bpt, lock_ref=0, hits=0, last_access_s_ago=0.0, namespace="other", hidden=True,
                    token_ids=(), text=""))
            num_tokens, num_bytes, evicted = self.tree.num_tokens, self.pool.bytes_in_use, self.tree.evicted_tokens
            if viewer is not None:
                num_tokens = sum(n.num_tokens for n in infos)
                num_bytes, evicted = num_tokens * bpt, coarse_tokens(evicted)
            return TreeSnapshot(tuple(infos), num_tokens, num_bytes, self.pool.budget_bytes, self.pool.capacity,
                                evicted, bpt)
