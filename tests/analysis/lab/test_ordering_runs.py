"""The ordering lab on the tiny random Llama: every variant starts from the same (empty)
state in a namespace of its own, leaves the shared cache as it found it, reports real
engine counts, streams progress and stops when asked."""

from __future__ import annotations

import pytest

from analysis.lab.granularity import simulate_blocks
from analysis.lab.ordering_runs import LabPrompt, Variant, lab_request, run_lab, run_lab_to_end
from components.lab_presets import PRESETS
from engine.engine import Engine
from engine.types import EngineError, GenerationRequest


@pytest.fixture()
def engine(make_engine) -> Engine:
    return make_engine()


def _variants(n: int = 4):
    return PRESETS["Timestamp in the system prompt"].variants(n)


def test_variants_start_from_the_same_state_and_leave_the_cache_clean(engine):
    engine.run(GenerationRequest(prompt="something another visitor cached", namespace=""))
    before = engine.cache.num_tokens
    results = run_lab_to_end(engine, _variants(), measure_baseline=False)
    assert engine.cache.num_tokens == before  # the lab cleared its namespaces
    engine.check_invariants()
    good, bad = results
    assert good.requests[0].cached_tokens == 0 and bad.requests[0].cached_tokens == 0  # both start cold
    assert good.hit_rate > bad.hit_rate
    assert good.namespace != bad.namespace
    # the same variant run again gets exactly the same counts: same starting state
    again = run_lab_to_end(engine, [_variants()[0]], measure_baseline=False)[0]
    assert [q.cached_tokens for q in again.requests] == [q.cached_tokens for q in good.requests]


def test_counts_are_the_engines_own(engine):
    results = run_lab_to_end(engine, _variants(3), measure_baseline=True)
    history = engine.recent(6)
    measured = [m.cached_tokens for m in history]
    assert measured == [q.cached_tokens for r in results for q in r.requests]
    for r in results:
        assert r.prompt_tokens == r.cached_tokens + r.computed_tokens
        assert r.baseline_total_ms is not None and r.speedup is not None
        assert r.total_prefill_ms == pytest.approx(sum(q.prefill_ms for q in r.requests))


def test_tree_left_behind_is_the_variants_own(engine):
    good, bad = run_lab_to_end(engine, _variants(4), measure_baseline=False)
    for r in (good, bad):
        assert r.tree and all(n.namespace == r.namespace for n in r.tree)
        ids = {n.node_id for n in r.tree}
        assert all(n.parent_id == 0 or n.parent_id in ids for n in r.tree)
        assert sum(n.num_tokens for n in r.tree) == len({tuple(q.cached_ids[:i + 1]) for q in r.requests
                                                        for i in range(len(q.cached_ids))})
    # the good ordering shares one long trunk: its tree holds far fewer tokens
    assert sum(n.num_tokens for n in good.tree) < sum(n.num_tokens for n in bad.tree)


@pytest.mark.parametrize("max_new", [1, 3])
def test_token_granularity_simulation_reproduces_the_engine(engine, max_new):
    for r in run_lab_to_end(engine, _variants(4), max_new_tokens=max_new, measure_baseline=False):
        sim = simulate_blocks([q.prompt_ids for q in r.requests], 1, inserted=[q.cached_ids for q in r.requests])
        assert list(sim.cached_per_request) == [q.cached_tokens for q in r.requests]


def test_progress_events_and_stop(engine):
    events = list(run_lab(engine, _variants(3), measure_baseline=False))
    assert [e.done for e in events[:-1]] == list(range(1, 7))
    assert events[-1].finished and not events[-1].stopped and len(events[-1].results) == 2

    calls = {"n": 0}

    def stop_after_two() -> bool:
        calls["n"] += 1
        return calls["n"] > 2

    before = engine.cache.num_tokens
    events = list(run_lab(engine, _variants(3), measure_baseline=False, should_stop=stop_after_two))
    assert events[-1].stopped and events[-1].finished
    assert len(events[-1].results[0].requests) == 2
    assert engine.cache.num_tokens == before


def test_closing_the_generator_clears_the_namespace(engine):
    before = engine.cache.num_tokens
    gen = run_lab(engine, _variants(4), measure_baseline=False)
    first = next(gen)
    assert engine.cache.num_tokens > before  # the first request is cached in the lab namespace
    gen.close()
    assert engine.cache.num_tokens == before
    assert first.done == 1


def test_bad_input_fails_before_running(engine):
    with pytest.raises(EngineError):
        run_lab_to_end(engine, [])
    with pytest.raises(EngineError):
        run_lab_to_end(engine, [Variant("empty prompt", (LabPrompt("r1", prompt="   "),))])
    assert engine.stats().requests == 0


def test_no_cache_engine_is_refused(make_engine):
    with pytest.raises(EngineError, match="cache"):
        run_lab_to_end(make_engine(enable_cache=False), _variants(2))


def test_namespace_of_places_variants(engine):
    results = run_lab_to_end(engine, _variants(2), measure_baseline=False, namespace_of=lambda n: f"v-me/{n}")
    assert all(r.namespace.startswith("v-me/lab-") for r in results)


def test_a_run_is_bounded_in_total_prompt_tokens(engine):
    variants = _variants(4)
    total = sum(len(engine.prompt_ids(lab_request(p))) for v in variants for p in v.prompts)
    with pytest.raises(EngineError, match="in all"):
        next(run_lab(engine, variants, max_prompt_tokens=total - 1))
    assert engine.stats().requests == 0  # refused before anything ran
    assert run_lab_to_end(engine, variants, measure_baseline=False, max_prompt_tokens=total)[0].complete
