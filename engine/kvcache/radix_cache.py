"""The radix cache: the radix tree over the one KV pool, behind one lock.

Owns: which pool slots the tree holds, and the rules that move KV between the tree, running
requests and the second tier: admission (match, make room, load from the tier), adoption of
a finished request's KV, when to evict (``engine.kvcache.eviction`` decides what, and owns the
trial-and-restore; the cache spills and frees what it took), and budget changes. Running requests
read the tree's slots for their cached prefix in place, never a copy; at the end their own slots
pass to the tree, no copy either. The pool side (live requests, renumbering, slot checks) is
``engine.kvcache.request_slots.SlotLedger``; the tier's keys, rules and files are
``engine.kvcache.second_tier.SecondTier`` and the store under it.

The one rule that keeps reuse exact: **a match is held (split at its end and locked) while
room is made for what comes after it**, in every path that reuses one (admission, a load
from the tier, an insert). Eviction could otherwise take the matched leaf, and what comes
after would be stored behind slots that are free or someone else's. Every store into the
tree re-reads the match under the lock and asserts it still covers what it extends.

No disk I/O under the lock (issue 43): eviction hands the evicted KV to the second tier as
copies the tier then owns (``SecondTier.spill``, the store's bounded queue; a full queue means
the KV is simply evicted), and every call that can evict (``_locked``) has the tier write them
after it has released the lock. Meanwhile a queued chunk is found and served from its copy, so
another thread's ``match_len`` or admission never waits for the disk, and a load never reads a
half-written file. ``persist`` writes the queue out before it returns.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

from engine.kvcache import eviction
from engine.kvcache.eviction import EvictionPolicy
from engine.kvcache.kv_pool import KVPool
from engine.kvcache.radix_tree import MatchResult, Node, RadixTree
from engine.kvcache.request_kv import RequestKV
from engine.kvcache.request_slots import RequestSlots, SlotLedger
from engine.kvcache.second_tier import SecondTier, path_of
from engine.snapshot_view import for_viewer, node_infos, with_text
from engine.types import CacheKey, TreeSnapshot


class RadixCache(SlotLedger):
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

    # ------------------------------------------------------------- the lock
    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The cache's lock for a call that may evict; once it is released (by this thread's
        outermost hold), the chunks its spills queued are written, by this thread, under no lock."""
        try:
            with self._lock:
                yield
        finally:
            self._write_spills()

    def _write_spills(self) -> None:
        if self.tier is not None and not _held_here(self._lock):
            self.tier.write_queued()

    # ------------------------------------------------------------- room
    def _rule(self, namespace: str | None, incoming: int, capacity: int | None = None) -> eviction.Rule:
        """How room is made for ``namespace``'s ``incoming`` tokens (None: the operator's shrink
        or offload), of ``capacity`` (default the pool's): ``engine.kvcache.eviction.rule_for``."""
        capacity = self.pool.capacity if capacity is None else capacity
        return eviction.rule_for(namespace, self.fair_share, capacity, incoming)

    def _make_room(self, num_slots: int, namespace: str | None, all_or_nothing: bool = True) -> bool:
        """Evict until ``num_slots`` slots are free (``engine.kvcache.eviction.make_room``). All or
        nothing: False, with the tree as it was, when eviction cannot make that much room (else as
        much as it can). Call with the lock held, and with every match that will be extended held
        (``_holding``)."""
        short = num_slots - self.pool.num_free
        if short <= 0:
            return True
        evicted = eviction.make_room(self.tree, short, self._rule(namespace, num_slots), all_or_nothing)
        if evicted is None:
            return False
        self._evicted(evicted)
        return len(evicted.freed) >= short

    def _evicted(self, evicted: eviction.Evicted) -> None:
        """Eviction is final: the removed nodes' KV goes to the second tier, then their slots
        are free. Call with the lock held, before anything reuses the slots."""
        if self.tier is not None:
            for node in evicted.removed:
                path, slots = path_of(node, self.tree.root)
                self.tier.spill(path, slots, len(path.ids) - len(node.key), self.pool)
            self.tier.settle()
        self.pool.free(evicted.freed)

    @contextmanager
    def _holding(self, key: CacheKey, m: MatchResult) -> Iterator[Node | None]:
        """Hold exactly the match ``m`` of ``key`` (locked) while the body makes room; yields the
        node that ends it (None for an empty match). Where the prompt leaves a node mid-way, the
        node is split so its unmatched rest stays evictable; a match cut short by ``max_len``
        goes on along the prompt itself, so that node is locked whole."""
        node = None
        if m.length:
            capped = self.tree.match(key, touch=False).length > m.length
            node = m.node if capped else self._split_at(key, m.length)
            self.tree.lock(node)
        try:
            yield node
        finally:
            if node is not None:
                self.tree.unlock(node)

    def _extend(self, key: CacheKey, cached: int, slots: list[int]) -> Node:
        """Cache ``key``'s positions ``[cached, cached + len(slots))`` in ``slots`` after its first
        ``cached`` tokens, which must still be in the tree (held while room was made)."""
        held = self.tree.match(key, max_len=cached, touch=False)
        assert held.length == cached, f"the match of {cached} tokens was lost ({held.length} left)"
        return self.tree.insert(key.prefix(cached + len(slots)), list(held.values) + slots).node

    def _split_at(self, key: CacheKey, length: int) -> Node:
        """The node that ends exactly ``length`` (cached) tokens into ``key``, splitting the
        node a match ends in: inserting an already-cached prefix only splits."""
        held = self.tree.match(key, max_len=length, touch=False)
        assert held.length == length, "split past the match"
        return self.tree.insert(key.prefix(length), held.values, touch=False).node  # a split is no use

    # ------------------------------------------------------------- second tier
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

    # ------------------------------------------------------------- requests
    def _match(self, key: CacheKey, max_len: int) -> MatchResult:
        return self.tree.match(key, max_len=max_len, touch=False)

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

    def _held_node(self, key: CacheKey, m: MatchResult) -> Node:
        """The node a request locks for its match ``m``: as ``_holding`` chose it."""
        capped = self.tree.match(key, touch=False).length > m.length
        return m.node if capped else self._split_at(key, m.length)

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


def _held_here(lock: threading.RLock) -> bool:
    """Whether this thread holds ``lock`` (an outer hold: the writes wait for its release)."""
    return lock._is_owned()  # type: ignore[attr-defined]  # RLock's own check, as Condition uses it
