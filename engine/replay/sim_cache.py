"""The simulated cache: the pure radix tree with the engine's rules, a budget in tokens, LRU and a TTL.

A SIMULATION (no model, no KV, ``value`` entries are ``None``), used by the
model-free replay (``engine.replay.simulate``) and by the replay's analysis
(shadow tree, block granularity). What it keeps of the engine: a request reuses
its longest cached prefix, at least one prompt token is computed, then its
tokens are inserted and least recently used leaves are evicted down to
``budget_tokens``. Optionally a time-to-live (hosted APIs keep a prefix 5
minutes or 1 hour): an entry not touched within ``ttl_s`` of the log's clock
expires. Optionally a second tier (``SimTier``, the engine's ``engine.kvcache.kv_tier``
without bytes): what eviction drops goes there in whole ``CHUNK_TOKENS`` chunks
and a later request loads it back instead of recomputing it (an expired entry is
gone: the TTL models a provider that forgets).

Memory is bounded by the budget, never by the log. Knows nothing about logs,
tokenizers or the UI.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from engine.kvcache.chunks import CHUNK_TOKENS
from engine.kvcache.radix_tree import InsertResult, Node, RadixTree
from engine.snapshot_view import node_infos, with_text
from engine.types import PUBLIC, CacheKey, TreeSnapshot


# ------------------------------------------------------------------ the cache
class ServeResult(NamedTuple):
    cached_tokens: int  # from memory and from the second tier
    evicted_tokens: int  # removed to fit the budget after this request
    expired_tokens: int  # removed by the TTL before this request
    tier_tokens: int = 0  # of the cached ones, loaded back from the second tier


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

    def evict(self, num_tokens: int, namespace: str | None = None, removed: list[Node] | None = None) -> list[Any]:
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
            if removed is not None:
                removed.append(node)
            parent = node.parent
            if parent is not self.root and parent.is_leaf and not parent.lock_ref:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed


# ------------------------------------------------------------------ the second tier
def _chunk_keys(namespace: str, ids: Sequence[int], stop_chunks: int) -> Iterator[bytes]:
    """The key of each whole chunk of ``ids`` in order, up to ``stop_chunks`` of them: key ``i``
    names the namespace and every token before the chunk's end, as the engine's ``chunk_key``
    does, chained (each key hashes the one before and its own 64 tokens) so that the keys of a
    prompt cost one pass over it."""
    digest = hashlib.blake2b(namespace.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    for i in range(stop_chunks):
        piece = array("q", ids[i * CHUNK_TOKENS:(i + 1) * CHUNK_TOKENS]).tobytes()
        digest = hashlib.blake2b(digest + piece, digest_size=16).digest()
        yield digest


class SimTier:
    """The engine's second tier without bytes: an LRU of chunk keys, ``capacity_chunks`` at most
    (the tier's byte budget over one chunk's KV bytes; 0: too small for a chunk, keeps nothing).

    The engine's rules (``RadixCache._spill``, ``_tier_keys``, ``_tier_read`` and
    ``ChunkStore``): an evicted node leaves the whole chunks that end inside it (chunk
    boundaries at absolute positions multiple of ``CHUNK_TOKENS``); a chunk already kept is
    not written again (nor moved up the LRU); a request takes the kept chunks that continue
    its memory match without a gap and end within its ``max_len``, and each chunk read moves
    up the LRU. Chunks stay in the tier once loaded.
    """

    def __init__(self, capacity_chunks: int) -> None:
        self.capacity_chunks = max(0, int(capacity_chunks))
        self._keys: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self.spilled_tokens = self.loaded_tokens = 0

    @property
    def num_chunks(self) -> int:
        return len(self._keys)

    def spill(self, node: Node, root: Node) -> None:
        """Keep the whole chunks that end inside ``node`` (just evicted: its links to its
        ancestors are intact, even those evicted in the same pass)."""
        chain = []
        while node is not None and node is not root:
            chain.append(node)
            node = node.parent
        ids = [t for n in reversed(chain) for t in n.key]
        first = (len(ids) - len(chain[0].key)) // CHUNK_TOKENS  # chunks ending earlier are the ancestors'
        for i, key in enumerate(_chunk_keys(chain[0].namespace, ids, len(ids) // CHUNK_TOKENS)):
            if i >= first and key not in self._keys and self.capacity_chunks:
                while len(self._keys) >= self.capacity_chunks:
                    self._keys.popitem(last=False)
                self._keys[key] = None
                self.spilled_tokens += CHUNK_TOKENS

    def continuing(self, key: CacheKey, cached: int, max_len: int) -> list[tuple[int, bytes]]:
        """``(chunk end, chunk key)`` of the kept chunks after the first ``cached`` tokens of
        ``key``, in order, without a gap, ending within ``max_len``. Moves nothing."""
        if not self._keys:
            return []
        first = cached // CHUNK_TOKENS  # the chunk holding position ``cached``
        out = []
        for i, chunk in enumerate(_chunk_keys(key.namespace, key.ids, max_len // CHUNK_TOKENS)):
            if i < first:
                continue
            if chunk not in self._keys:
                break
            out.append(((i + 1) * CHUNK_TOKENS, chunk))
        return out

    def load(self, chunks: list[tuple[int, bytes]], cached: int) -> int:
        """Read ``chunks`` up to the first the tier no longer holds; tokens loaded after ``cached``."""
        end = cached
        for stop, chunk in chunks:
            if chunk not in self._keys:
                break
            self._keys.move_to_end(chunk)
            end = stop
        self.loaded_tokens += end - cached
        return end - cached


class SimCache:
    """The pure radix tree with a budget in tokens, LRU eviction, an optional TTL and an
    optional second tier of ``tier_chunks`` chunks (None: no tier).
    Its clock is the log's: ``serve(..., now=timestamp)``."""

    def __init__(self, budget_tokens: int | None, ttl_s: float | None = None, tier_chunks: int | None = None) -> None:
        self.budget_tokens = budget_tokens
        self.ttl_s = ttl_s
        self.tier = SimTier(tier_chunks) if tier_chunks is not None else None
        self.now = 0.0
        self.tree = _LeafHeapTree(clock=lambda: self.now)
        self.evicted_tokens = 0
        self.expired_tokens = 0
        self.peak_tokens = 0

    def serve(self, ids: Sequence[int], inserted: Sequence[int] | None = None, namespace: str = PUBLIC,
              now: float | None = None) -> ServeResult:
        """One request: expire, match (``cached_tokens``, at most all but one prompt token),
        insert ``inserted`` (default: ``ids``), evict down to the budget. With a tier, the
        chunks it holds after the memory match are looked up first and read after the
        eviction, as the engine's admission makes room before it reads (a chunk this very
        eviction pushes out of the tier is recomputed); ``tier_tokens`` of the cached ones."""
        self._tick(now)
        expired = self.expire()
        key, max_len = CacheKey(tuple(ids), namespace), max(0, len(ids) - 1)
        cached = self.tree.match(key, max_len=max_len).length
        chunks = self.tier.continuing(key, cached, max_len) if self.tier is not None else []
        evicted = self._insert(inserted if inserted is not None else ids, namespace)
        loaded = self.tier.load(chunks, cached) if chunks else 0
        return ServeResult(cached + loaded, evicted, expired, loaded)

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
            removed: list[Node] | None = [] if self.tier is not None else None
            evicted = len(self.tree.evict(self.tree.num_tokens - self.budget_tokens, removed=removed))
            self.evicted_tokens += evicted
            for node in removed or ():
                self.tier.spill(node, self.tree.root)
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
