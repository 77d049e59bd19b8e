"""A match is held while room is made for what comes after it (issue #27's slot -1).

Before the fix, ``load_prefix`` matched, then made room with the match unlocked; when eviction
took the matched leaf, the chunks loaded from the second tier were stored behind slot -1
(attention then read the pool's last slot: wrong KV, and the free list broke). Each test
here builds exactly that: a short cached prefix that is the least recently used leaf, and a
need for room that only evicting it, or something else, can meet. Checked on the tiny
model's real KV against a prefill with no cache at all."""

from __future__ import annotations

import torch

from engine.kvcache.kv_pool import KVPool
from engine.kvcache.kv_tier import CHUNK_TOKENS, ChunkGeometry, DiskStore
from engine.kvcache.radix_cache import RadixCache
from engine.kvcache.second_tier import SecondTier, path_of
from engine.types import CacheKey


def _pool(runner, tokens):
    return KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype, runner.device,
                  tokens * runner.kv_bytes_per_token)


def _kv(runner, ids):
    kv = runner.new_request_kv(len(ids))
    runner.forward(ids, kv)
    return kv


def _assert_tree_kv_exact(runner, cache):
    """Every cached slot holds the KV a no-cache prefill of its path gives (fp32)."""
    for node in cache.tree.nodes():
        path, slots = path_of(node, cache.tree.root)
        ref = _kv(runner, list(path.ids))
        k, v = ref.k[:, :, :len(slots)], ref.v[:, :, :len(slots)]
        got_k = torch.empty_like(k)
        got_v = torch.empty_like(v)
        cache.pool.read_into(slots, got_k, got_v)
        # 1e-5: a prefill of another length may round a matmul differently; a wrong slot is off by ~1
        assert torch.allclose(got_k, k, atol=1e-5) and torch.allclose(got_v, v, atol=1e-5), \
            f"node {node.id} holds wrong KV"


def _setup(runner, tmp_path, capacity=2 * CHUNK_TOKENS + 12):
    gen = torch.Generator().manual_seed(7)
    vocab = len(runner.text.tokenizer)
    prompt = torch.randint(10, vocab, (2 * CHUNK_TOKENS + 2,), generator=gen).tolist()
    other = torch.randint(10, vocab, (capacity - 12,), generator=gen).tolist()
    geometry = ChunkGeometry(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype)
    store = DiskStore(tmp_path / "tier", 64 * CHUNK_TOKENS * runner.kv_bytes_per_token, geometry)
    cache = RadixCache(_pool(runner, capacity), tier=SecondTier(store, "fp", public_only=False))
    key = CacheKey(tuple(prompt))
    cache.insert(key, _kv(runner, prompt))
    assert cache.offload() == len(prompt)  # both whole chunks now live in the tier only
    cache.insert(CacheKey(tuple(prompt[:10])), _kv(runner, prompt[:10]))  # the short match: LRU leaf
    cache.insert(CacheKey(tuple(other)), _kv(runner, other))  # fills the pool
    cache.check_invariants()
    return cache, key


def test_load_prefix_keeps_the_match_it_extends(tiny_runner, tmp_path):
    cache, key = _setup(tiny_runner, tmp_path)
    loaded = cache.load_prefix(key, len(key.ids) - 1)
    assert loaded == 2 * CHUNK_TOKENS - 10
    assert -1 not in cache.tree.all_values()
    cache.check_invariants()
    assert cache.match_len(key) == 2 * CHUNK_TOKENS
    _assert_tree_kv_exact(tiny_runner, cache)
    # the free list is whole: everything can be allocated once, and no slot twice
    slots = cache.pool.alloc(cache.pool.num_free)
    assert len(set(slots) | set(cache.tree.all_values())) == cache.pool.capacity


def test_acquire_through_the_tier_keeps_the_match_it_extends(tiny_runner, tmp_path):
    cache, key = _setup(tiny_runner, tmp_path)
    rs = cache.acquire(key, len(key.ids) - 1, len(key.ids) + 4)
    assert rs is not None and rs.cached_tokens == 2 * CHUNK_TOKENS and rs.tier_tokens == 2 * CHUNK_TOKENS - 10
    assert all(s >= 0 for s in rs.slots)
    cache.check_invariants()
    _assert_tree_kv_exact(tiny_runner, cache)
    cache.release(rs)
    cache.check_invariants()


def test_insert_keeps_the_match_it_extends(tiny_runner, tmp_path):
    cache, key = _setup(tiny_runner, tmp_path)
    prompt = list(key.ids)
    assert cache.insert(key, _kv(tiny_runner, prompt)) > 0
    assert -1 not in cache.tree.all_values()
    cache.check_invariants()
    _assert_tree_kv_exact(tiny_runner, cache)


def test_tier_load_time_counts_the_read_not_the_evictions_writes(tiny_runner, tmp_path):
    cache, key = _setup(tiny_runner, tmp_path)
    store = cache.tier.store
    slow_put = store.put

    def put(k, kv):  # eviction's spill writes happen during admission: make them slow and visible
        import time
        time.sleep(0.05)
        return slow_put(k, kv)

    store.put = put
    rs = cache.acquire(key, len(key.ids) - 1, len(key.ids) + 4)
    assert rs is not None and rs.tier_tokens > 0
    assert store.stored_chunks > 2  # the filler was spilled while room was made
    assert rs.tier_load_ms < 50, rs.tier_load_ms
    cache.release(rs)
