"""The simulated cache: the pure radix tree with the engine's rules, a budget in tokens, its eviction policy and a TTL.

A SIMULATION (no model, no KV, ``value`` entries are ``None``), used by the
model-free replay (``analysis.replay.simulate``) and by the replay's analysis
(shadow tree, block granularity). What it keeps of the engine: a request reuses
its longest cached prefix, at least one prompt token is computed, then its
tokens are inserted and leaves are evicted down to ``budget_tokens`` by the
tree's ``EvictionPolicy`` (``engine.kvcache.eviction``, the engine's own; LRU by
default). Optionally a time-to-live (hosted APIs keep a prefix 5
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
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from engine.kvcache.chunks import CHUNK_TOKENS
from engine.kvcache.eviction import LRU, EvictionPolicy
from engine.kvcache.radix_tree import Node, RadixTree
from engine.snapshot_view import node_infos, with_text
from engine.types import PUBLIC, CacheKey, TreeSnapshot


# ------------------------------------------------------------------ the cache
class ServeResult(NamedTuple):
    cached_tokens: int  # from memory and from the second tier
    evicted_tokens: int  # removed to fit the budget after this request
    expired_tokens: int  # removed by the TTL before this request
    tier_tokens: int = 0  # of the cached ones, loaded back from the second tier


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
    """The pure radix tree with a budget in tokens, eviction by ``policy`` (an
    ``EvictionPolicy`` or its name; default LRU), an optional TTL and an optional second tier
    of ``tier_chunks`` chunks (None: no tier). Its clock is the log's: ``serve(..., now=timestamp)``."""

    def __init__(self, budget_tokens: int | None, ttl_s: float | None = None, tier_chunks: int | None = None,
                 policy: EvictionPolicy | str | None = None) -> None:
        self.budget_tokens = budget_tokens
        self.ttl_s = ttl_s
        self.tier = SimTier(tier_chunks) if tier_chunks is not None else None
        self.now = 0.0
        self.tree = RadixTree(clock=lambda: self.now, policy=policy)
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
        """Drop every entry not touched within the TTL, whatever the eviction policy. A node is
        touched whenever a descendant is, so expired nodes are whole subtrees: each goes whole."""
        if self.ttl_s is None:
            return 0
        cutoff = self.now - self.ttl_s
        if isinstance(self.tree.policy, LRU):  # cheap test first: the heap's top is the oldest leaf
            top = self.tree.leaves.top_key()
            if top is None or top[0][0] >= cutoff:
                return 0
        root = self.tree.root
        stale = [n for n in self.tree.nodes()
                 if n.last_access < cutoff and (n.parent is root or n.parent.last_access >= cutoff)]
        freed = sum(len(self.tree.remove_subtree(n)) for n in stale)
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
