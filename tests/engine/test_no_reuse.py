"""The no-reuse timing, on a tiny random Llama: the engine's one primitive (``scratch_prefill``)
leaves the cache as it was and computes what the serving path computes, bit for bit; the analysis
(``analysis.no_reuse``) measures a finished request's other side through it, after the answer,
block by block between the engine's steps, skipped when stopped, cancelled, or long on a public
deployment; the engine itself keeps no state about it."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from analysis.no_reuse import no_reuse_for, run_measured, with_no_reuse
from engine.api import REMOTE
from engine.engine import Engine
from engine.types import CacheKey, GenerationRequest, SamplingParams
from tests.engines import rand_ids
from tests.helpers_app import assert_clean


def req(ids: list[int], max_new: int = 2, **kw) -> GenerationRequest:
    return GenerationRequest(prompt_ids=tuple(ids), sampling=SamplingParams(max_new_tokens=max_new), **kw)


def cache_state(engine: Engine) -> tuple:
    """Everything a read could change: the tree (nodes, locks, hits, access times), the pool's
    use, the counters and the version the panels compare."""
    snap = engine.snapshot()
    nodes = [(n.node_id, n.parent_id, n.token_ids, n.lock_ref, n.hits, n.last_access_s_ago // 60) for n in snap.nodes]
    return (nodes, engine.cache.pool.num_used, engine.cache.num_tokens, engine.cache.locked_tokens(),
            engine.cache.evicted_tokens, engine.cache.version, engine.stats().cached_tokens)


@pytest.fixture
def engine(tiny_runner, make_engine):
    e = make_engine(budget_bytes=2000 * tiny_runner.kv_bytes_per_token)
    yield e


def test_the_primitive_leaves_the_cache_unchanged(engine, tiny_runner):
    vocab = len(tiny_runner.text.tokenizer)
    shared = rand_ids(1, 70, vocab)
    engine.run(req(shared))
    key = engine.cache_key(shared + rand_ids(2, 9, vocab), req(shared))
    before = cache_state(engine)
    full = engine.scratch_prefill(key, 0, block_tokens=16)
    reuse = engine.scratch_prefill(key, 70, block_tokens=16)
    assert (full.reused_tokens, reuse.reused_tokens) == (0, 70)
    assert full.forward_ms > 0 and reuse.forward_ms > 0
    assert cache_state(engine) == before  # no hit, no access time, no lock, no insert, no eviction
    engine.check_invariants()


def test_the_primitive_computes_what_serving_computes(engine, tiny_runner, make_engine):
    """Reuse never changes what the model computes: both sides' last logits equal, bit for bit
    (``torch.equal``), a cache-less engine's prefill of the prompt in the pool."""
    vocab = len(tiny_runner.text.tokenizer)
    shared = rand_ids(3, 50, vocab)
    engine.run(req(shared))
    ids = shared + rand_ids(4, 11, vocab)
    key = engine.cache_key(ids, req(ids))
    cold = make_engine(enable_cache=False)
    want = cold.prefill_in_pool(CacheKey(tuple(ids), key.namespace, 0)).logits.float()
    full = engine.scratch_prefill(key, 0, block_tokens=len(ids))
    reuse = engine.scratch_prefill(key, 50, block_tokens=len(ids))
    assert reuse.reused_tokens == 50
    assert torch.equal(full.last_logits, want) and torch.equal(reuse.last_logits, want)


def test_no_reuse_is_measured_after_the_answer_and_skipped_when_long_and_isolated(tiny_runner, make_engine):
    vocab = len(tiny_runner.text.tokenizer)
    engine = make_engine(chunk_tokens=16)
    m = run_measured(engine, req(rand_ids(90, 40, vocab), 2, measure_baseline=True))
    assert m.baseline_prefill_ms is not None and m.baseline_prefill_ms > 0
    # The scheduler ran the answer only: its prompt once, no forward of the no-reuse side.
    assert sum(rec.computed_tokens for rec in engine.step_log() if rec.kind == "prefill") == 40
    assert {rec.kind for rec in engine.step_log()} <= {"prefill", "decode", "mixed"}
    assert no_reuse_for(engine).figures_of([m.request_id]) == {m.request_id: m.baseline_prefill_ms}
    isolated = make_engine(isolation=True)
    no_reuse_for(isolated).max_tokens_isolated = 30
    assert run_measured(isolated, req(rand_ids(91, 40, vocab), 2, measure_baseline=True,
                                      namespace="v-x")).baseline_prefill_ms is None
    assert run_measured(isolated, req(rand_ids(92, 20, vocab), 2, measure_baseline=True,
                                      namespace="v-x")).baseline_prefill_ms is not None
    assert run_measured(engine, req(rand_ids(93, 20, vocab), 2)).baseline_prefill_ms is None  # not asked
    for e in (engine, isolated):
        assert_clean(e)
        e.close()


def test_a_stopped_or_cancelled_timing_reports_no_figure(engine, tiny_runner):
    vocab = len(tiny_runner.text.tokenizer)
    m = engine.run(req(rand_ids(5, 40, vocab), 2, measure_baseline=True))
    calls = []

    def stop_after_one() -> bool:
        calls.append(1)
        return len(calls) > 1

    timer = no_reuse_for(engine)
    timer.block_tokens = 8
    assert with_no_reuse(engine, m, should_stop=stop_after_one).baseline_prefill_ms is None
    assert len(calls) == 2 and timer.figures_of([m.request_id]) == {} and timer.scratch_bytes == 0
    handle = engine.submit(req(rand_ids(6, 30, vocab), 50, measure_baseline=True))
    next(iter(handle))
    handle.cancel()
    cancelled = list(handle)[-1].metrics
    assert cancelled.finish_reason == "cancelled"
    assert with_no_reuse(engine, cancelled).baseline_prefill_ms is None
    assert_clean(engine)


def test_other_visitors_steps_run_between_blocks(engine, tiny_runner):
    """Each block is its own compute-thread call: before each block after the first, a visitor's
    stream has moved on (a timing that held the model would never let it; the wait would time out)."""
    vocab = len(tiny_runner.text.tokenizer)
    m = engine.run(req(rand_ids(7, 48, vocab), 2, measure_baseline=True))
    visitor = engine.submit(req(rand_ids(8, 10, vocab), 40, namespace="v-other"))
    events = iter(visitor)
    got = threading.Event()
    moved = []

    def before_block() -> None:
        if moved:  # from the second block on: one more event of the visitor's, computed between blocks
            got.clear()
            reader = threading.Thread(target=lambda: (next(events, None), got.set()), daemon=True)
            reader.start()
            assert got.wait(30), "no step ran between two blocks"
        moved.append(1)

    key = CacheKey(tuple(m.prompt_ids), m.namespace, 0)
    done = engine.scratch_prefill(key, 0, block_tokens=8, before_block=before_block)
    assert len(moved) == 6 and done.forward_ms > 0
    list(events)
    assert_clean(engine)


def test_an_engine_without_the_primitive_keeps_its_own_figure():
    """Remote: no ``scratch_prefill``; the figure it measured (a fresh cache salt) stays as it came."""
    remote = SimpleNamespace(capabilities=REMOTE)
    assert no_reuse_for(remote) is None
    m = SimpleNamespace(baseline_prefill_ms=None)
    assert with_no_reuse(remote, m) is m


def test_the_scratch_pool_is_shown_outside_the_budget_with_its_bound(engine, tiny_runner):
    """Memory is a promise: the no-reuse timing's pool is held beside the budget, so the memory
    panel's row names it, with the most it may hold, and it is gone once the timing ends."""
    from components.panels.memory_panel import outside_budget_row
    from components.views.format import fmt_bytes

    timer = no_reuse_for(engine)
    seen = []
    real = engine.scratch_prefill

    def spy(*args, **kw):
        seen.append(timer.scratch_bytes)
        return real(*args, **kw)

    engine.scratch_prefill = spy
    ids = rand_ids(5, 40, len(tiny_runner.text.tokenizer))
    m = run_measured(engine, req(ids, measure_baseline=True))
    assert m.baseline_prefill_ms is not None
    assert seen == [40 * tiny_runner.kv_bytes_per_token]  # held while it ran
    assert timer.scratch_bytes == 0  # and handed back
    bound = tiny_runner.max_context * tiny_runner.kv_bytes_per_token
    assert timer.scratch_bound_bytes == bound
    assert f"no-reuse timing's pool 0 B (at most {fmt_bytes(bound)}, one at a time)" in outside_budget_row(engine)


def test_one_place_decides_whether_a_prompt_is_measured(tiny_runner, make_engine):
    """The cutoff is written once (``skip_reason``), with one condition (a public deployment), and
    the page's sentence comes from there too; elsewhere a long prompt is measured."""
    from analysis.no_reuse import skip_reason, skipped_note
    from components.panels.chat_panel import baseline_skipped

    engine, isolated = make_engine(), make_engine(isolation=True)
    no_reuse_for(isolated).max_tokens_isolated = 30
    assert skip_reason(engine, 10**6) is None and skip_reason(isolated, 30) is None
    assert "31 tokens (over 30)" in skip_reason(isolated, 31)
    assert skip_reason(engine, 5, "cancelled") == "the request was stopped"
    long = GenerationRequest(prompt_ids=tuple(rand_ids(1, 31, 100)), measure_baseline=False)
    assert baseline_skipped(isolated, True, long) == skipped_note(isolated, True, 31)
    assert skipped_note(isolated, True, 31).startswith("No-reuse measurement skipped: the prompt is 31 tokens")
    assert baseline_skipped(isolated, False, long) is None and baseline_skipped(engine, True, long) is None
    for e in (engine, isolated):
        e.close()


def test_a_measured_request_packs_like_any_other(tiny_runner, make_engine):
    """``measure_baseline`` changes nothing in the scheduler: two measured prompts that arrive
    together share their prefill forward, as two unmeasured ones do."""
    vocab = len(tiny_runner.text.tokenizer)
    engine = make_engine()
    with tiny_runner.lock:  # both arrive before a step starts
        hs = [engine.submit(req(rand_ids(40 + i, 20, vocab), 2, measure_baseline=True)) for i in range(2)]
    ms = [list(h)[-1].metrics for h in hs]
    ids = {m.request_id for m in ms}
    assert any(ids <= set(rec.prefill_request_ids) for rec in engine.step_log())
    assert all(m.prefill_shared_step for m in ms)
    assert_clean(engine)
