"""Attention over the pool (``ModelRunner.forward_paged``): exact against a forward with no
cache, for shared prefixes read once, fragmented slots, chunks and decodes mixed, both
kernels and bf16 (tiny random Llama)."""

from __future__ import annotations

import pytest
import torch

from engine.kvcache.kv_pool import KVPool, contiguous_runs
from engine.model.attention.cpu_sdpa import CpuSdpaBackend
from engine.model.attention.math_chunked import MathChunkedBackend
from engine.model.paged_attention import PagedPlan, PagedSegment
from tests.conftest import fast_paths
from tests.engines import rand_ids

ATOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


@pytest.fixture(params=["float32", "bfloat16"])
def runner(request):
    return request.getfixturevalue("tiny_runner" if request.param == "float32" else "tiny_runner_bf16")


def new_pool(runner, tokens: int = 2000) -> KVPool:
    return KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype, runner.device,
                  tokens * runner.kv_bytes_per_token)


def check(runner, logits, seqs):
    for row, seq in zip(logits, seqs, strict=True):
        ref, _ = runner.reference_prefill(seq)
        assert torch.allclose(row, ref, atol=ATOL[runner.dtype]), (row - ref).abs().max()


def test_shared_prefix_chunks_and_decodes_mixed(runner):
    pool = new_pool(runner)
    shared = rand_ids(1, 40)
    prefix = pool.alloc(40)
    runner.forward_paged(pool, [PagedSegment(shared[:30], 0, prefix)])  # a prefix computed in two chunks
    runner.forward_paged(pool, [PagedSegment(shared[30:], 30, prefix)])
    seqs = [shared + rand_ids(10 + i, 3 + 4 * i) for i in range(4)] + [rand_ids(20, 23)]
    tables = [prefix + pool.alloc(len(s) - 40 + 2) for s in seqs[:4]] + [pool.alloc(len(seqs[4]) + 2)]
    pasts = [40, 40, 40, 40, 0]
    logits = runner.forward_paged(pool, [PagedSegment(s[p:], p, t) for s, p, t in zip(seqs, pasts, tables, strict=True)])
    check(runner, logits, seqs)
    nxt = [int(row.argmax()) for row in logits]
    seqs = [s + [t] for s, t in zip(seqs, nxt, strict=True)]
    logits = runner.forward_paged(pool, [PagedSegment([s[-1]], len(s) - 1, t) for s, t in zip(seqs, tables, strict=True)])
    check(runner, logits, seqs)


def test_fragmented_slots_are_gathered_exactly(runner):
    pool = new_pool(runner, 200)
    everything = pool.alloc(200)
    pool.free(everything[::3])  # every third slot free: nothing contiguous
    seq = rand_ids(3, 50)
    table = pool.alloc(len(seq) + 1)
    assert len(contiguous_runs(table)) > 10
    logits = runner.forward_paged(pool, [PagedSegment(seq[:20], 0, table)])
    check(runner, logits, [seq[:20]])
    logits = runner.forward_paged(pool, [PagedSegment(seq[20:], 20, table)])
    check(runner, logits, [seq])
    logits = runner.forward_paged(pool, [PagedSegment([7], 50, table)])
    check(runner, logits, [seq + [7]])


def spy_merges(runner, monkeypatch) -> list:
    """Records the shared-prefix reads a backend merges in place (``merge_prefix`` that took the
    call): the queries as one call folds them ``(1, H, g * n, D)`` and the runs' lengths."""
    merged = []
    real = runner.attention.merge_prefix

    def spy(q, k_layer, v_layer, runs, scale, out, lse):
        took = real(q, k_layer, v_layer, runs, scale, out, lse)
        if took:
            hq, n, d = q.shape
            merged.append(((1, k_layer.shape[0], hq // k_layer.shape[0] * n, d), tuple(length for _, length in runs)))
        return took

    monkeypatch.setattr(runner.attention, "merge_prefix", spy)
    return merged


def test_a_shared_prefix_is_read_once_per_layer_for_all_its_requests(tiny_runner, monkeypatch):
    """Eight requests decoding behind one cached 64-token prefix: per layer, one attention call
    reads the prefix (with all eight requests' queries) and one call reads their own tokens."""
    runner = tiny_runner
    fast_paths(runner, monkeypatch)  # the fast paths' plan (exact mode reads by position)
    pool = new_pool(runner)
    shared = rand_ids(5, 64)
    prefix = pool.alloc(64)
    runner.forward_paged(pool, [PagedSegment(shared, 0, prefix)])
    seqs = [shared + rand_ids(30 + i, 5 + i) for i in range(8)]
    tables = [prefix + pool.alloc(len(s) - 64 + 1) for s in seqs]
    runner.forward_paged(pool, [PagedSegment(s[64:], 64, t) for s, t in zip(seqs, tables, strict=True)])
    calls = []
    real = runner.attention.attend

    def spy(q, k, v, scale, mask=None, causal=None):
        calls.append((q.shape, k.shape))
        return real(q, k, v, scale, mask=mask, causal=causal)

    monkeypatch.setattr(runner.attention, "attend", spy)
    merged = spy_merges(runner, monkeypatch)
    in_place = []  # a backend that reads decode rows in place (cpu_native): their rests in one call
    if runner.attention.takes_rows(runner.dtype, runner.query_groups, runner.head_dim):
        real_rows = runner.attention.attend_rows
        monkeypatch.setattr(runner.attention, "attend_rows", lambda *a: in_place.append(1) or real_rows(*a))
    seqs = [s + [11] for s in seqs]
    logits = runner.forward_paged(pool, [PagedSegment([11], len(s) - 1, t) for s, t in zip(seqs, tables, strict=True)])
    check(runner, logits, seqs)
    # per layer: the prefix, and the rests
    assert len(calls) + len(in_place) + len(merged) == 2 * runner.num_layers
    groups = runner.model.config.num_attention_heads // runner.num_kv_heads
    prefix_reads = [q for q, k in calls if k[2] == 64] + [q for q, lengths in merged if lengths == (64,)]
    assert len(prefix_reads) == runner.num_layers  # the prefix: once per layer
    assert all(q[0] == 1 and q[2] == 8 * groups for q in prefix_reads)  # every request's queries in that call


def test_a_shared_prefix_in_several_runs_is_read_once_per_layer_per_run(runner, monkeypatch):
    """A cached prefix the tree built in two pieces (a longer system prompt extending a shorter
    cached one) lies in two runs of slots: every request still reads it in place, one call per
    run per layer with all requests' queries, instead of gathering its whole context per row."""
    fast_paths(runner, monkeypatch)  # the fast paths' plan (exact mode reads by position)
    pool = new_pool(runner)
    shared = rand_ids(6, 70)
    first, _, second = pool.alloc(40), pool.alloc(5), pool.alloc(30)
    prefix = first + second
    runner.forward_paged(pool, [PagedSegment(shared[:40], 0, prefix)])
    runner.forward_paged(pool, [PagedSegment(shared[40:], 40, prefix)])
    seqs = [shared + rand_ids(40 + i, 4 + i) for i in range(6)]
    tables = [prefix + pool.alloc(len(s) - 70 + 1) for s in seqs]
    runner.forward_paged(pool, [PagedSegment(s[70:], 70, t) for s, t in zip(seqs, tables, strict=True)])
    plan = PagedPlan([PagedSegment([1], len(s), t) for s, t in zip(seqs, tables, strict=True)], pool.device)
    assert [g[2] for g in plan.groups] == [((first[0], 40), (second[0], 30))]
    calls = []
    real = runner.attention.attend

    def spy(q, k, v, scale, mask=None, causal=None):
        calls.append((q.shape, k.shape))
        return real(q, k, v, scale, mask=mask, causal=causal)

    monkeypatch.setattr(runner.attention, "attend", spy)
    merged = spy_merges(runner, monkeypatch)
    seqs = [s + [13] for s in seqs]
    logits = runner.forward_paged(pool, [PagedSegment([13], len(s) - 1, t) for s, t in zip(seqs, tables, strict=True)])
    check(runner, logits, seqs)
    groups = runner.model.config.num_attention_heads // runner.num_kv_heads
    own_rows = runner.attention.takes_rows(runner.dtype, runner.query_groups, runner.head_dim)
    if merged:  # the backend reads both runs in one call per layer and merges in place
        assert len(merged) == runner.num_layers
        assert all(q[2] == 6 * groups and lengths == (40, 30) for q, lengths in merged)
        assert len(calls) == (0 if own_rows else 1) * runner.num_layers
        return
    # the own tokens (one call, unless the backend reads decode rows in place), then each run of the prefix
    assert len(calls) == (2 if own_rows else 3) * runner.num_layers
    for length in (40, 30):
        reads = [q for q, k in calls if k[2] == length]
        assert len(reads) == runner.num_layers and all(q[2] == 6 * groups for q in reads)


def test_prompts_that_share_only_a_few_template_tokens_form_groups_of_their_own():
    """Two system prompts, each cached, both starting with the same 3 template slots (in a third
    prompt's node): each set of requests is a group reading its own long prefix, not one group
    sharing the 3 tokens."""
    head, a, b = [0, 1, 2], list(range(100, 140)), list(range(300, 330))
    segments = [PagedSegment([1], 43 + i, head + a + list(range(500 + 10 * i, 500 + 10 * i + i + 1))) for i in range(3)]
    segments += [PagedSegment([1], 33 + i, head + b + list(range(700 + 10 * i, 700 + 10 * i + i + 1))) for i in range(2)]
    plan = PagedPlan(segments, torch.device("cpu"))
    assert [g[2] for g in plan.groups] == [((0, 3), (100, 40)), ((0, 3), (300, 30))]
    assert plan.decode_width <= 3


def test_plan_groups_requests_by_their_shared_run():
    a, b = list(range(100, 140)), list(range(500, 520))
    segments = [PagedSegment([1], 45, a + [7, 8, 9, 10, 11, 12]), PagedSegment([1, 2], 20, b + [30, 31]),
                PagedSegment([1], 42, a + [60, 61, 62]), PagedSegment([5, 6, 7], 0, [90, 91, 92])]
    plan = PagedPlan(segments, torch.device("cpu"))
    assert [g[2] for g in plan.groups] == [((100, 40),), ((500, 20),)]
    assert plan.order == [0, 2, 1, 3]  # group members packed side by side
    assert plan.write_index.tolist() == [12, 62, 30, 31, 90, 91, 92]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_kernel_and_math_path_agree(dtype):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 6, 16, generator=gen).to(dtype)
    k = torch.randn(3, 2, 40, 16, generator=gen).to(dtype)
    v = torch.randn(3, 2, 40, 16, generator=gen).to(dtype)
    mask = torch.zeros(3, 1, 6, 40)
    mask[1, ..., 30:] = float("-inf")
    o1, l1 = CpuSdpaBackend().attend(q, k, v, 0.25, mask=mask)
    o2, l2 = MathChunkedBackend().attend(q, k, v, 0.25, mask=mask)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(o1.float(), o2.float(), atol=tol) and torch.allclose(l1, l2, atol=tol)


def test_the_math_path_used_off_cpu_runs_the_whole_forward_exactly(runner, monkeypatch):
    """CUDA and MPS take the math backend; here it stands in for the CPU kernel end to end."""
    monkeypatch.setattr(runner, "attention", MathChunkedBackend())
    fast_paths(runner, monkeypatch)
    test_shared_prefix_chunks_and_decodes_mixed(runner)
