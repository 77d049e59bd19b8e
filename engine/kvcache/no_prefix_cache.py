"""The cache-off twin of ``RadixCache``: the same interface and the same pool for running
requests' KV, nothing reused, nothing stored. Comparing with and without reuse is then one
constructor argument (``engine.engine.Engine(enable_cache=...)``).

Owns nothing beyond ``SlotLedger``'s (engine.kvcache.request_slots): running requests' own
slots. Its tree is always empty, so every view of it draws an empty cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.kvcache.kv_pool import KVPool
from engine.kvcache.request_kv import RequestKV
from engine.kvcache.request_slots import RequestSlots, SlotLedger
from engine.types import CacheKey, TreeSnapshot


class NoPrefixCache(SlotLedger):
    enabled = False
    tier = None
    tier_loaded_tokens = tier_spilled_tokens = 0
    num_tokens = num_nodes = evicted_tokens = shared_tokens = tree_bytes = 0

    def __init__(self, pool: KVPool) -> None:
        super().__init__(pool)

    def locked_tokens(self) -> int:
        return 0

    def tier_stats(self) -> dict:
        return {}

    def acquire(self, key: CacheKey, max_len: int, total_tokens: int) -> RequestSlots | None:
        with self._lock:
            slots = self.pool.alloc(max(0, total_tokens))
            if slots is None:
                return None
            return self._admit(RequestSlots(slots, 0, 0, (), None))

    def adopt(self, rs: RequestSlots, key: CacheKey) -> int:
        return 0

    def release(self, rs: RequestSlots) -> None:
        with self._lock:
            if self._retire(rs):
                rs.slots, rs._runs = [], None

    def insert(self, key: CacheKey, kv: RequestKV) -> int:
        return 0

    def match_len(self, key: CacheKey) -> int:
        return 0

    def copy_prefix(self, key: CacheKey, max_len: int, kv: RequestKV, touch: bool = False) -> int:
        return 0

    def load_prefix(self, key: CacheKey, max_len: int) -> int:
        return 0

    def offload(self) -> int:
        return 0

    def persist(self) -> int:
        return 0

    def clear(self, namespace: str | None = None) -> int:
        return 0

    def publish_to(self, listener) -> None:
        pass  # nothing is ever cached: nothing to publish

    def set_budget(self, budget_bytes: int) -> int:
        with self._lock:
            self._check_shrink(int(budget_bytes), 0)
            self._resize(int(budget_bytes), [])
            return 0

    def check_invariants(self) -> None:
        with self._lock:
            self._check_slots([])

    def snapshot(self, decode: Callable[[Sequence[int]], str] | None = None, viewer: str | None = None,
                 max_text_tokens: int = 256) -> TreeSnapshot:
        # nothing cached: nothing to draw, decode or hide
        return TreeSnapshot((), 0, 0, self.pool.budget_bytes, self.pool.capacity, 0, self.pool.bytes_per_token, "")
