"""The seven holes of issue 58, each replayed as two strangers on a public deployment would (the
tiny random Llama in isolation mode, visitors told apart by address): what visitor A does must
not show in what visitor B reads, and one address must not lock the others out. Each test
failed before its fix (docs/SECURITY.md lists them)."""

from __future__ import annotations

import torch

from analysis.prefill_timing import PrefillTimer, TimingPolicy
from engine.engine import Engine
from engine.types import GenerationRequest, SamplingParams

A_NS, B_NS = "v-aaaa/s-1", "v-bbbb/s-1"


def rand_ids(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randint(10, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine: Engine, ids: list[int], namespace: str, public_len: int = 0):
    req = GenerationRequest(prompt_ids=tuple(ids), sampling=SamplingParams(max_new_tokens=2), public_len=public_len,
                            namespace=namespace)
    m = engine.run(req)
    return engine.cache_key(ids, req), m.cached_tokens


# ------------------------------------------------------------------ 1. the no-reuse timing memo
def test_1_no_reuse_memo_is_never_read_by_another_visitor(tiny_runner):
    """A times a prompt under a shipped prefix; B sends another prompt of the same length under
    the same prefix: B's no-reuse figure is measured for B, never A's (length, time, runs)."""
    engine = Engine(tiny_runner, isolation=True, budget_bytes=4000 * tiny_runner.kv_bytes_per_token)
    try:
        vocab = len(tiny_runner.text.tokenizer)
        shipped = rand_ids(9, 100, vocab)
        timer = PrefillTimer(engine, TimingPolicy(pairs=1, reuse_runs=1, memo_min_tokens=64, block_tokens=1024))
        _run(engine, shipped + rand_ids(20, 5, vocab), A_NS, public_len=100)  # the shipped prefix is cached
        key_a, cached_a = _run(engine, shipped + rand_ids(10, 12, vocab), A_NS, public_len=100)
        first = timer.time_pairs(key_a, cached_a)
        assert first.full_ms is not None and not first.full_from_memo
        key_b, cached_b = _run(engine, shipped + rand_ids(11, 12, vocab), B_NS, public_len=100)  # same length
        seen_by_b = timer.time_pairs(key_b, cached_b)
        assert not seen_by_b.full_from_memo and seen_by_b.full_measured_at != first.full_measured_at
        # A's own next prompt of that length still uses A's memo entry (the memo keeps its purpose).
        key_a2, cached_a2 = _run(engine, shipped + rand_ids(12, 12, vocab), A_NS, public_len=100)
        assert timer.time_pairs(key_a2, cached_a2).full_from_memo
    finally:
        engine.close()
