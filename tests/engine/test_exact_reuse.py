"""Reuse must not change what the model computes: logits with a cached prefix equal
logits computed from scratch, for every kind of split point (tiny random Llama)."""

from __future__ import annotations

import pytest
import torch

from engine.kv_pool import KVPool
from engine.prefix_cache import RadixCache
from engine.radix_tree import CacheKey


def make_cache(runner, budget_tokens=4096):
    pool = KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype, runner.device,
                  budget_tokens * runner.kv_bytes_per_token)
    return RadixCache(pool)


def run_cached(runner, cache, ids):
    """Prefill ``ids`` through the cache; return (logits of the computed positions, cached length)."""
    key = CacheKey(tuple(ids))
    kv = runner.new_request_kv(len(ids))
    handle = cache.acquire(key, len(ids) - 1, kv)
    try:
        logits = runner.forward(ids[handle.cached_tokens:], kv)
        cache.insert(key, kv)
    finally:
        cache.release(handle)
    cache.check_invariants()
    return logits, handle.cached_tokens


def full_logits(runner, ids):
    kv = runner.new_request_kv(len(ids))
    return runner.forward(ids, kv)


def rand_ids(gen, n, vocab):
    return torch.randint(10, vocab, (n,), generator=gen).tolist()


@pytest.mark.parametrize("case", ["mid_edge", "node_boundary", "fully_cached", "one_token_suffix", "extends_leaf"])
def test_logits_with_reuse_equal_logits_without(tiny_runner, case):
    runner = tiny_runner
    gen = torch.Generator().manual_seed(hash(case) % 1000)
    vocab = len(runner.tokenizer)
    base = rand_ids(gen, 40, vocab)
    cache = make_cache(runner)
    run_cached(runner, cache, base)
    other = base[:25] + rand_ids(gen, 10, vocab)
    run_cached(runner, cache, other)  # splits the first node at 25
    if case == "mid_edge":
        ids, expect = base[:32] + rand_ids(gen, 8, vocab), 32
    elif case == "node_boundary":
        ids, expect = base[:25] + rand_ids(gen, 12, vocab), 25
    elif case == "fully_cached":
        ids, expect = list(base), len(base) - 1  # at least one token is always computed
    elif case == "one_token_suffix":
        ids, expect = base + rand_ids(gen, 1, vocab), len(base)
    else:
        ids, expect = other + rand_ids(gen, 17, vocab), len(other)
    logits, cached = run_cached(runner, cache, ids)
    assert cached == expect
    reference = full_logits(runner, ids)[cached:]
    assert logits.shape == reference.shape
    assert torch.allclose(logits, reference, atol=1e-4), (logits - reference).abs().max()


def test_reuse_exact_after_budget_change_moves_slots(tiny_runner):
    runner = tiny_runner
    gen = torch.Generator().manual_seed(7)
    vocab = len(runner.tokenizer)
    cache = make_cache(runner, budget_tokens=200)
    a, b = rand_ids(gen, 60, vocab), rand_ids(gen, 60, vocab)
    run_cached(runner, cache, a)
    run_cached(runner, cache, b)
    cache.clear()  # frees a's slots... both unlocked, all gone
    run_cached(runner, cache, a)
    run_cached(runner, cache, b)
    cache.tree.evict(1)  # LRU: a goes, leaving b at slots 60..119
    cache.set_budget(80 * runner.kv_bytes_per_token)  # b moves to slots 0..59
    cache.check_invariants()
    ids = b[:50] + rand_ids(gen, 5, vocab)
    logits, cached = run_cached(runner, cache, ids)
    assert cached == 50
    assert torch.allclose(logits, full_logits(runner, ids)[50:], atol=1e-4)


def test_decode_through_buffer_matches_full_forward(tiny_runner):
    """Token-by-token decode appends in place; every step's logits match a full forward."""
    runner = tiny_runner
    gen = torch.Generator().manual_seed(3)
    ids = rand_ids(gen, 20, len(runner.tokenizer))
    kv = runner.new_request_kv(4)  # too small on purpose: the buffer grows
    runner.forward(ids[:10], kv)
    for i in range(10, 20):
        step = runner.forward_last([ids[i]], kv)
        assert torch.allclose(step, full_logits(runner, ids[: i + 1])[-1], atol=1e-4)
    assert kv.length == 20
