"""The radix cache: the radix tree over the one KV pool, behind one lock.

Owns: which pool slots the tree holds, and the rules that move KV between the tree, running
requests and the second tier: admission (match, make room, load from the tier), adoption of
a finished request's KV, when to evict (``engine.kvcache.eviction`` decides what, and owns the
trial-and-restore; the cache spills and frees what it took), and budget changes. Running requests
read the tree's slots for their cached prefix in place, never a copy; at the end their own slots
pass to the tree, no copy either. The pool side (live requests, renumbering, slot checks) is
``engine.kvcache.request_slots.SlotLedger``; the tier's keys, rules and files are
``engine.kvcache.second_tier.SecondTier`` and the store under it.

The cache is three layers, each in a module of its own, each a base of the next::

    SlotLedger   request_slots.py   the pool, the lock, live requests' own slots
    CacheRoom    cache_room.py      eviction under a held match (the one rule that keeps reuse
                                    exact), spills written after the lock (no disk I/O under it)
    TierMoves    tier_moves.py      loads back from the second tier, offload, persist
    RadixCache   this module        what requests and the operator call: admission, adoption,
                                    release, copies and inserts, the listener, clear, the
                                    budget, the checks and the snapshot

This module knows nothing about files, chunk keys or how a viewer's view is cut
(``engine.snapshot_view`` does that), nor about the scheduler or the model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from engine.kvcache import eviction
from engine.kvcache.eviction import EvictionPolicy
from engine.kvcache.kv_pool import KVPool
from engine.kvcache.radix_tree import RadixTree
from engine.kvcache.request_kv import RequestKV
from engine.kvcache.request_slots import RequestSlots
from engine.kvcache.second_tier import SecondTier
from engine.kvcache.tier_moves import TierMoves
from engine.snapshot_view import for_viewer, node_infos, with_text
from engine.types import CacheKey, TreeSnapshot


class RadixCache(TierMoves):
    """The ``PrefixCache`` with reuse (``engine.kvcache.prefix_cache``): see the module docstring."""

    enabled = True

    def __init__(self, pool: KVPool, fair_share: bool = False, tier: SecondTier | None = None,
                 policy: EvictionPolicy | str | None = None) -> None:
        """``fair_share`` (isolation mode): evict by the policy's fair-share rule. ``tier``: where
        evicted KV goes. ``policy``: the tree's eviction policy or its name (default LRU)."""
        super().__init__(pool)
        self.tree = RadixTree(policy=policy)
        self.fair_share = fair_share
        self.tier = tier

    # ---------------------------------------------------------------- facts
    @property
    def tree_bytes(self) -> int:
        return self.tree.num_tokens * self.pool.bytes_per_token

    @property
    def shared_tokens(self) -> int:
        return self.tree.shared_tokens

    @property
    def num_tokens(self) -> int:
        return self.tree.num_tokens

    @property
    def num_nodes(self) -> int:
        return self.tree.num_nodes

    @property
    def evicted_tokens(self) -> int:
        return self.tree.evicted_tokens

    def locked_tokens(self) -> int:
        return self.tree.locked_tokens

    @property
    def tier_loaded_tokens(self) -> int:
        return self.tier.loaded_tokens if self.tier is not None else 0

    @property
    def tier_spilled_tokens(self) -> int:
        return self.tier.spilled_tokens if self.tier is not None else 0

    def tier_stats(self) -> dict:
        return self.tier.stats() if self.tier is not None else {}

    # ------------------------------------------------------------- requests
    def acquire(self, key: CacheKey, max_len: int, total_tokens: int) -> RequestSlots | None:
        with self._locked():
            m = self._match(key, max_len)
            # Room for the whole request past the memory match: the tier's chunks (read only once
            # room is made, so a request waiting for room reads no file) plus its own slots.
            nodes_before = self.tree.num_nodes
            with self._holding(key, m) as node:
                room = self._make_room(max(0, total_tokens - m.length), key.namespace)
            if not room:
                if self.tree.num_nodes > nodes_before:
                    self.tree.unsplit(node)  # a failed admission leaves the tree as it found it
                return None
            loaded, load_ms = self._load(key, m.length, max_len)  # allocates only: the match cannot go meanwhile
            cached = m.length + loaded
            m = self.tree.match(key, max_len=cached) if cached else m  # the match now counts: hits, access times
            node = None
            if cached:
                node = self._split_at(key, cached) if loaded else self._held_node(key, m)
                self.tree.lock(node)
            slots = self.pool.alloc(max(0, total_tokens - cached))
            assert slots is not None, "room was made"
            rs = RequestSlots(list(m.values) + slots, cached, cached, tuple(m.path) if cached else (), node,
                              length=cached, tier_tokens=loaded, tier_load_ms=load_ms)
            return self._admit(rs)

    def adopt(self, rs: RequestSlots, key: CacheKey) -> int:
        n = min(len(key.ids), rs.length)
        if n <= rs.tree_len:
            return 0
        with self._lock:
            existing = self.tree.match(key, max_len=n, touch=False)
            # Positions [tree_len, existing) were cached by someone else meanwhile: use theirs.
            duplicates = rs.slots[rs.tree_len:existing.length]
            rs.slots[rs.tree_len:existing.length] = existing.values[rs.tree_len:]
            self.pool.free(duplicates)
            node = self.tree.insert(key.prefix(n), rs.slots[:n]).node
            self.tree.lock(node)
            if rs.node is not None:
                self.tree.unlock(rs.node)
            stored = n - max(existing.length, rs.tree_len)
            self._running_tokens -= n - rs.tree_len
            rs.node, rs.tree_len, rs._runs = node, n, None
            self.version += 1
            return max(0, stored)

    def release(self, rs: RequestSlots) -> None:
        with self._lock:
            if not self._retire(rs):
                return
            if rs.node is not None:
                self.tree.unlock(rs.node)
            rs.node, rs.slots, rs._runs = None, rs.slots[:rs.tree_len], None

    def match_len(self, key: CacheKey) -> int:
        with self._lock:
            return self._match(key, len(key.ids)).length

    def copy_prefix(self, key: CacheKey, max_len: int, kv: RequestKV, touch: bool = False) -> int:
        with self._lock:
            m = self.tree.match(key, max_len=max_len, touch=touch)
            if not m.length:
                return 0
            if touch:  # hits and access times changed: what the tree view shows
                self.version += 1
            k_dst, v_dst = kv.prefill_from(m.length)
            self.pool.read_into(m.values, k_dst, v_dst)
            return m.length

    def insert(self, key: CacheKey, kv: RequestKV) -> int:
        n = min(len(key.ids), kv.length)
        with self._locked():
            existing = self.tree.match(key, max_len=n, touch=False)
            need = n - existing.length
            if need <= 0:
                return 0
            # Store the longest prefix that fits, holding the path it extends while evicting.
            with self._holding(key, existing):
                self._make_room(need, key.namespace, all_or_nothing=False)
                take = min(need, self.pool.num_free)
                if take <= 0:
                    return 0
                slots = self.pool.alloc(take)
                start = existing.length
                self.pool.write_from(slots, kv.k[:, :, start:start + take], kv.v[:, :, start:start + take])
                self._extend(key, start, slots)
            self.version += 1
            return take

    # ------------------------------------------------------------- controls
    def publish_to(self, listener) -> None:
        """Tell ``listener`` (``engine.kvcache.kv_events.KVEventPublisher``) what the tree caches and
        what leaves it, from now on, under the cache's lock."""
        with self._lock:
            self.tree.listener = listener
            if self.tier is not None:
                self.tier.publish_to(listener)  # the second tier's blocks, under a medium of its own

    def clear(self, namespace: str | None = None) -> int:
        """Evict everything not in use by a running request (only ``namespace``'s
        nodes, if given); returns tokens freed. A clear that empties the whole tree is one
        ``cleared`` for the listener, as vLLM's reset is one ``AllBlocksCleared``."""
        with self._lock:
            freed = eviction.clear(self.tree, namespace)
            self.pool.free(freed)
            self.version += 1
            return len(freed)

    def set_budget(self, budget_bytes: int) -> int:
        """Change the budget, evicting by the tree's policy (fair share of the new capacity in
        isolation mode) if it shrinks. Returns tokens evicted. Running requests keep their slots."""
        budget_bytes = int(budget_bytes)
        with self._locked():
            new_capacity = self._check_shrink(budget_bytes, self.tree.locked_tokens)
            evicted = 0
            over = self.tree.num_tokens + self._running_tokens - new_capacity
            if over > 0:
                taken = eviction.evict(self.tree, over, self._rule(None, 0, capacity=new_capacity))
                self._evicted(taken)
                evicted = len(taken.freed)
            mapping = self._resize(budget_bytes, self.tree.all_values())
            self.tree.remap_values(lambda vals: [mapping[v] for v in vals])
            return evicted

    # ------------------------------------------------------------- checking
    def check_invariants(self) -> None:
        with self._lock:
            self.tree.check_invariants()
            self._check_slots(self.tree.all_values())
            if self.tier is not None:
                self.tier.check()

    def snapshot(self, decode: Callable[[Sequence[int]], str] | None = None, viewer: str | None = None,
                 max_text_tokens: int = 256) -> TreeSnapshot:
        """A read-only copy of the tree, with the second tier's nodes (``spilled``, see
        ``engine.kvcache.spilled_tree``) beside the pool's. With ``viewer`` set, what other visitors
        cached shows only as ``engine.snapshot_view.for_viewer`` allows (coarse "others" nodes,
        no text, hits, locks or times on shared nodes, totals in buckets).

        The structure is copied under the lock; text is decoded after it is released, so a
        redraw never holds up the scheduler."""
        now = time.monotonic()
        bpt = self.pool.bytes_per_token
        with self._lock:
            infos = node_infos(self.tree, now, bpt)
            if self.tier is not None:
                infos += self.tier.infos(self.tree, now, bpt)
            full = TreeSnapshot(tuple(infos), self.tree.num_tokens, self.tree_bytes, self.pool.budget_bytes,
                                self.pool.capacity, self.tree.evicted_tokens, bpt,
                                self.tier.kind if self.tier is not None else "")
        view = for_viewer(full, viewer) if viewer is not None else full
        return replace(view, nodes=with_text(view.nodes, decode, max_text_tokens))

