"""The simulated cache: the pure radix tree with the engine's rules, a budget in tokens, LRU and a TTL.

A SIMULATION (no model, no KV, ``value`` entries are ``None``), used by the
model-free replay (``engine.tools.simulate``) and by the replay's analysis
(shadow tree, block granularity). What it keeps of the engine: a request reuses
its longest cached prefix, at least one prompt token is computed, then its
tokens are inserted and least recently used leaves are evicted down to
``budget_tokens``. Optionally a time-to-live (hosted APIs keep a prefix 5
minutes or 1 hour): an entry not touched within ``ttl_s`` of the log's clock
expires.

Memory is bounded by the budget, never by the log. Knows nothing about logs,
tokenizers or the UI.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any, NamedTuple

from engine.radix_tree import PUBLIC, CacheKey, InsertResult, Node, RadixTree
from engine.snapshot_view import node_infos, with_text
from engine.types import TreeSnapshot


# ------------------------------------------------------------------ the cache
class ServeResult(NamedTuple):
    cached_tokens: int
    evicted_tokens: int  # removed to fit the budget after this request
    expired_tokens: int  # removed by the TTL before this request


class _LeafHeapTree(RadixTree):
    """``RadixTree`` whose ``evict`` keeps its heap of leaves between calls.

    Same contract and the same order (least recently used leaf first, ties by node
    id) as ``RadixTree.evict``, which rebuilds its heap from every node on each
    call: fine for the engine, too slow for a log that evicts on every request.
    Entries go stale when a node is touched again, split off or removed; a popped
    entry is checked against the node and pushed again with its new access time.
    Locks and namespaces are not used by the simulation.
    """

    def __init__(self, clock) -> None:
        super().__init__(clock)
        self._leaves: list[tuple[float, int, Node]] = []

    def insert(self, key: CacheKey, value: Sequence[Any]) -> InsertResult:
        result = super().insert(key, value)
        if result.node.is_leaf and result.node is not self.root:
            heapq.heappush(self._leaves, (result.node.last_access, result.node.id, result.node))
        if len(self._leaves) > 4 * (len(self.root.children) + self.num_tokens // 8 + 64):
            self._leaves = [(n.last_access, n.id, n) for n in self.nodes() if n.is_leaf]
            heapq.heapify(self._leaves)
        return result

    def has_leaf_older_than(self, cutoff: float) -> bool:
        """Cheap test before a TTL sweep: every leaf has an entry whose stamp is at most its
        access time, and a node is never older than its leaves, so a heap top at or after
        ``cutoff`` means nothing is older."""
        return bool(self._leaves) and self._leaves[0][0] < cutoff

    def evict(self, num_tokens: int, namespace: str | None = None) -> list[Any]:
        assert namespace is None, "the simulation has no per-namespace eviction"
        freed: list[Any] = []
        heap = self._leaves
        while heap and len(freed) < num_tokens:
            stamp, _, node = heapq.heappop(heap)
            attached = node.parent is not None and node.parent.children.get((node.namespace, node.key[0])) is node
            if not attached or not node.is_leaf or node.lock_ref:
                continue  # removed, split below, or grown children since: not an evictable leaf now
            if stamp != node.last_access:
                heapq.heappush(heap, (node.last_access, node.id, node))
                continue
            freed.extend(node.value)
            self._remove_leaf(node)
            parent = node.parent
            if parent is not self.root and parent.is_leaf and not parent.lock_ref:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed


class SimCache:
    """The pure radix tree with a budget in tokens, LRU eviction and an optional TTL.
    Its clock is the log's: ``serve(..., now=timestamp)``."""

    def __init__(self, budget_tokens: int | None, ttl_s: float | None = None) -> None:
        self.budget_tokens = budget_tokens
        self.ttl_s = ttl_s
        self.now = 0.0
        self.tree = _LeafHeapTree(clock=lambda: self.now)
        self.evicted_tokens = 0
        self.expired_tokens = 0
        self.peak_tokens = 0

    def serve(self, ids: Sequence[int], inserted: Sequence[int] | None = None, namespace: str = PUBLIC,
              now: float | None = None) -> ServeResult:
        """One request: expire, match (``cached_tokens``, at most all but one prompt token),
        insert ``inserted`` (default: ``ids``), evict down to the budget."""
        self._tick(now)
        expired = self.expire()
        cached = self.tree.match(CacheKey(tuple(ids), namespace), max_len=max(0, len(ids) - 1)).length
        evicted = self._insert(inserted if inserted is not None else ids, namespace)
        return ServeResult(cached, evicted, expired)

    def record(self, inserted: Sequence[int], namespace: str = PUBLIC, now: float | None = None) -> None:
        """Insert without matching first (inserting touches the same path a match would)."""
        self._tick(now)
        self.expire()
        self._insert(inserted, namespace)

    def _tick(self, now: float | None) -> None:
        if now is not None:
            self.now = max(self.now, now)

    def _insert(self, keep: Sequence[int], namespace: str) -> int:
        if keep:
            self.tree.insert(CacheKey(tuple(keep), namespace), [None] * len(keep))
        evicted = 0
        if self.budget_tokens is not None and self.tree.num_tokens > self.budget_tokens:
            evicted = len(self.tree.evict(self.tree.num_tokens - self.budget_tokens))
            self.evicted_tokens += evicted
        self.peak_tokens = max(self.peak_tokens, self.tree.num_tokens)  # held between requests
        return evicted

    def expire(self) -> int:
        """Drop every entry not touched within the TTL. A node is touched whenever a
        descendant is, so expired nodes are whole subtrees and LRU order removes exactly them."""
        if self.ttl_s is None:
            return 0
        cutoff = self.now - self.ttl_s
        if not self.tree.has_leaf_older_than(cutoff):
            return 0
        stale = sum(len(n.key) for n in self.tree.nodes() if n.last_access < cutoff)
        if not stale:
            return 0
        freed = len(self.tree.evict(stale))
        self.expired_tokens += freed
        return freed

    def continuation(self, ids: Sequence[int], namespace: str = PUBLIC, max_tokens: int = 256
                     ) -> tuple[int, tuple[int, ...]]:
        """Longest cached prefix of ``ids`` (not touching the tree) and what the cache holds
        after it: the rest of the node it stops in, then the most recently used children.
        A cached prompt to compare with, built from the tree, not from a stored log."""
        m = self.tree.match(CacheKey(tuple(ids), namespace), touch=False)
        node: Node = m.node
        tail: list[int] = []
        if node is not self.tree.root:
            into = m.length - (node.depth_tokens() - len(node.key))
            tail.extend(node.key[into:])
        while len(tail) < max_tokens and node.children:
            node = max((c for c in node.children.values() if c.namespace in (PUBLIC, namespace)),
                       key=lambda c: c.last_access, default=None)
            if node is None:
                break
            tail.extend(node.key)
        return m.length, tuple(ids[:m.length]) + tuple(tail[:max_tokens])

    def last_access_of(self, ids: Sequence[int], namespace: str = PUBLIC) -> float | None:
        """When the deepest cached node on ``ids``'s path was last used (None if nothing matches)."""
        m = self.tree.match(CacheKey(tuple(ids), namespace), touch=False)
        return None if m.node is self.tree.root else m.node.last_access


def tree_snapshot(cache: SimCache, decode, bytes_per_token: int, max_text_tokens: int = 128) -> TreeSnapshot:
    """The simulated tree as the plain data the tree figures draw (``last_access_s_ago``
    is in the log's clock), built as the cache builds its own (``engine.snapshot_view``)."""
    infos = with_text(node_infos(cache.tree, cache.now, bytes_per_token), decode, max_text_tokens)
    budget = cache.budget_tokens if cache.budget_tokens is not None else cache.tree.num_tokens
    return TreeSnapshot(infos, cache.tree.num_tokens, cache.tree.num_tokens * bytes_per_token,
                        budget * bytes_per_token, budget, cache.evicted_tokens + cache.expired_tokens,
                        bytes_per_token)
