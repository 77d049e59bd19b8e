"""Block granularity (a simulation over token ids): never more cached tokens than per
token, every count a multiple of the block size, and the alignment loss adds up."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.lab.granularity import compare_granularity, simulate_blocks, tokens_lost_to_alignment

# Small alphabets make shared prefixes likely; sequences of up to 200 tokens.
traces = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=200), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(traces, st.sampled_from([2, 3, 16, 64]))
def test_blocks_never_cache_more_than_tokens(trace, block):
    per_token = simulate_blocks(trace, 1)
    blocks = simulate_blocks(trace, block)
    for t, b, n in zip(per_token.cached_per_request, blocks.cached_per_request, per_token.prompt_tokens_per_request,
                       strict=True):
        assert 0 <= b <= t <= max(0, n - 1)
        assert b % block == 0


@settings(max_examples=100, deadline=None)
@given(traces)
def test_lost_to_alignment_adds_up(trace):
    results = compare_granularity(trace, (1, 16, 64))
    lost = tokens_lost_to_alignment(results)
    assert lost[1] == 0 and lost[16] >= 0 and lost[64] >= 0
    assert results[0].cached_tokens - results[1].cached_tokens == lost[16]


def test_known_trace():
    shared = list(range(100))
    trace = [shared + [1000 + i] * 5 for i in range(3)]
    per_token, b16, b64 = compare_granularity(trace)
    assert per_token.cached_per_request == (0, 100, 100)
    assert b16.cached_per_request == (0, 96, 96)
    assert b64.cached_per_request == (0, 64, 64)
    assert tokens_lost_to_alignment([per_token, b16, b64]) == {1: 0, 16: 8, 64: 72}
