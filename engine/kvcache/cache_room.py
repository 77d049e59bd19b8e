"""Room in the pool for what the tree caches next: eviction under a held match, behind the cache's lock.

Owns: ``CacheRoom``, the part of ``RadixCache`` (``engine.kvcache.radix_cache``) that makes room
and extends the tree: the lock a call that may evict takes (``_locked``: spills written once it is
released), the eviction rule for a namespace (``_rule``), eviction's final step (``_evicted``: the
removed nodes' KV to the second tier, then their slots freed), holding a match while room is made
(``_holding``) and storing after it (``_extend``, ``_split_at``). What to evict is
``engine.kvcache.eviction``'s (it owns the trial-and-restore); the pool side is ``SlotLedger``'s
(``engine.kvcache.request_slots``); the tier's keys and queue are ``SecondTier``'s. Knows nothing
about requests' admission, adoption or the tier's loads (``radix_cache``, ``tier_moves``).

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
from collections.abc import Iterator
from contextlib import contextmanager

from engine.kvcache import eviction
from engine.kvcache.radix_tree import MatchResult, Node, RadixTree
from engine.kvcache.request_slots import SlotLedger
from engine.kvcache.second_tier import SecondTier, path_of
from engine.types import CacheKey


class CacheRoom(SlotLedger):
    """Making room and extending the tree under a held match (see the module docstring)."""

    tree: RadixTree  # these three are set by ``RadixCache.__init__``
    fair_share: bool
    tier: SecondTier | None

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

    # ------------------------------------------------------------- the held match
    def _match(self, key: CacheKey, max_len: int) -> MatchResult:
        return self.tree.match(key, max_len=max_len, touch=False)

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

    def _held_node(self, key: CacheKey, m: MatchResult) -> Node:
        """The node a request locks for its match ``m``: as ``_holding`` chose it."""
        capped = self.tree.match(key, touch=False).length > m.length
        return m.node if capped else self._split_at(key, m.length)

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


def _held_here(lock: threading.RLock) -> bool:
    """Whether this thread holds ``lock`` (an outer hold: the writes wait for its release)."""
    return lock._is_owned()  # type: ignore[attr-defined]  # RLock's own check, as Condition uses it
