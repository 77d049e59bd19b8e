"""The engine facade on a tiny random Llama: reuse, budget, locks, bad input, twins."""

from __future__ import annotations

import threading

import pytest

from engine.types import EngineError, GenerationRequest, SamplingParams
from tests.engines import rand_ids


def shape(engine):
    """What the cache holds, without the access clock."""
    return [(n.node_id, n.parent_id, n.token_ids, n.lock_ref, n.hits) for n in engine.snapshot().nodes]


def req(ids, n=6, **kw):
    return GenerationRequest(prompt_ids=tuple(ids), sampling=SamplingParams(max_new_tokens=n), **kw)


@pytest.fixture
def engine(tiny_runner, make_engine):
    return make_engine(budget_bytes=2000 * tiny_runner.kv_bytes_per_token)


def test_greedy_outputs_identical_with_and_without_cache(tiny_runner, engine, make_engine):
    off = make_engine(enable_cache=False)
    vocab = len(tiny_runner.text.tokenizer)
    shared = rand_ids(1, 50, vocab)
    prompts = [shared + rand_ids(i, 10, vocab) for i in range(2, 6)] + [shared]
    for p in prompts:
        on_m, off_m = engine.run(req(p, 8)), off.run(req(p, 8))
        assert on_m.output_ids == off_m.output_ids
        assert off_m.cached_tokens == 0
        engine.check_invariants()
    assert engine.stats().cached_tokens > 0


@pytest.mark.parametrize("guard", [dict(no_repeat_ngram_size=3), dict(repetition_penalty=1.3),
                                   dict(no_repeat_ngram_size=2, repetition_penalty=1.2, temperature=0.7, seed=5)])
def test_loop_guards_keep_outputs_identical_with_and_without_cache(tiny_runner, engine, guard, make_engine):
    off = make_engine(enable_cache=False)
    vocab = len(tiny_runner.text.tokenizer)
    shared = rand_ids(7, 40, vocab)
    for i in range(3):
        r = GenerationRequest(prompt_ids=tuple(shared + rand_ids(20 + i, 6, vocab)),
                              sampling=SamplingParams(max_new_tokens=16, **guard))
        on_m, off_m = engine.run(r), off.run(r)
        assert on_m.output_ids == off_m.output_ids
    assert engine.stats().cached_tokens > 0


def test_cached_tokens_equal_longest_common_prefix(tiny_runner, engine):
    vocab = len(tiny_runner.text.tokenizer)
    a = rand_ids(1, 30, vocab)
    b = a[:12] + rand_ids(2, 10, vocab)
    m1 = engine.run(req(a, 4))
    assert m1.cached_tokens == 0
    m2 = engine.run(req(b, 4))
    assert m2.cached_tokens == 12
    # The reply is cached too: the next turn continues after prompt + output.
    c = a + m1.output_ids + rand_ids(3, 5, vocab)
    m3 = engine.run(req(c, 4))
    assert m3.cached_tokens == len(a) + len(m1.output_ids) - 1  # last sampled token was never fed


def test_budget_never_exceeded_and_small_budget_still_serves(tiny_runner, make_engine):
    bpt = tiny_runner.kv_bytes_per_token
    engine = make_engine(budget_bytes=25 * bpt)  # a little more than one request
    vocab = len(tiny_runner.text.tokenizer)
    for i in range(8):
        m = engine.run(req(rand_ids(i, 20, vocab), 3))
        assert m.output_tokens > 0
        assert m.cache_bytes <= 25 * bpt
        engine.check_invariants()
    assert engine.stats().evicted_tokens > 0
    with pytest.raises(EngineError, match="budget"):  # larger than the whole pool: refused, nothing changes
        engine.submit(req(rand_ids(99, 40, vocab), 3))
    engine.check_invariants()


def test_baseline_measured_on_same_request(engine, tiny_runner):
    """The engine returns the answer's metrics without a no-reuse figure; the analysis measures it
    after the answer, on the same request's prompt (``analysis.no_reuse``)."""
    from analysis.no_reuse import run_measured, with_no_reuse

    request = req(rand_ids(5, 30, len(tiny_runner.text.tokenizer)), 2, measure_baseline=True)
    assert engine.run(request).baseline_prefill_ms is None
    m = run_measured(engine, request)
    assert m.baseline_prefill_ms is not None and m.baseline_prefill_ms > 0
    assert with_no_reuse(engine, m) is m  # measured once


@pytest.mark.parametrize("bad", [
    GenerationRequest(prompt=""), GenerationRequest(prompt="   \n\t "), GenerationRequest(prompt_ids=()),
    GenerationRequest(messages=({"role": "user", "content": "  "},)), GenerationRequest(),
    GenerationRequest(prompt="x", prompt_ids=(1,)),
])
def test_bad_input_clear_error_and_cache_unchanged(engine, bad, tiny_runner):
    engine.run(req(rand_ids(9, 20, len(tiny_runner.text.tokenizer)), 2))
    before = shape(engine)
    with pytest.raises(EngineError):
        engine.run(bad)
    assert shape(engine) == before
    engine.check_invariants()


def test_prompt_longer_than_context_rejected(engine, tiny_runner):
    before = shape(engine)
    with pytest.raises(EngineError, match="limit"):
        engine.submit(req([11] * (tiny_runner.max_context + 1)))
    assert shape(engine) == before


def test_concurrent_requests_keep_cache_consistent(engine, tiny_runner, make_engine):
    vocab = len(tiny_runner.text.tokenizer)
    shared = rand_ids(1, 30, vocab)
    errors, results = [], {}

    def visitor(i):
        try:
            results[i] = engine.run(req(shared + rand_ids(100 + i, 8, vocab), 4)).output_ids
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=visitor, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for _ in range(20):
        engine.check_invariants()  # while requests run
        engine.snapshot()
    for t in threads:
        t.join()
    assert not errors
    engine.check_invariants()
    assert engine.cache.locked_tokens() == 0
    off = make_engine(enable_cache=False)
    for i, out in results.items():
        assert off.run(req(shared + rand_ids(100 + i, 8, vocab), 4)).output_ids == out


def test_cancel_mid_stream_releases_locks(engine, tiny_runner):
    handle = engine.submit(req(rand_ids(4, 30, len(tiny_runner.text.tokenizer)), 50))
    for _ in handle:
        handle.cancel()
    engine.run(req([12, 13, 14], 1))  # the worker moved on
    engine.check_invariants()
    assert engine.cache.locked_tokens() == 0
    assert engine.recent(2)[0].finish_reason == "cancelled"


def test_sampling_with_seed_is_reproducible(engine, tiny_runner):
    ids = rand_ids(8, 20, len(tiny_runner.text.tokenizer))
    params = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.9, seed=42)
    a = engine.run(GenerationRequest(prompt_ids=tuple(ids), sampling=params)).output_ids
    b = engine.run(GenerationRequest(prompt_ids=tuple(ids), sampling=params)).output_ids
    assert a == b


def test_set_budget_and_clear(engine, tiny_runner):
    vocab = len(tiny_runner.text.tokenizer)
    for i in range(3):
        engine.run(req(rand_ids(i, 30, vocab), 2))
    bpt = tiny_runner.kv_bytes_per_token
    evicted = engine.set_budget(40 * bpt)
    assert evicted > 0 and engine.stats().cache_bytes <= 40 * bpt
    engine.check_invariants()
    assert engine.clear_cache() > 0
    assert engine.stats().cached_tokens_now == 0
    engine.check_invariants()


def test_ignore_eos_generates_to_the_limit_and_changes_nothing_else(tiny_runner, monkeypatch, make_engine):
    """``ignore_eos`` (vLLM's): the answer runs past the end-of-sequence token to
    max_new_tokens; without it the same token ends the answer. The tokens before it agree."""
    engine = make_engine(budget_bytes=2000 * tiny_runner.kv_bytes_per_token)
    prompt = rand_ids(31, 20, len(tiny_runner.text.tokenizer))
    free = engine.run(req(prompt, 8))
    third = free.output_ids[2]  # make the model's third token an end-of-sequence token
    monkeypatch.setattr(tiny_runner.text, "eos_ids", {third})
    stopped = engine.run(req(prompt, 8))
    first = free.output_ids.index(third)
    assert stopped.output_ids == free.output_ids[:first] and stopped.finish_reason == "stop"
    going = engine.run(GenerationRequest(prompt_ids=tuple(prompt),
                                         sampling=SamplingParams(max_new_tokens=8, ignore_eos=True)))
    assert going.output_ids == free.output_ids and len(going.output_ids) == 8 and going.finish_reason == "length"
    engine.check_invariants()
    with pytest.raises(EngineError, match="Ignore EOS"):
        engine.run(GenerationRequest(prompt_ids=tuple(prompt), sampling=SamplingParams(ignore_eos="yes")))


def test_a_run_of_steps_streams_each_token_and_yields_to_other_calls(tiny_runner, make_engine):
    """The worker hands the compute thread runs of steps (``Engine._steps``): tokens still
    stream as each step makes them, and a call queued for the compute thread meanwhile (a
    budget change, a snapshot) runs before the answer ends, not after it."""
    engine = make_engine(budget_bytes=2000 * tiny_runner.kv_bytes_per_token)
    prompt = rand_ids(41, 20, len(tiny_runner.text.tokenizer))
    long = GenerationRequest(prompt_ids=tuple(prompt),
                             sampling=SamplingParams(max_new_tokens=300, ignore_eos=True))
    handle = engine.submit(long)
    tokens = 0
    for event in handle:
        if event.token_id is not None:
            tokens += 1
            if tokens == 3:
                assert not event.done  # the third token came before the answer ended
                engine.set_budget(1000 * tiny_runner.kv_bytes_per_token)  # served mid-answer
                engine.snapshot()
                assert engine.stats().running == 1
        if event.done:
            break
    assert tokens == 300 and event.metrics.output_tokens == 300
    engine.check_invariants()
