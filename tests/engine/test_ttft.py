"""Time to first token counts from arrival (as vLLM counts it), so queueing shows in it and in
the Prometheus histogram; queue time has a histogram of its own; a request cancelled before
its first token has no time to first token at all."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from engine.types import GenerationRequest, SamplingParams
from server.metrics import EngineMetrics
from tests.helpers_app import assert_clean, wait_idle

HELD_S = 0.4


def samples(metrics: EngineMetrics) -> dict[str, float]:
    text = metrics.text().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if not s.labels or s.labels.get("le") is None}


def test_ttft_counts_the_time_a_request_waited(tiny_runner, make_engine):
    engine = make_engine(max_new_tokens_cap=4)
    metrics = EngineMetrics(lambda: engine)
    with tiny_runner.lock:  # the model is busy: the request waits in the queue
        handle = engine.submit(GenerationRequest(prompt="Wait your turn.", sampling=SamplingParams(max_new_tokens=2)))
        time.sleep(HELD_S)
    m = list(handle)[-1].metrics
    assert m.queue_ms >= HELD_S * 1000 * 0.9
    assert m.ttft_ms >= m.queue_ms + m.prefill_ms * 0.5  # arrival -> queue -> prefill -> first token
    got = samples(metrics)
    assert got["radix_time_to_first_token_seconds_count"] == 1
    assert got["radix_time_to_first_token_seconds_sum"] == m.ttft_ms / 1000 >= HELD_S * 0.9
    assert got["radix_request_queue_time_seconds_count"] == 1
    assert abs(got["radix_request_queue_time_seconds_sum"] - m.queue_ms / 1000) < 1e-9
    wait_idle(engine)
    assert_clean(engine)


def test_a_request_cancelled_before_its_first_token_has_no_ttft(make_engine):
    engine = make_engine(max_new_tokens_cap=4, chunk_tokens=16)
    metrics = EngineMetrics(lambda: engine)
    handle = engine.submit(GenerationRequest(prompt="a long prompt to prefill in chunks " * 30,
                                             sampling=SamplingParams(max_new_tokens=4)))
    events = []
    for event in handle:
        events.append(event)
        if event.phase == "prefill":
            handle.cancel()  # mid-prefill: no token has been sampled yet
    m = events[-1].metrics
    assert m is not None and m.finish_reason == "cancelled" and m.output_tokens == 0
    assert m.ttft_ms is None and m.queue_ms >= 0
    got = samples(metrics)
    assert got["radix_time_to_first_token_seconds_count"] == 0  # not observed
    assert got["radix_request_queue_time_seconds_count"] == 1
    wait_idle(engine)
    assert_clean(engine)
