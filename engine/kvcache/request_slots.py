"""Running requests' slots in the one KV pool, and the ledger both prefix caches keep of them.

Owns: ``RequestSlots`` (one running request's KV: the tree's slots it reads, its own slots)
and ``SlotLedger``, the part of a prefix cache that is the same with and without reuse: the
pool, the lock, the set of live requests and their own slots, the change counter, the
budget's resize (renumbering live slots in place) and the pool-side checks. It knows
nothing of trees: ``RadixCache`` and ``NoPrefixCache`` (``engine.kvcache.radix_cache``,
``engine.kvcache.no_prefix_cache``) each add the tree side.

A running request's KV::

    positions: [0 ........ tree_len) [tree_len ........ length) [length .. len(slots))
    slots:      the tree's, locked     its own, computed          its own, not yet written
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.kvcache.kv_pool import KVPool, contiguous_runs
from engine.kvcache.radix_tree import Node
from engine.types import EngineError


@dataclass(eq=False)
class RequestSlots:
    """A running request's KV in the pool (see the module docstring's sketch)."""

    slots: list[int]
    tree_len: int  # positions [0, tree_len) are the tree's, locked through ``node``
    cached_tokens: int  # reused from the cache at admission
    path: tuple[int, ...]  # node ids of the match, root's child first
    node: Node | None
    length: int = 0  # positions whose KV is written
    tier_tokens: int = 0  # of the cached ones, loaded back from the second tier at admission
    tier_load_ms: float = 0.0
    _runs: list[tuple[int, int, int]] | None = field(default=None, repr=False)

    @property
    def own_tokens(self) -> int:
        """Slots this request holds itself (computed or not yet written)."""
        return len(self.slots) - self.tree_len

    def own_slots(self) -> list[int]:
        return self.slots[self.tree_len:]

    def runs(self) -> list[tuple[int, int, int]]:
        """``contiguous_runs(slots)``, kept until the slots change."""
        if self._runs is None:
            self._runs = contiguous_runs(self.slots)
        return self._runs

    def renumber(self, mapping: dict[int, int]) -> None:
        self.slots = [mapping[s] for s in self.slots]
        self._runs = None


class SlotLedger:
    """The pool side of a prefix cache (see the module docstring). Subclasses hold ``_lock``
    around every change and call ``_admit``/``_retire`` for live requests."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self._lock = threading.RLock()
        self._live: set[RequestSlots] = set()  # acquired, not released
        self._running_tokens = 0  # own slots of the live ones
        self.version = 0  # bumped by every change of the tree, its locks or the budget (panels compare it)

    # ---------------------------------------------------------------- facts
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
    def running_tokens(self) -> int:
        return self._running_tokens

    # ---------------------------------------------------------------- live requests
    def _admit(self, rs: RequestSlots) -> RequestSlots:
        self._live.add(rs)
        self._running_tokens += rs.own_tokens
        self.version += 1
        return rs

    def _retire(self, rs: RequestSlots) -> bool:
        """Forget ``rs`` and free its own slots; False if it was not live (released already)."""
        if rs not in self._live:
            return False
        self._live.discard(rs)
        self.pool.free(rs.own_slots())
        self._running_tokens -= rs.own_tokens
        self.version += 1
        return True

    def _live_own_slots(self) -> list[int]:
        return [s for rs in self._live for s in rs.own_slots()]

    # ---------------------------------------------------------------- budget
    def _check_shrink(self, budget_bytes: int, pinned_tokens: int) -> int:
        """The new capacity in slots; raises ``EngineError`` when running requests and the
        ``pinned_tokens`` they lock in the tree alone exceed it."""
        if budget_bytes < 0:
            raise EngineError("the cache budget cannot be negative")
        new_capacity = budget_bytes // self.pool.bytes_per_token
        held = pinned_tokens + self._running_tokens
        if held > new_capacity:
            raise EngineError(
                f"cannot shrink to {budget_bytes / 2**20:.1f} MB now: running requests hold "
                f"{held * self.pool.bytes_per_token / 2**20:.1f} MB; try again when idle")
        return new_capacity

    def _resize(self, budget_bytes: int, kept: Sequence[int]) -> dict[int, int]:
        """Re-allocate the pool keeping ``kept`` (the tree's slots) and every live request's own
        slots; live requests are renumbered in place. Returns the map old slot -> new slot."""
        mapping = self.pool.rebuild(budget_bytes, list(kept) + self._live_own_slots())
        for rs in self._live:
            rs.renumber(mapping)
        self.version += 1
        return mapping

    # ---------------------------------------------------------------- checking
    def _check_slots(self, tree_values: Sequence[int]) -> None:
        """Assert every slot has exactly one owner: free, the tree's, or one live request's."""
        self.pool.check()
        own = self._live_own_slots()
        assert len(tree_values) == len(set(tree_values)), "a pool slot is held twice by the tree"
        assert not set(own) & set(tree_values), "a running request's own slot is also the tree's"
        assert len(own) == len(set(own)), "a pool slot is held by two running requests"
        assert len(own) == self._running_tokens, f"running tokens {self._running_tokens} != {len(own)}"
        assert all(isinstance(v, int) and 0 <= v < self.pool.capacity for v in list(tree_values) + own), \
            "slot out of range"
        assert self.pool.num_used == len(tree_values) + len(own), (
            f"pool slots in use {self.pool.num_used} != tree {len(tree_values)} + running {len(own)}")
        assert self.pool.bytes_in_use <= self.pool.budget_bytes
