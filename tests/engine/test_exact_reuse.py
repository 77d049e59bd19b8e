"""Reuse must not change what the model computes: logits with a cached prefix equal
logits computed from scratch, for every kind of split point (tiny random Llama).

In float32 "equal" means within 1e-4. In bfloat16 (``--dtype bfloat16``, the CPU fast mode)
a matmul over a different number of rows may round differently, so "equal" means within
5e-2 (a few bf16 steps at these logit sizes) and the same next token: the token reuse picks
scores at the top of the reference logits too, within that tolerance."""

from __future__ import annotations

import pytest
import torch

from engine.kvcache.kv_pool import KVPool
from engine.kvcache.prefix_cache import RadixCache
from engine.model.paged_attention import PagedSegment
from engine.types import CacheKey
from tests.engines import rand_ids


def make_cache(runner, budget_tokens=4096):
    pool = KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype, runner.device,
                  budget_tokens * runner.kv_bytes_per_token)
    return RadixCache(pool)


def run_cached(runner, cache, ids):
    """Prefill ``ids`` the scheduler's way (the cached prefix read in place from the pool, the
    rest computed into the request's own slots, which then pass to the tree); return
    (logits of the computed positions, cached length)."""
    key = CacheKey(tuple(ids))
    rs = cache.acquire(key, len(ids) - 1, len(ids))
    try:
        segment = PagedSegment(ids[rs.cached_tokens:], rs.cached_tokens, rs.slots, rs.runs())
        logits = runner.forward_paged(cache.pool, [segment], every_position=True)
        rs.length = len(ids)
        cache.adopt(rs, key)
    finally:
        cache.release(rs)
    cache.check_invariants()
    return logits, rs.cached_tokens


def full_logits(runner, ids):
    kv = runner.new_request_kv(len(ids))
    return runner.forward(ids, kv)


ATOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


@pytest.fixture(params=["float32", "bfloat16"])
def runner(request):
    return request.getfixturevalue("tiny_runner" if request.param == "float32" else "tiny_runner_bf16")


def assert_same_logits(runner, logits, reference):
    """Within the dtype's tolerance, and the token chosen with reuse is a top token without it."""
    atol = ATOL[runner.dtype]
    assert logits.shape == reference.shape
    assert torch.allclose(logits, reference, atol=atol), (logits - reference).abs().max()
    picked = reference.gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1)
    assert bool((picked >= reference.max(-1).values - atol).all())


@pytest.mark.parametrize("case", ["mid_edge", "node_boundary", "fully_cached", "one_token_suffix", "extends_leaf"])
def test_logits_with_reuse_equal_logits_without(runner, case):
    gen = torch.Generator().manual_seed(hash(case) % 1000)
    vocab = len(runner.text.tokenizer)
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
    assert_same_logits(runner, logits, full_logits(runner, ids)[cached:])


def test_reuse_exact_after_budget_change_moves_slots(runner):
    gen = torch.Generator().manual_seed(7)
    vocab = len(runner.text.tokenizer)
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
    assert_same_logits(runner, logits, full_logits(runner, ids)[50:])


def test_decode_through_buffer_matches_full_forward(runner):
    """Token-by-token decode appends in place; every step's logits match a full forward."""
    gen = torch.Generator().manual_seed(3)
    ids = rand_ids(gen, 20, len(runner.text.tokenizer))
    kv = runner.new_request_kv(4)  # too small on purpose: the buffer grows
    runner.forward(ids[:10], kv)
    for i in range(10, 20):
        step = runner.forward_last([ids[i]], kv)
        assert_same_logits(runner, step, full_logits(runner, ids[: i + 1])[-1])
    assert kv.length == 20


def test_greedy_answers_with_and_without_reuse_agree_in_bf16(tiny_runner_bf16, tiny_runner, make_engine):
    """End to end in bf16 (pool, request KV, baseline): the engine's answers with a warm cache equal
    a cache-less engine's, the cache holds bf16 KV at half the bytes, and the baseline is measured."""
    from analysis.no_reuse import run_measured
    from engine.types import GenerationRequest, SamplingParams

    runner = tiny_runner_bf16
    gen = torch.Generator().manual_seed(11)
    vocab = len(runner.text.tokenizer)
    shared = rand_ids(gen, 48, vocab)
    engine = make_engine(runner, budget_bytes=2000 * runner.kv_bytes_per_token)
    plain = make_engine(runner, enable_cache=False)
    assert engine.info().dtype == "bfloat16" and runner.kv_bytes_per_token * 2 == tiny_runner.kv_bytes_per_token
    for i in range(3):
        req = GenerationRequest(prompt_ids=tuple(shared + rand_ids(gen, 6 + i, vocab)),
                                sampling=SamplingParams(max_new_tokens=12), measure_baseline=True)
        got, want = run_measured(engine, req), plain.run(req)  # the baseline: analysis.no_reuse, after the answer
        assert got.cached_tokens == (0 if i == 0 else 48)
        assert got.output_ids == want.output_ids and got.baseline_prefill_ms is not None
    engine.check_invariants()
    assert engine.cache.pool.k[0].dtype == torch.bfloat16
