"""KV moved between the tree and the second tier by the cache: loads back, offload, persist.

Owns: ``TierMoves``, the part of ``RadixCache`` (``engine.kvcache.radix_cache``) that brings the
tier's chunks of a prompt back into free slots and the tree (``load_prefix``, and the load an
admission does, ``_load``), evicts the whole tree to the tier (``offload``) and writes every cached
chunk and the spilled paths out for a restart (``persist``). It makes room through ``CacheRoom``
(``engine.kvcache.cache_room``: a match held while room is made, spills written after the lock).
Which chunks exist, their keys and their trust rule are ``SecondTier``'s and its store's
(``engine.kvcache.second_tier``, ``engine.kvcache.kv_tier``); this module knows no file, no key
and no request.
"""

from __future__ import annotations

import time

from engine.kvcache import eviction
from engine.kvcache.cache_room import CacheRoom
from engine.kvcache.second_tier import path_of
from engine.types import CacheKey


class TierMoves(CacheRoom):
    """The cache's traffic with its second tier (see the module docstring)."""

    def _load(self, key: CacheKey, cached: int, max_len: int) -> tuple[int, float]:
        """Bring the tier's chunks of ``key.ids[:max_len]`` after the first ``cached`` tokens back
        into free slots and the tree (room was made for them and the match is held). Returns
        tokens loaded and the milliseconds the read and the copy took."""
        keys = self.tier.chunks_after(key, cached, max_len) if self.tier is not None else []
        if not keys:
            return 0, 0.0
        t0 = time.perf_counter()
        chunks = self.tier.read(keys)
        if not chunks:
            return 0, 0.0
        slots = self.pool.alloc(chunks[-1][0] - cached)
        assert slots is not None, "room was made"
        self.tier.load_into(self.pool, slots, cached, chunks)
        self._extend(key, cached, slots)
        ms = (time.perf_counter() - t0) * 1000
        self.tier.load_ms += ms
        return len(slots), ms

    def _tier_room(self, key: CacheKey, cached: int, max_len: int) -> int:
        """Slots the tier's chunks after ``cached`` would need (reads no file)."""
        keys = self.tier.chunks_after(key, cached, max_len) if self.tier is not None else []
        return keys[-1][0] - cached if keys else 0

    def load_prefix(self, key: CacheKey, max_len: int) -> int:
        """Bring what the second tier holds of ``key.ids[:max_len]`` (after the part in memory)
        back into the pool and the tree; returns tokens loaded (0 without room)."""
        with self._locked():
            m = self._match(key, max_len)
            need = self._tier_room(key, m.length, max_len)
            if not need:
                return 0
            nodes_before = self.tree.num_nodes
            with self._holding(key, m) as node:
                room = self._make_room(need, key.namespace)
            if not room:
                if self.tree.num_nodes > nodes_before:
                    self.tree.unsplit(node)
                return 0
            self.version += 1
            return self._load(key, m.length, max_len)[0]  # allocates only: the match cannot go meanwhile

    def offload(self) -> int:
        """Evict every unlocked entry to the second tier, in eviction's order (benchmarks, tests);
        tokens evicted. The tree's chunks are written first (``_write_tree``), so a tree larger
        than the tier's write queue is spilled whole, not refused."""
        if self.tier is not None:
            self.tier.store.flush()
            self._write_tree()
        with self._locked():
            evicted = eviction.evict(self.tree, self.tree.num_tokens, self._rule(None, 0))
            self._evicted(evicted)
            self.version += 1
            return len(evicted.freed)

    def persist(self) -> int:
        """Write every cached chunk to the second tier and the spilled paths beside them (for a
        restart), the tier's queue written out before it returns; returns chunks written."""
        if self.tier is None:
            return 0
        store = self.tier.store
        store.flush()  # what evictions queued before is theirs, not this call's
        before = store.stored_chunks
        self._write_tree()
        with self._lock:
            paths = self.tier.paths_to_save()
        store.write_paths(paths)
        return store.stored_chunks - before

    def _write_tree(self) -> None:
        """Every cached chunk handed to the tier under the lock and written after it, in rounds:
        what a full queue refused is handed over in the next round, once the queue has drained.
        Each chunk is handed over once at most (as one synchronous pass would: a tier smaller than
        the tree keeps the last ones), so the rounds end."""
        store, handed = self.tier.store, set()
        while True:
            before = len(handed)
            with self._lock:
                complete = True
                for node in self.tree.nodes():
                    path, slots = path_of(node, self.tree.root)
                    complete &= self.tier.spill(path, slots, len(path.ids) - len(node.key), self.pool, handed)
            store.flush()
            if complete or len(handed) == before:
                return
