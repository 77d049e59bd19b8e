"""The scheduler's policy on a tiny random Llama: in-batch prefix sharing, memory held by
running requests, order (longest cached prefix, ageing, namespaces), isolation, cancel,
the baseline as work of its own, progress events and the step log."""

from __future__ import annotations

import dataclasses

import pytest

from engine.engine import Engine
from engine.types import EngineError, GenerationRequest, SamplingParams
from tests.engines import rand_ids
from tests.helpers_app import assert_clean, wait_idle


def req(ids, n=4, **kw) -> GenerationRequest:
    return GenerationRequest(prompt_ids=tuple(ids), sampling=SamplingParams(max_new_tokens=n), **kw)


def submit_together(engine: Engine, requests):
    with engine.runner.lock:
        return [engine.submit(r) for r in requests]


def finish_order(engine: Engine) -> list[int]:
    return [m.request_id for m in engine.recent()]


def configure(engine: Engine, **changes) -> Engine:
    engine.scheduler.config = dataclasses.replace(engine.scheduler.config, **changes)
    return engine


def test_same_uncached_prefix_is_computed_once(tiny_runner, make_engine):
    vocab = len(tiny_runner.text.tokenizer)
    engine = make_engine(budget_bytes=2000 * tiny_runner.kv_bytes_per_token)
    shared = rand_ids(1, 60, vocab)
    handles = submit_together(engine, [req(shared + rand_ids(10 + i, 5, vocab)) for i in range(4)])
    metrics = [list(h)[-1].metrics for h in handles]
    assert sorted(m.cached_tokens for m in metrics) == [0, 60, 60, 60]
    assert sum(m.computed_tokens for m in metrics) == 60 + 4 * 5
    assert_clean(engine)


def test_running_requests_count_against_the_budget(tiny_runner, make_engine):
    """Each running request reserves its buffer (prompt + new tokens): with room for two,
    no more than two run at once; the rest wait, nothing is lost, the cache stays in budget."""
    vocab = len(tiny_runner.text.tokenizer)
    bpt = tiny_runner.kv_bytes_per_token
    engine = make_engine(budget_bytes=70 * bpt)  # each request needs 30 + 5
    requests = [req(rand_ids(20 + i, 30, vocab), 5) for i in range(5)]
    handles = submit_together(engine, requests)
    metrics = [list(h)[-1].metrics for h in handles]
    assert all(m.output_tokens == 5 for m in metrics)
    assert max(rec.running for rec in engine.step_log()) <= 2
    assert all(m.cache_bytes <= 70 * bpt for m in metrics)
    off = make_engine(enable_cache=False, max_batch=1)
    assert [m.output_ids for m in metrics] == [off.run(r).output_ids for r in requests]
    wait_idle(engine)
    assert_clean(engine)
    assert engine.cache.running_tokens == 0


def test_request_larger_than_budget_is_refused_clearly_and_changes_nothing(tiny_runner, make_engine):
    """All KV lives in the pool, so a prompt that alone exceeds the budget cannot run: it is
    refused at submit with a message naming both sizes; new tokens that would not fit are
    cut to what does (the answer ends with ``length``)."""
    vocab = len(tiny_runner.text.tokenizer)
    engine = make_engine(budget_bytes=10 * tiny_runner.kv_bytes_per_token)
    with pytest.raises(EngineError, match="MiB of KV .* cache budget"):
        engine.submit(req(rand_ids(30, 40, vocab), 3))
    handles = submit_together(engine, [req(rand_ids(31 + i, 6, vocab), 30) for i in range(3)])
    metrics = [list(h)[-1].metrics for h in handles]
    assert all(m.output_tokens <= 4 and m.finish_reason in ("length", "stop") for m in metrics)
    assert_clean(engine)
    assert engine.cache.running_tokens == 0


def test_longest_cached_prefix_first_then_ageing(tiny_runner, make_engine):
    vocab = len(tiny_runner.text.tokenizer)
    engine = make_engine(max_batch=1, budget_bytes=2000 * tiny_runner.kv_bytes_per_token)
    cached = rand_ids(40, 30, vocab)
    engine.run(req(cached, 1))
    before = len(engine.recent())
    cold, warm = req(rand_ids(41, 30, vocab)), req(cached + rand_ids(42, 3, vocab))
    handles = submit_together(engine, [cold, warm])
    for h in handles:
        list(h)
    assert finish_order(engine)[before:] == [handles[1].request_id, handles[0].request_id]
    # Waited too long: first come, first served.
    configure(engine, max_wait_s=0.0)
    cold2, warm2 = req(rand_ids(43, 30, vocab)), req(cached + rand_ids(44, 3, vocab))
    handles = submit_together(engine, [cold2, warm2])
    for h in handles:
        list(h)
    assert finish_order(engine)[-2:] == [handles[0].request_id, handles[1].request_id]


def test_isolation_takes_turns_across_visitors_and_leaves_no_row_idle(tiny_runner, make_engine):
    """Admission goes round-robin across visitors (fewest running first), and a visitor may hold
    more rows while nobody else waits for them, never more than ``owner_row_cap``."""
    from collections import Counter

    from engine.scheduler.policy import owner_row_cap

    vocab = len(tiny_runner.text.tokenizer)
    engine = make_engine(isolation=True, max_batch=4)
    cap = owner_row_cap(engine.scheduler.config)
    a = [req(rand_ids(50 + i, 20, vocab), 6, namespace="v-a") for i in range(3)]
    b = [req(rand_ids(60, 20, vocab), 6, namespace="v-b"), req(rand_ids(61, 20, vocab), 6, namespace="v-b/lab")]
    handles = submit_together(engine, a + b)
    metrics = [list(h)[-1].metrics for h in handles]
    log = engine.step_log()
    for rec in log:
        per_owner = Counter(ns.split("/")[0] for ns in rec.namespaces)
        assert max(per_owner.values()) <= cap, rec
    first = Counter(ns.split("/")[0] for ns in log[0].namespaces)
    assert first == {"v-a": 2, "v-b": 2}, log[0]  # turns: a, b, a, b; a's third waits for a row
    done = [m.request_id for m in engine.recent()]
    # Round-robin: b's first request does not wait for all of a's.
    assert done.index(metrics[3].request_id) < done.index(metrics[2].request_id)
    assert max(m.batch_size_max for m in metrics) == 4


def test_cancel_one_request_in_a_batch(tiny_runner, make_engine):
    vocab = len(tiny_runner.text.tokenizer)
    engine = make_engine(budget_bytes=2000 * tiny_runner.kv_bytes_per_token, max_new_tokens_cap=200)
    shared = rand_ids(70, 30, vocab)
    engine.run(req(shared, 1))  # a cached prefix: the running requests lock it
    requests = [req(shared + rand_ids(71 + i, 4, vocab), 200 if i == 0 else 12) for i in range(3)]
    handles = submit_together(engine, requests)
    stream = iter(handles[0])
    for event in stream:
        if event.token_id is not None:
            handles[0].cancel()
            break
    rest = list(stream)
    assert rest[-1].metrics.finish_reason == "cancelled" and rest[-1].metrics.output_tokens < 200
    others = [list(h)[-1].metrics for h in handles[1:]]
    off = make_engine(enable_cache=False, max_batch=1)
    assert [m.output_ids for m in others] == [off.run(r).output_ids for r in requests[1:]]
    wait_idle(engine)
    assert_clean(engine)
    assert engine.cache.running_tokens == 0


def test_progress_events_and_chunked_prefill(tiny_runner, make_engine):
    vocab = len(tiny_runner.text.tokenizer)
    engine = make_engine(chunk_tokens=10, max_batch=1)
    handles = submit_together(engine, [req(rand_ids(80, 12, vocab), 3), req(rand_ids(81, 35, vocab), 3)])
    events = [list(h) for h in handles]
    second = events[1]
    assert second[0].phase == "queued" and second[0].queue_ahead == 0
    prefill = [e.prefilled_tokens for e in second if e.phase == "prefill"]
    assert prefill == [10, 20, 30]
    assert second[-1].done and second[-1].metrics.prefill_chunks == 4
    assert [e.phase for e in second if e.token_id is not None] == ["decode"] * len(second[-1].metrics.output_ids)
    kinds = {rec.kind for rec in engine.step_log()}
    assert kinds == {"prefill", "decode"}


def test_stats_and_step_log(tiny_runner, make_engine):
    vocab = len(tiny_runner.text.tokenizer)
    engine = make_engine(max_batch=4)
    handles = submit_together(engine, [req(rand_ids(100 + i, 8, vocab), 6) for i in range(4)])
    for h in handles:
        list(h)
    log = engine.step_log(50)
    decodes = [rec for rec in log if rec.kind == "decode"]
    assert decodes and max(rec.batch_size for rec in decodes) == 4
    assert all(rec.duration_ms >= 0 and rec.computed_tokens == rec.batch_size for rec in decodes)
    assert sum(rec.computed_tokens for rec in log if rec.kind == "prefill") == 32
    stats = engine.stats()
    assert stats.max_batch == 4 and stats.waiting == 0
    assert len(engine.step_log(3)) == 3


def test_shared_prefix_is_counted_once_so_more_requests_fit(tiny_runner, make_engine):
    """Running requests reserve only what they add (prompt beyond the cached prefix, plus the
    reply); the shared prefix sits once in the cache, locked while they run."""
    vocab = len(tiny_runner.text.tokenizer)
    engine = make_engine(budget_bytes=130 * tiny_runner.kv_bytes_per_token)
    shared = rand_ids(110, 60, vocab)
    engine.run(req(shared, 1))
    handles = submit_together(engine, [req(shared + rand_ids(111 + i, 5, vocab), 6) for i in range(4)])
    stream = iter(handles[0])
    for event in stream:
        if event.token_id is not None:
            assert engine.cache.locked_tokens() >= 60  # prompts stay pinned while they decode
            assert engine.cache.num_tokens + engine.cache.running_tokens <= 130
            break
    metrics = [list(stream)[-1].metrics] + [list(h)[-1].metrics for h in handles[1:]]
    assert max(m.batch_size_max for m in metrics) == 4
    assert all(m.cached_tokens == 60 for m in metrics)
    wait_idle(engine)
    assert_clean(engine)
    assert engine.cache.running_tokens == 0


def test_long_prompts_of_one_visitor_do_not_hold_up_another(tiny_runner, make_engine):
    """Issue 14's starvation case, in steps: visitor A sends two long prompts, B a short
    question. B's prefill runs before either of A's prompts has finished its chunks (A's second
    runs beside A's first, since nobody else waited for its row), and A's no-reuse figure is
    skipped (long, public: ``analysis.no_reuse``)."""
    from analysis.no_reuse import no_reuse_for, with_no_reuse

    vocab = len(tiny_runner.text.tokenizer)
    engine = make_engine(isolation=True, chunk_tokens=8)
    no_reuse_for(engine).max_tokens_isolated = 100
    a = [req(rand_ids(120 + i, 400, vocab), 3, namespace="v-a", measure_baseline=True) for i in range(2)]
    with tiny_runner.lock:
        ha = [engine.submit(r) for r in a]
    first = iter(ha[0])
    next(first)  # A's first prompt is being prefilled (50 chunks)
    with tiny_runner.lock:
        hb = engine.submit(req(rand_ids(130, 6, vocab), 3, namespace="v-b"))
    mb = list(hb)[-1].metrics
    ma = [with_no_reuse(engine, m) for m in (list(first)[-1].metrics, list(ha[1])[-1].metrics)]
    log = engine.step_log()
    a_chunks = [i for i, rec in enumerate(log) if ma[0].request_id in rec.prefill_request_ids]
    b_first = next(i for i, rec in enumerate(log) if mb.request_id in rec.request_ids)
    assert b_first < a_chunks[-1]
    assert all(m.baseline_prefill_ms is None for m in ma)
    a_second = [i for i, rec in enumerate(log) if ma[1].request_id in rec.request_ids and rec.kind == "prefill"]
    assert b_first < a_second[-1]


def test_close_finishes_submitted_work_then_stops(tiny_runner, make_engine):
    import pytest

    from engine.types import EngineError

    engine = make_engine()
    handle = engine.submit(req(rand_ids(140, 10, len(tiny_runner.text.tokenizer)), 3))
    engine.close()
    assert list(handle)[-1].done
    assert not engine._worker.is_alive()
    with pytest.raises(EngineError, match="shut down"):
        engine.submit(req([11, 12], 1))
