"""Fair share and fair turns from the scheduler's side (issue 28), on the tiny random Llama:
internal work (the no-reuse baseline) charged to the visitor who asked for it, and a minimum
prefill share for the oldest prompt under steady arrivals."""

from __future__ import annotations

from engine.engine import Engine
from engine.types import PUBLIC, CacheKey, GenerationRequest, SamplingParams
from tests.helpers_app import assert_clean, wait_idle


def _ids(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def test_a_visitors_baseline_evicts_only_within_its_own_share(tiny_runner):
    """B's no-reuse baseline needs room: it must come from B's own cache (or be skipped),
    never from shipped content or from A, who is within its share."""
    per_token = tiny_runner.kv_bytes_per_token
    engine = Engine(tiny_runner, budget_bytes=600 * per_token, isolation=True, max_new_tokens_cap=4)
    capacity = engine.cache.pool.capacity
    shipped = CacheKey(_ids(1000, 200), PUBLIC, 200)
    engine.prefill(shipped, tiny_runner.new_request_kv(200))
    a = _ids(3000, 150)
    engine.run(GenerationRequest(prompt_ids=a, namespace="v-a", sampling=SamplingParams(max_new_tokens=4)))
    a_cached = engine.cache.match_len(CacheKey(a, "v-a"))
    assert a_cached >= 149
    # B's prompt is as long as the free room left: its baseline needs slots that only eviction gives.
    free = capacity - engine.cache.pool.num_used
    b = _ids(5000, max(8, free - 8))
    m = engine.run(GenerationRequest(prompt_ids=b, namespace="v-b", measure_baseline=True,
                                     sampling=SamplingParams(max_new_tokens=4)))
    wait_idle(engine)
    assert engine.cache.match_len(shipped) == 200, "a visitor's baseline evicted shipped content"
    assert engine.cache.match_len(CacheKey(a, "v-a")) == a_cached, "B's baseline evicted A within A's share"
    assert m.baseline_prefill_ms is None or m.baseline_prefill_ms > 0
    assert_clean(engine)
