"""One home for KV bytes: running requests read the cached prefix in place and hold pool
slots of their own, so the pool bounds all the KV; what happens when memory runs short;
the accounting defects found in review (tiny random Llama)."""

from __future__ import annotations

import threading
import time

import pytest

from engine.engine import Engine
from engine.types import CacheKey, EngineError, GenerationRequest, SamplingParams
from tests.engine.test_batching_exact import req, together
from tests.engines import rand_ids
from tests.helpers_app import assert_clean, wait_idle


def watch(engine: Engine, stop: threading.Event, seen: list) -> None:
    """Sample the cache while requests run: invariants, and the pool's bound."""
    cache = engine.cache
    while not stop.is_set():
        with cache._lock:
            cache.check_invariants()
            seen.append((cache.pool.num_used, cache.tree.num_tokens, cache.running_tokens, cache.shared_tokens,
                         cache.pool.capacity))
        time.sleep(0.002)


def test_requests_behind_one_prefix_share_its_slots_and_stay_within_the_pool(tiny_runner, make_engine):
    vocab = len(tiny_runner.text.tokenizer)
    system = rand_ids(1, 120, vocab)
    engine = make_engine(budget_bytes=400 * tiny_runner.kv_bytes_per_token, max_batch=8)
    engine.run(req(system + rand_ids(2, 4, vocab), 2))  # the system prompt is cached
    stop, seen = threading.Event(), []
    spy = threading.Thread(target=watch, args=(engine, stop, seen))
    spy.start()
    try:
        requests = [req(system + rand_ids(10 + i, 5, vocab), 20) for i in range(8)]
        metrics = together(engine, requests)
    finally:
        stop.set()
        spy.join()
    assert all(m.cached_tokens >= 120 for m in metrics)
    # Eight copies of the prefix would need 8 x 120 slots: the pool has 400 and never ran out.
    assert max(used for used, *_ in seen) <= 400
    assert max(shared for *_, shared, _ in seen) >= 120  # the prefix was read by several at once
    # What running requests held themselves: their questions and answers, never the prefix.
    assert max(running for _, _, running, _, _ in seen) <= 8 * (5 + 1 + 20)
    alone = make_engine(enable_cache=False, max_batch=1)
    assert [m.output_ids for m in metrics] == [alone.run(r).output_ids for r in requests]
    wait_idle(engine)
    assert_clean(engine)


def test_gauges_count_tree_running_and_shared(tiny_runner, make_engine):
    vocab = len(tiny_runner.text.tokenizer)
    system = rand_ids(3, 64, vocab)
    engine = make_engine(budget_bytes=1000 * tiny_runner.kv_bytes_per_token)
    engine.run(req(system + [5], 1))
    handles = [engine.submit(req(system + rand_ids(20 + i, 3, vocab), 60)) for i in range(3)]
    streams = [iter(h) for h in handles]
    for s in streams:
        while next(s).phase != "decode":
            pass
    st = engine.stats()
    bpt = tiny_runner.kv_bytes_per_token
    assert st.shared_tokens >= 64 and st.running_bytes > 0 and st.tree_bytes >= 64 * bpt
    assert st.tree_bytes + st.running_bytes == st.cache_bytes <= st.budget_bytes
    for h in handles:
        h.cancel()
    for s in streams:
        list(s)
    wait_idle(engine)
    st = engine.stats()
    assert st.running_bytes == 0 and st.shared_tokens == 0 and st.cache_bytes == st.tree_bytes
    assert_clean(engine)


def test_short_memory_holds_admissions_and_everyone_finishes(tiny_runner, make_engine):
    """Room for about two requests at once: the rest wait (no deadlock, nobody lost) and run as
    slots come back; answers equal a run with no cache."""
    vocab = len(tiny_runner.text.tokenizer)
    engine = make_engine(budget_bytes=70 * tiny_runner.kv_bytes_per_token, max_batch=8)
    requests = [req(rand_ids(40 + i, 20, vocab), 10) for i in range(6)]
    metrics = together(engine, requests)
    assert max(m.batch_size_max for m in metrics) <= 2
    alone = make_engine(enable_cache=False, max_batch=1)
    assert [m.output_ids for m in metrics] == [alone.run(r).output_ids for r in requests]
    wait_idle(engine)
    assert_clean(engine)


def test_failed_admission_changes_nothing(tiny_runner, make_engine):
    """No room: the tree's shape, hits and access times are as they were (review defect)."""
    vocab = len(tiny_runner.text.tokenizer)
    engine = make_engine(budget_bytes=100 * tiny_runner.kv_bytes_per_token)
    cache = engine.cache
    long = rand_ids(50, 60, vocab)
    engine.run(req(long, 2))
    with cache._lock:
        cache.tree.lock(cache.tree.match(CacheKey(tuple(long))).node)  # a running request holds it
        before = [(n.id, n.key, n.hits, n.last_access) for n in cache.tree.nodes()]
        rs = cache.acquire(CacheKey(tuple(long[:30] + rand_ids(51, 10, vocab))), 39, 80)
        assert rs is None
        assert [(n.id, n.key, n.hits, n.last_access) for n in cache.tree.nodes()] == before
        cache.tree.unlock(cache.tree.match(CacheKey(tuple(long)), touch=False).node)
    assert_clean(engine)


def test_an_error_admitting_one_request_fails_only_it(tiny_runner, monkeypatch, make_engine):
    vocab = len(tiny_runner.text.tokenizer)
    engine = make_engine(max_batch=4)
    real = engine.cache.acquire
    bad = tuple(rand_ids(60, 12, vocab))

    def acquire(key, max_len, total):
        if key.ids == bad:
            raise MemoryError("out of memory (simulated)")
        return real(key, max_len, total)

    monkeypatch.setattr(engine.cache, "acquire", acquire)
    good = [req(rand_ids(61 + i, 12, vocab), 6) for i in range(3)]
    handles = [engine.submit(r) for r in good[:2]] + [engine.submit(req(list(bad), 6))] + [engine.submit(good[2])]
    results = []
    for h in handles:
        try:
            results.append(list(h)[-1].metrics.output_tokens)
        except EngineError as exc:
            results.append(str(exc))
    assert results[:2] == [6, 6] and results[3] == 6
    assert "MemoryError" in results[2]
    wait_idle(engine)
    assert_clean(engine)


def test_fair_share_refusal_drains_nothing_and_the_engine_goes_on(tiny_runner, make_engine):
    """Isolation mode: a visitor's request larger than what fair share lets them take is refused;
    it evicts nobody, and later requests still run (review defect: reserve evicted, then said no)."""
    vocab = len(tiny_runner.text.tokenizer)
    engine = make_engine(isolation=True, budget_bytes=200 * tiny_runner.kv_bytes_per_token)
    kept = rand_ids(70, 80, vocab)
    engine.run(GenerationRequest(prompt_ids=tuple(kept), sampling=SamplingParams(max_new_tokens=2), namespace="v-b"))
    cached_before = engine.cache.num_tokens
    with pytest.raises(EngineError, match="shared deployment"):
        engine.run(GenerationRequest(prompt_ids=tuple(rand_ids(71, 150, vocab)),
                                     sampling=SamplingParams(max_new_tokens=4), namespace="v-a"))
    assert engine.cache.num_tokens == cached_before  # nothing of v-b's was evicted for it
    m = engine.run(GenerationRequest(prompt_ids=tuple(kept + [3]), sampling=SamplingParams(max_new_tokens=2),
                                     namespace="v-b"))
    assert m.cached_tokens == 80
    assert engine.run(GenerationRequest(prompt_ids=tuple(rand_ids(72, 30, vocab)),
                                        sampling=SamplingParams(max_new_tokens=2), namespace="v-a")).output_tokens
    assert_clean(engine)


def test_budget_change_while_requests_run_renumbers_their_slots(tiny_runner, make_engine):
    vocab = len(tiny_runner.text.tokenizer)
    engine = make_engine(budget_bytes=600 * tiny_runner.kv_bytes_per_token)
    filler = [rand_ids(80 + i, 40, vocab) for i in range(4)]
    for f in filler:
        engine.run(req(f, 1))
    requests = [req(filler[1][:30] + rand_ids(90 + i, 6, vocab), 30) for i in range(2)]
    handles = [engine.submit(r) for r in requests]
    streams = [iter(h) for h in handles]
    for s in streams:
        while next(s).phase != "decode":
            pass
    held = engine.cache.locked_tokens() + engine.cache.running_tokens
    with pytest.raises(EngineError, match="cannot shrink"):
        engine.set_budget((held - 1) * tiny_runner.kv_bytes_per_token)
    engine.set_budget((held + 10) * tiny_runner.kv_bytes_per_token)  # others evicted, running ones renumbered
    engine.check_invariants()
    metrics = [[e for e in s][-1].metrics for s in streams]
    alone = make_engine(enable_cache=False, max_batch=1)
    assert [m.output_ids for m in metrics] == [alone.run(r).output_ids for r in requests]
    wait_idle(engine)
    assert_clean(engine)


def test_unstorable_request_caches_nothing(tiny_runner, make_engine):
    vocab = len(tiny_runner.text.tokenizer)
    engine = make_engine()
    m = engine.run(GenerationRequest(prompt_ids=tuple(rand_ids(95, 30, vocab)),
                                     sampling=SamplingParams(max_new_tokens=4), store=False))
    assert m.output_tokens == 4 and engine.cache.num_tokens == 0
    assert_clean(engine)


def test_baseline_gets_a_share_of_every_step_under_prefill_load(tiny_runner, make_engine):
    """A request that asked for its no-reuse timing gets it while others keep prefilling
    (review defect: the baseline only got what prefills left of the step's budget; now it runs
    block by block between the steps, ``analysis.no_reuse``)."""
    from analysis.no_reuse import with_no_reuse

    vocab = len(tiny_runner.text.tokenizer)
    engine = make_engine(chunk_tokens=32, max_batch=16)
    timed = engine.submit(req(rand_ids(100, 60, vocab), 1, measure_baseline=True))
    stop = threading.Event()

    def flood():
        i = 0
        while not stop.is_set():
            try:
                handle = engine.submit(req(rand_ids(200 + i, 200, vocab), 1))
            except EngineError:
                time.sleep(0.01)
                continue
            threading.Thread(target=lambda h=handle: list(h), daemon=True).start()
            i += 1
            time.sleep(0.005)

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    try:
        last = list(timed)[-1]
        measured = with_no_reuse(engine, last.metrics)
    finally:
        stop.set()
        t.join()
    assert measured.baseline_prefill_ms is not None
    wait_idle(engine, timeout_s=120)
    assert_clean(engine)
