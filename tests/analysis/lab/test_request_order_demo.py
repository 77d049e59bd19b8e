"""Request order under a small budget, run for real on the tiny random Llama: longest-
prefix-match first beats first-come-first-served on the preset queue (cached token
counts do not depend on the weights)."""

from __future__ import annotations

import pytest

from analysis.lab.request_order_demo import (
    FCFS,
    LPM,
    MAX_DEMO_TOKENS,
    RequestOrderDemo,
    demo_pool_bytes,
    request_order_demo_for,
)
from components.lab_presets import scheduling_queue
from engine.types import EngineBusy, EngineError


def _run(lab, queue, budget):
    events = list(lab.compare(queue, budget))
    assert events[-1].finished and not events[-1].stopped
    return {r.policy: r for r in events[-1].results}


def test_lpm_beats_fcfs_on_the_preset_queue(tiny_runner, make_engine):
    lab = RequestOrderDemo(make_engine())
    queue = scheduling_queue(per_group=3, groups=3)
    events = lab.compare(queue, 520)
    first = next(events)
    engine = lab._engine  # the demo's own engine lives while the comparison runs
    rest = list(events)
    assert rest[-1].finished and not rest[-1].stopped and first.done == 1
    res = {r.policy: r for r in rest[-1].results}
    fcfs, lpm = res[FCFS], res[LPM]
    assert lpm.hit_rate > fcfs.hit_rate + 0.3
    assert [q.label for q in fcfs.requests] == [p.label for p in queue]
    assert [q.label for q in lpm.requests] == ["A1", "A2", "A3", "B1", "B2", "B3", "C1", "C2", "C3"]
    assert sorted(q.queue_index for q in lpm.requests) == list(range(len(queue)))
    engine.check_invariants()
    assert engine.cache.budget_bytes == 520 * tiny_runner.kv_bytes_per_token
    assert all(m.cache_bytes <= m.cache_budget_bytes for m in engine.recent())


def test_budget_large_enough_makes_the_order_irrelevant(make_engine):
    res = _run(RequestOrderDemo(make_engine()), scheduling_queue(2, 2), budget=5000)
    assert res[FCFS].cached_tokens == res[LPM].cached_tokens


def test_one_comparison_at_a_time_and_bad_settings(make_engine):
    lab = RequestOrderDemo(make_engine())
    gen = lab.compare(scheduling_queue(2, 2), 520)
    next(gen)
    with pytest.raises(EngineBusy):
        next(lab.compare(scheduling_queue(2, 2), 520))
    gen.close()  # releases the lab
    _run(lab, scheduling_queue(2, 2), 520)
    for args in (((), 520), (scheduling_queue(2, 2), 0)):
        with pytest.raises(EngineError):
            next(lab.compare(*args))
    with pytest.raises(EngineError):
        next(lab.compare(scheduling_queue(2, 2), 520, policies=("random",)))


def test_stop_and_one_lab_per_runner(make_engine):
    facade = make_engine()  # the app's engine: the demo's small engine is spawned by it
    lab = request_order_demo_for(facade)
    assert request_order_demo_for(facade) is lab
    calls = {"n": 0}

    def stop() -> bool:
        calls["n"] += 1
        return calls["n"] > 3

    events = list(lab.compare(scheduling_queue(2, 2), 520, should_stop=stop))
    assert events[-1].stopped and len(events[-1].results[0].requests) < 4
    assert lab._engine is None and lab.pool_bytes == 0  # stopped: its pool is given back too


def test_the_demos_pool_is_bounded_shown_and_given_back(tiny_runner, make_engine):
    """Outside the cache budget, so: at most MAX_DEMO_TOKENS, counted while a comparison runs,
    and freed when it ends (nothing keeps its tensors for the life of the process)."""
    import gc
    import weakref

    from components.panels.memory_panel import memory_markdown
    from components.views.format import fmt_bytes

    facade = make_engine()
    lab = request_order_demo_for(facade)
    with pytest.raises(EngineError, match="at most"):
        next(lab.compare(scheduling_queue(2, 2), MAX_DEMO_TOKENS + 1))
    events = lab.compare(scheduling_queue(2, 2), 4000)
    next(events)
    pool = weakref.ref(lab._engine.cache.pool.k[0])
    assert lab.pool_bytes == demo_pool_bytes(facade) == 4000 * tiny_runner.kv_bytes_per_token
    assert f"request-order demo's pool {fmt_bytes(lab.pool_bytes)}" in memory_markdown(facade, [])
    list(events)
    gc.collect()
    assert lab.pool_bytes == 0 and pool() is None, "the demo's pool outlived its comparison"
    assert "request-order demo's pool 0 B" in memory_markdown(facade, [])


def test_leaving_a_cached_node_midway_does_not_pin_its_rest(tiny_runner, make_engine):
    """Under a tight budget, a request that shares only a few tokens with a big cached node
    must be able to evict that node's unmatched rest to cache itself (only the matched part
    is locked while it runs)."""
    from engine.types import GenerationRequest, SamplingParams

    engine = make_engine(budget_bytes=520 * tiny_runner.kv_bytes_per_token)
    common = list(range(100, 105))
    a, b = common + list(range(1000, 1353)), common + list(range(2000, 2297))
    one = SamplingParams(max_new_tokens=1)
    engine.run(GenerationRequest(prompt_ids=tuple(a), sampling=one))
    m = engine.run(GenerationRequest(prompt_ids=tuple(b), sampling=one))
    assert m.cached_tokens == 5 and m.inserted_tokens == len(b) - 5
    again = engine.run(GenerationRequest(prompt_ids=tuple(b[:-1] + [7]), sampling=one))
    assert again.cached_tokens == len(b) - 1
    engine.check_invariants()
    assert engine.cache.locked_tokens() == 0
