"""Spills to the second tier are written after the cache's lock is released (issue 43): a request
that arrives while an eviction's chunks are being written is not made to wait for the disk; a
queued chunk is found (served from its queued copy) and no half-written file is ever under its
name; a full write queue drops a spill instead of blocking; ``persist`` writes the queue out.

A bare ``RadixCache`` over a small pool of random KV and a disk store whose writes wait at a
gate the test opens (events, never timings)."""

from __future__ import annotations

import threading

import torch

from engine.kvcache.kv_pool import KVPool
from engine.kvcache.kv_tier import CHUNK_TOKENS, ChunkGeometry, DiskStore
from engine.kvcache.radix_cache import RadixCache
from engine.kvcache.second_tier import SecondTier
from engine.types import CacheKey

C = CHUNK_TOKENS
GEOMETRY = ChunkGeometry(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)
FINGERPRINT = "0123456789abcdef"
WAIT_S = 30  # how long a call that should return at once may take before the test calls it stuck


class GatedDisk(DiskStore):
    """A disk store whose chunk writes wait until ``gate`` is set (``writing`` is set when one starts)."""

    def __init__(self, *args, fail: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.writing = threading.Event()
        self.gate = threading.Event()
        self.fail = fail

    def _stage(self, key: str, kv: torch.Tensor):
        self.writing.set()
        assert self.gate.wait(WAIT_S), "the test never opened the gate"
        if self.fail:
            raise OSError(28, "No space left on device")
        return super()._stage(key, kv)


def make_cache(tmp_path, pool_tokens: int, **store_kw) -> tuple[RadixCache, GatedDisk]:
    pool = KVPool(GEOMETRY.num_layers, GEOMETRY.num_kv_heads, GEOMETRY.head_dim, GEOMETRY.dtype,
                  torch.device("cpu"), pool_tokens * 2 * GEOMETRY.num_layers * GEOMETRY.num_kv_heads
                  * GEOMETRY.head_dim * 4)
    store = GatedDisk(tmp_path / "tier", 2**26, GEOMETRY, **store_kw)
    return RadixCache(pool, tier=SecondTier(store, FINGERPRINT, public_only=False)), store


def ids(seed: int, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in torch.randint(0, 30000, (n,), generator=torch.Generator().manual_seed(seed)))


def cache_doc(cache: RadixCache, key: CacheKey, seed: int) -> torch.Tensor:
    """Cache ``key`` with random KV, as a finished request leaves it; returns that KV."""
    n = len(key.ids)
    rs = cache.acquire(key, 0, n)
    assert rs is not None
    kv = torch.randn(2, GEOMETRY.num_layers, GEOMETRY.num_kv_heads, n, GEOMETRY.head_dim,
                     generator=torch.Generator().manual_seed(seed))
    cache.pool.scatter(rs.slots, kv)
    rs.length = n
    cache.adopt(rs, key)
    cache.release(rs)
    return kv


def in_thread(fn) -> tuple[threading.Thread, threading.Event, list]:
    done, out = threading.Event(), []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # reported by the test
            out.append(exc)
        finally:
            done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, done, out


def test_a_request_is_not_made_to_wait_for_an_evictions_writes(tmp_path):
    cache, store = make_cache(tmp_path, 3 * C)
    doc = CacheKey(ids(1, 2 * C))
    kv = cache_doc(cache, doc, seed=1)
    first_chunk = cache.tier.key_of(doc, C)
    evicting, evicted, got = in_thread(lambda: cache.acquire(CacheKey(ids(2, 2 * C)), 0, 2 * C))  # evicts doc
    try:
        assert store.writing.wait(WAIT_S), "the eviction wrote nothing"

        def meanwhile():
            matched = cache.match_len(doc)
            rs = cache.acquire(CacheKey(ids(3, 10)), 0, 10)  # fits in what is free: no eviction
            cache.release(rs)
            return matched, rs is not None, store.get(first_chunk)

        other, answered, out = in_thread(meanwhile)
        assert answered.wait(WAIT_S), "match_len/acquire waited for the eviction's disk writes"
        assert not store.gate.is_set() and store.queued_chunks >= 1  # the write was still in progress
        matched, admitted, queued = out[0]
        assert matched == 0 and admitted
        assert torch.equal(queued, kv[:, :, :, :C])  # a queued chunk is served from its copy, bit for bit
        assert not (store.folder / f"{first_chunk}.kv").exists()  # and no file is under its name before it is whole
    finally:
        store.gate.set()
        evicting.join(WAIT_S)
    assert evicted.is_set() and not isinstance(got[0], BaseException)
    cache.release(got[0])
    assert store.queued_chunks == 0 and len(list(store.folder.glob("*.kv"))) == 2
    assert not list(store.folder.glob("*.tmp*"))
    cache.check_invariants()
    store.close()
    again = DiskStore(store.folder, 2**26, GEOMETRY)  # a restart reads what was spilled, bit for bit
    for i in (1, 2):
        assert torch.equal(again.get(cache.tier.key_of(doc, i * C)), kv[:, :, :, (i - 1) * C:i * C])
    again.close()


def test_a_full_write_queue_drops_the_spill_instead_of_blocking(tmp_path):
    cache, store = make_cache(tmp_path, 4 * C, max_queued_bytes=GEOMETRY.nbytes)  # room for one chunk
    big, small = CacheKey(ids(4, 2 * C)), CacheKey(ids(5, C))
    kv = cache_doc(cache, big, seed=4)
    cache_doc(cache, small, seed=5)
    evicting, evicted, got = in_thread(lambda: cache.acquire(CacheKey(ids(6, 2 * C)), 0, 2 * C))  # evicts big
    try:
        assert store.writing.wait(WAIT_S)
        second, answered, out = in_thread(lambda: cache.acquire(CacheKey(ids(7, 2 * C)), 0, 2 * C))  # evicts small
        assert answered.wait(WAIT_S), "a spill waited for room in the write queue"
        assert not store.gate.is_set() and not isinstance(out[0], BaseException) and out[0] is not None
        assert cache.tier.key_of(big, C) in store  # queued, being written
        assert cache.tier.key_of(big, 2 * C) not in store and cache.tier.key_of(small, C) not in store  # refused
        assert store.refused_spills == 2 and cache.match_len(small) == 0  # simply evicted
    finally:
        store.gate.set()
        evicting.join(WAIT_S)
    assert evicted.is_set() and got[0] is not None
    cache.release(got[0])
    cache.release(out[0])
    assert torch.equal(store.get(cache.tier.key_of(big, C)), kv[:, :, :, :C])
    assert store.num_chunks == 1 and len(list(store.folder.glob("*.kv"))) == 1
    cache.check_invariants()


def test_a_write_that_fails_after_the_lock_costs_that_chunk_only(tmp_path):
    cache, store = make_cache(tmp_path, 3 * C, fail=True)
    store.gate.set()
    doc = CacheKey(ids(8, 2 * C))
    cache_doc(cache, doc, seed=8)
    rs = cache.acquire(CacheKey(ids(9, 2 * C)), 0, 2 * C)  # evicts doc; both writes fail
    assert rs is not None and store.failed_writes == 2 and store.num_chunks == 0 and store.queued_chunks == 0
    assert not list(store.folder.glob("*.kv")) and not list(store.folder.glob("*.tmp*"))
    cache.release(rs)
    cache.check_invariants()  # the spilled view was told: it shows nothing the tier lacks


def test_persist_writes_the_queue_out_in_rounds(tmp_path):
    cache, store = make_cache(tmp_path, 8 * C, max_queued_bytes=GEOMETRY.nbytes)  # one chunk at a time
    store.gate.set()
    docs = [CacheKey(ids(10 + i, 2 * C)) for i in range(3)]
    kvs = [cache_doc(cache, d, seed=10 + i) for i, d in enumerate(docs)]
    assert cache.persist() == 6
    assert store.queued_chunks == 0 and len(list(store.folder.glob("*.kv"))) == 6
    assert sorted(p.ids for p in store.read_paths()) == sorted(d.ids for d in docs)
    store.close()
    again = DiskStore(store.folder, 2**26, GEOMETRY)
    for d, kv in zip(docs, kvs, strict=True):
        assert torch.equal(again.get(cache.tier.key_of(d, 2 * C)), kv[:, :, :, C:])
    again.close()


def test_offload_spills_a_tree_larger_than_the_queue_whole(tmp_path):
    cache, store = make_cache(tmp_path, 8 * C, max_queued_bytes=GEOMETRY.nbytes)
    store.gate.set()
    docs = [CacheKey(ids(20 + i, 2 * C)) for i in range(3)]
    for i, d in enumerate(docs):
        cache_doc(cache, d, seed=20 + i)
    assert cache.offload() == 6 * C and cache.num_tokens == 0
    assert store.num_chunks == 6 and store.queued_chunks == 0  # refused in a round, written in the next
    cache.check_invariants()
