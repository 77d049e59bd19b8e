"""Batching never changes what the model computes (tiny random Llama, fp32).

The batched decode forward is compared, row by row, with a from-scratch forward of the
same tokens; engine answers under batching with lone runs on an engine with no cache."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.types import CacheKey, GenerationRequest, SamplingParams
from tests.conftest import fast_paths
from tests.engines import rand_ids
from tests.helpers_app import assert_clean, wait_idle


def req(ids, n=8, **kw) -> GenerationRequest:
    sampling = kw.pop("sampling", None) or SamplingParams(max_new_tokens=n)
    return GenerationRequest(prompt_ids=tuple(ids), sampling=sampling, **kw)


def together(engine: Engine, requests) -> list:
    """Submit while the model is busy, so the scheduler admits them in one step; return metrics."""
    with engine.runner.lock:
        handles = [engine.submit(r) for r in requests]
    return [list(h)[-1].metrics for h in handles]


def _pool(runner, tokens: int):
    from engine.kvcache.kv_pool import KVPool

    return KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype, runner.device,
                  tokens * runner.kv_bytes_per_token)


def test_paged_rows_join_and_leave_exact(tiny_runner):
    """The scheduler's forward over the pool: rows of different lengths, some reading a shared
    prefix in place, joining and leaving between steps: every row's logits equal a
    from-scratch forward of its tokens (1e-4)."""
    from engine.model.paged_attention import PagedSegment

    vocab = len(tiny_runner.text.tokenizer)
    pool = _pool(tiny_runner, 400)
    shared = rand_ids(1, 20, vocab)
    prefix = pool.alloc(len(shared))
    tiny_runner.forward_paged(pool, [PagedSegment(shared, 0, prefix)])
    prompts = [rand_ids(2, 5, vocab), shared + rand_ids(3, 9, vocab), shared + rand_ids(4, 31, vocab),
               rand_ids(5, 60, vocab)]
    slots, seqs = [], []
    for i, p in enumerate(prompts):
        base = prefix if i in (1, 2) else []
        own = base + pool.alloc(len(p) - len(base) + 8)
        tiny_runner.forward_paged(pool, [PagedSegment(p[len(base):], len(base), own)])
        slots.append(own)
        seqs.append(list(p))
    schedule = [[0, 1], [0, 1, 2], [1, 2, 3], [2, 3], [0, 2, 3], [3]]
    for step, rows in enumerate(schedule):
        tokens = [11 + step + r for r in rows]
        logits = tiny_runner.forward_paged(pool, [PagedSegment([t], len(seqs[r]), slots[r])
                                                  for t, r in zip(tokens, rows, strict=True)])
        for i, r in enumerate(rows):
            seqs[r].append(tokens[i])
            ref, _ = tiny_runner.reference_prefill(seqs[r])
            assert torch.allclose(logits[i], ref, atol=1e-4), (step, r, (logits[i] - ref).abs().max())


def test_packed_prefill_chunks_and_decodes_exact(tiny_runner):
    """One forward over the pool holding a fresh prompt, a second chunk of a prompt, and decode
    tokens: each segment's logits equal a from-scratch forward, and the KV it wrote serves later steps."""
    from engine.model.paged_attention import PagedSegment

    vocab = len(tiny_runner.text.tokenizer)
    pool = _pool(tiny_runner, 300)
    seqs = [rand_ids(80 + i, n, vocab) for i, n in enumerate((12, 30, 7, 19))]
    slots = [pool.alloc(64) for _ in seqs]
    tiny_runner.forward_paged(pool, [PagedSegment(seqs[1][:10], 0, slots[1])])  # a prompt half prefilled
    tiny_runner.forward_paged(pool, [PagedSegment(seqs[2], 0, slots[2])])  # two requests decoding
    tiny_runner.forward_paged(pool, [PagedSegment(seqs[3], 0, slots[3])])
    fed = [list(seqs[0]), list(seqs[1]), seqs[2] + [5], seqs[3] + [6]]
    segments = [PagedSegment(seqs[0], 0, slots[0]), PagedSegment(seqs[1][10:], 10, slots[1]),
                PagedSegment([5], len(seqs[2]), slots[2]), PagedSegment([6], len(seqs[3]), slots[3])]
    for _ in range(3):
        logits = tiny_runner.forward_paged(pool, segments)
        for i, seq in enumerate(fed):
            ref, _ = tiny_runner.reference_prefill(seq)
            assert torch.allclose(logits[i], ref, atol=1e-4), (i, (logits[i] - ref).abs().max())
        segments = [PagedSegment([7 + i], len(seq), slots[i]) for i, seq in enumerate(fed)]
        fed = [seq + [7 + i] for i, seq in enumerate(fed)]


def test_chunked_prefill_logits_exact(tiny_runner):
    ids = rand_ids(9, 53, len(tiny_runner.text.tokenizer))
    kv = tiny_runner.new_request_kv(len(ids))
    for start in range(0, len(ids), 7):
        logits = tiny_runner.forward_last(ids[start:start + 7], kv)
    ref, _ = tiny_runner.reference_prefill(ids)
    assert torch.allclose(logits, ref, atol=1e-4)


@pytest.fixture(scope="module")
def lone(make_module_engine):
    """Answers of requests run one at a time with no cache."""
    engine = make_module_engine(enable_cache=False, max_batch=1)
    return lambda r: engine.run(r).output_ids


def test_batched_greedy_answers_equal_lone_runs(tiny_runner, lone, make_engine):
    vocab = len(tiny_runner.text.tokenizer)
    shared = rand_ids(10, 30, vocab)
    requests = [req(shared + rand_ids(20 + i, 3 + 4 * i, vocab), n=4 + 3 * i) for i in range(6)]
    requests.append(req(rand_ids(99, 17, vocab), n=12))
    engine = make_engine(budget_bytes=2000 * tiny_runner.kv_bytes_per_token, chunk_tokens=16)
    metrics = together(engine, requests)
    for r, m in zip(requests, metrics, strict=True):
        assert m.output_ids == lone(r)
    assert max(m.batch_size_max for m in metrics) >= 4
    assert any(m.prefill_chunks > 1 for m in metrics)  # 16 tokens a step: the long prompts took chunks
    wait_idle(engine)
    assert_clean(engine)
    assert engine.cache.running_tokens == 0


def test_requests_joining_mid_decode_stay_exact(tiny_runner, lone, make_engine):
    vocab = len(tiny_runner.text.tokenizer)
    engine = make_engine(budget_bytes=2000 * tiny_runner.kv_bytes_per_token)
    first = [req(rand_ids(30 + i, 12, vocab), n=40) for i in range(2)]
    handles = [engine.submit(r) for r in first]
    streams = [iter(h) for h in handles]
    for s in streams:
        next(s)  # both are decoding
    later = [req(rand_ids(40 + i, 25, vocab), n=6) for i in range(3)]
    later_metrics = [engine.run(r) for r in later]  # join, run, leave while the first two decode
    first_metrics = [[e for e in s][-1].metrics for s in streams]
    for r, m in zip(first + later, first_metrics + later_metrics, strict=True):
        assert m.output_ids == lone(r)
    assert max(m.batch_size_max for m in first_metrics) >= 3


@pytest.mark.parametrize("guard", [dict(), dict(no_repeat_ngram_size=2, repetition_penalty=1.2)])
def test_seeded_sampling_same_alone_or_batched(tiny_runner, lone, guard, make_engine):
    vocab = len(tiny_runner.text.tokenizer)
    params = [SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, seed=s, **guard) for s in range(4)]
    requests = [req(rand_ids(50 + i, 10 + i, vocab), sampling=p) for i, p in enumerate(params)]
    engine = make_engine()
    metrics = together(engine, requests)
    for r, m in zip(requests, metrics, strict=True):
        assert m.output_ids == lone(r)


def test_cached_prefixes_differ_per_row(tiny_runner, lone, make_engine):
    vocab = len(tiny_runner.text.tokenizer)
    engine = make_engine(budget_bytes=2000 * tiny_runner.kv_bytes_per_token)
    a, b = rand_ids(60, 40, vocab), rand_ids(61, 15, vocab)
    engine.run(req(a, 1))
    engine.run(req(b, 1))
    requests = [req(a[:25] + rand_ids(62, 5, vocab)), req(b + rand_ids(63, 9, vocab)), req(rand_ids(64, 11, vocab)),
                req(a + rand_ids(65, 2, vocab))]
    metrics = together(engine, requests)
    assert [m.cached_tokens for m in metrics] == [25, 15, 0, 40]
    for r, m in zip(requests, metrics, strict=True):
        assert m.output_ids == lone(r)
    engine.check_invariants()


def test_public_prefill_api_unchanged(tiny_runner, make_engine):
    """``Engine.prefill`` (the bench uses it) still prefills one request synchronously."""
    engine = make_engine()
    ids = rand_ids(70, 20, len(tiny_runner.text.tokenizer))
    kv = tiny_runner.new_request_kv(len(ids))
    res = engine.prefill(CacheKey(tuple(ids)), kv)
    ref, _ = tiny_runner.reference_prefill(ids)
    assert torch.allclose(res.logits, ref, atol=1e-4) and res.cached_tokens == 0


@pytest.mark.slow
def test_eight_concurrent_chats_equal_lone_runs_real_model(real_runner, make_engine):
    """The embedded model in fp32: 8 chats sharing a system prompt, run together, give the
    same greedy answers as each run alone with no cache."""
    system = {"role": "system", "content": "You are a friendly assistant for an outdoor gear shop. Answer briefly."}
    questions = ["Can I return a tent I used once?", "How much is express shipping?", "Why is the sky blue?",
                 "Do sleeping bags have a warranty?", "What is photosynthesis?", "Recommend a hiking boot.",
                 "How long does delivery take?", "What should I pack for a rainy hike?"]
    requests = [GenerationRequest(messages=(system, {"role": "user", "content": q}),
                                  sampling=SamplingParams(max_new_tokens=12)) for q in questions]
    engine = make_engine(real_runner, max_batch=8)
    metrics = together(engine, requests)
    alone = make_engine(real_runner, enable_cache=False, max_batch=1)
    for r, m in zip(requests, metrics, strict=True):
        assert m.output_ids == alone.run(r).output_ids, m.output_text
    assert max(m.batch_size_max for m in metrics) >= 6
    assert sum(m.cached_tokens > 0 for m in metrics) >= 7  # the system prompt was computed once


def test_incremental_detokenizing_matches_whole_decode(tiny_runner):
    """The streamed text (a short window decoded per token) is always a prefix of, and at the
    end equal to, decoding the whole answer, across multi-byte characters."""
    from engine.scheduler.request import Answer

    text = "Héllo wörld! 日本語のテキスト 🙂🚀 naïve café — ok\n\n  spaced   out ∑∫ end"
    ids = tiny_runner.text.encode(text)
    answer = Answer()
    whole = tiny_runner.text.decode(ids)
    for tok in ids:
        streamed = answer.append(tok, tiny_runner.text.decode)
        assert whole.startswith(streamed)
    assert streamed == whole


@pytest.mark.parametrize("family", ["qwen2", "mistral", "gpt2"])
def test_batched_answers_equal_lone_runs_for_family(tokenizer, family, make_engine):
    from engine.model.loader import LoadedModel
    from engine.model.runner import ModelRunner
    from tests.engine.test_model_families import tiny

    runner = ModelRunner(LoadedModel(tiny(family, len(tokenizer)).eval(), tokenizer, f"tiny-{family}",
                                     torch.device("cpu"), torch.float32))
    vocab = len(tokenizer)
    shared = rand_ids(200, 20, vocab)
    requests = [req(shared + rand_ids(201 + i, 3 + 5 * i, vocab), n=5 + i) for i in range(4)]
    metrics = together(make_engine(runner, chunk_tokens=12), requests)
    alone = make_engine(runner, enable_cache=False, max_batch=1)
    for r, m in zip(requests, metrics, strict=True):
        assert m.output_ids == alone.run(r).output_ids
    assert max(m.batch_size_max for m in metrics) >= 3


def test_out_of_memory_fails_only_the_request_that_needs_it(tiny_runner, lone, monkeypatch, make_engine):
    """Issue 28: an out-of-memory error in a packed forward used to fail every row of it. Now the
    rows run again one by one; only a request that runs out of memory alone fails (a clear
    ``EngineFault``), the others' answers equal lone runs, and the cache stays consistent."""
    from engine.model.attention.cpu_sdpa import CpuSdpaBackend
    from engine.types import EngineFault

    class OutOfMemoryOverLongContexts(CpuSdpaBackend):
        """The CPU kernel, out of memory whenever one call reads more than ``limit`` keys."""

        def __init__(self, limit: int) -> None:
            self.limit, self.failed = limit, 0

        def attend(self, q, k, v, scale, mask=None, causal=None):
            if k.shape[-2] > self.limit:
                self.failed += 1
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 600.00 MiB")
            return super().attend(q, k, v, scale, mask=mask, causal=causal)

    vocab = len(tiny_runner.text.tokenizer)
    short = [req(rand_ids(40 + i, 12 + i, vocab), n=6) for i in range(3)]
    long = req(rand_ids(50, 120, vocab), n=6)
    expected = [lone(r) for r in short]
    engine = make_engine(budget_bytes=2000 * tiny_runner.kv_bytes_per_token)
    fault = OutOfMemoryOverLongContexts(limit=60)
    monkeypatch.setattr(tiny_runner, "attention", fault)
    fast_paths(tiny_runner, monkeypatch)  # the backends serve the fast paths
    with engine.runner.lock:
        handles = [engine.submit(r) for r in [*short, long]]
    events = [list(h) for h in handles[:3]]
    with pytest.raises(EngineFault, match="out of cpu memory"):
        list(handles[3])
    monkeypatch.undo()
    for evs, want in zip(events, expected, strict=True):
        assert evs[-1].metrics is not None and evs[-1].metrics.output_ids == want
    assert fault.failed >= 2  # the packed forward, then the long request alone
    wait_idle(engine)
    assert_clean(engine)
    assert engine.cache.running_tokens == 0
    assert engine.run(long).output_ids == lone(long)  # with memory again, the same request runs exactly
