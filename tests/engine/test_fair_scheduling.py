"""Fair share and fair turns from the scheduler's side (issue 28), on the tiny random Llama:
internal work (the no-reuse timing) never evicting anyone (a scratch pool), a minimum
prefill share for the oldest prompt under steady arrivals, and another visitor's first token
within a bounded number of steps while one visitor runs two long prompts (counted in steps
from the step log, never in seconds: the test machine is shared)."""

from __future__ import annotations

from engine.types import PUBLIC, CacheKey, GenerationRequest, SamplingParams
from tests.helpers_app import (
    StepGate,
    assert_clean,
    first_chunk_step,
    first_token_step,
    last_step_id,
    wait_for,
    wait_idle,
)


def _ids(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def test_a_visitors_baseline_evicts_only_within_its_own_share(tiny_runner, make_engine):
    """B's no-reuse timing must never take room from shipped content or from A, who is within
    its share: it runs on a scratch pool of its own, outside the cache (``analysis.no_reuse``)."""
    from analysis.no_reuse import run_measured

    per_token = tiny_runner.kv_bytes_per_token
    engine = make_engine(budget_bytes=600 * per_token, isolation=True, max_new_tokens_cap=4)
    capacity = engine.cache.pool.capacity
    shipped = CacheKey(_ids(1000, 200), PUBLIC, 200)
    engine.prefill(shipped, tiny_runner.new_request_kv(200))
    a = _ids(3000, 150)
    engine.run(GenerationRequest(prompt_ids=a, namespace="v-a", sampling=SamplingParams(max_new_tokens=4)))
    a_cached = engine.cache.match_len(CacheKey(a, "v-a"))
    assert a_cached >= 149
    # B's prompt is as long as the free room left: in the pool its timing would need eviction.
    free = capacity - engine.cache.pool.num_used
    b = _ids(5000, max(8, free - 8))
    m = run_measured(engine, GenerationRequest(prompt_ids=b, namespace="v-b", measure_baseline=True,
                                               sampling=SamplingParams(max_new_tokens=4)))
    wait_idle(engine)
    assert engine.cache.match_len(shipped) == 200, "a visitor's baseline evicted shipped content"
    assert engine.cache.match_len(CacheKey(a, "v-a")) == a_cached, "B's baseline evicted A within A's share"
    assert m.baseline_prefill_ms is not None and m.baseline_prefill_ms > 0
    assert_clean(engine)


def _starvation_run(make_engine, tiny_runner, share: float, seconds: float) -> tuple[float | None, int]:
    """A 160-token prompt under steady arrivals of 40-token prompts (each needs two 32-token
    chunks, so a newcomer with none done is always ahead of the long one): seconds until the
    long prompt's first token (None: not within ``seconds``) and the arrivals meanwhile."""
    import dataclasses
    import threading
    import time

    engine = make_engine(budget_bytes=20_000 * tiny_runner.kv_bytes_per_token, chunk_tokens=32,
                         max_batch=64, max_queue=64, max_new_tokens_cap=4)
    engine.scheduler.config = dataclasses.replace(engine.scheduler.config, oldest_prefill_share=share)
    long_ids = _ids(2000, 160)
    stop = threading.Event()
    sent = [0]

    def arrivals() -> None:  # keep three short prompts waiting at all times
        i = 0
        while not stop.is_set():
            if engine.stats().queue_depth < 3:
                engine.submit(GenerationRequest(prompt_ids=_ids(10_000 + 50 * (i % 150), 40),
                                                sampling=SamplingParams(max_new_tokens=1)))
                i += 1
                sent[0] = i
            else:
                time.sleep(0.001)

    feeder = threading.Thread(target=arrivals, daemon=True)
    feeder.start()
    try:
        while sent[0] < 6:  # arrivals are steady before the long prompt comes
            time.sleep(0.01)
        t0 = time.monotonic()
        handle = engine.submit(GenerationRequest(prompt_ids=long_ids, sampling=SamplingParams(max_new_tokens=2)))
        first = None
        for event in handle:
            if event.token_id is not None and first is None:
                first = time.monotonic() - t0
                break
            if time.monotonic() - t0 > seconds:
                break
        handle.cancel()
        during = sent[0]
    finally:
        stop.set()
        feeder.join()
    wait_idle(engine)
    assert_clean(engine)
    return (first if first is not None and first <= seconds else None), during


def test_oldest_prompt_gets_a_minimum_prefill_share_under_steady_arrivals(tiny_runner, make_engine):
    first, arrivals = _starvation_run(make_engine, tiny_runner, share=0.25, seconds=60.0)
    assert first is not None, "the long prompt starved under steady arrivals"
    assert arrivals > 10  # the arrivals really were steady meanwhile


def test_two_long_prompts_of_one_visitor_do_not_delay_anothers_first_token(make_engine):
    """Visitor A sends two long prompts (measuring the no-reuse baseline, as the few-shot tab does);
    with nobody else waiting both run (the isolation rule is work-conserving). B asks a short
    question once A's prompts are two chunks into their prefill. B is admitted at once, and its
    prompt goes ahead of A's remaining chunks (B has fewer running requests) but for the oldest
    prompt's minimum share: its first token comes within ``2 + ceil(question / (chunk - oldest
    share))`` steps of its arrival (the step under way when it arrives, the one where A's first
    takes the budget, then its own chunks), and before A's prompts are done."""
    import math

    engine = make_engine(isolation=True, max_new_tokens_cap=8)
    config = engine.scheduler.config
    question = _ids(7000, 48)
    bound = 2 + math.ceil(len(question) / (config.chunk_tokens - config.oldest_prefill_tokens))
    long_a = [_ids(2000, 900), _ids(4000, 900)]
    gate = StepGate(engine)
    try:
        with engine.runner.lock:  # both arrive together: no step starts between the two submits
            a = [engine.submit(GenerationRequest(prompt_ids=ids, namespace="v-a", measure_baseline=True,
                                                 sampling=SamplingParams(max_new_tokens=8))) for ids in long_a]
        gate.allow(2)
        wait_for(lambda: last_step_id(engine) == 2, what="A's first two chunks")
        # Both admitted at once; the first's chunk takes step 1's budget, the second starts in step 2.
        assert [first_chunk_step(engine, h.request_id) for h in a] == [1, 2], "A's second waited on an idle server"
        b = engine.submit(GenerationRequest(prompt_ids=question, namespace="v-b",
                                            sampling=SamplingParams(max_new_tokens=4)))
        arrived = last_step_id(engine)
    finally:
        gate.open()
    for h in [b, *a]:
        assert list(h)[-1].done  # every stream ends with its result
    wait_idle(engine)
    token_at = first_token_step(engine, b.request_id)
    assert token_at is not None and token_at - arrived <= bound, (token_at, arrived, bound)
    assert all(first_token_step(engine, h.request_id) > token_at for h in a), "A's prompts went ahead of B's"
    assert_clean(engine)
