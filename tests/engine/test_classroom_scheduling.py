"""A classroom behind one address, a flood from one address, and many addresses at once (issue 43),
on the tiny random Llama with isolation on, counted in scheduler steps (never seconds):

- many tabs of one address on an idle server run in the same batches (the isolation rule is
  work-conserving), and a second address that arrives is admitted and prefilled ahead of them;
- one address never holds every row: a reserve stays for whoever arrives;
- many addresses with one tab each are all admitted in one step, as before;
- the engine's inbox: one address may hold at most half the waiting places, with a message
  saying how many it has; others still get theirs, and a running request holds no place.
"""

from __future__ import annotations

import math

import pytest

from engine.engine import Engine
from engine.namespaces import owner_of
from engine.scheduler.policy import owner_row_cap
from engine.types import EngineBusy, GenerationRequest, SamplingParams
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


def _ask(engine: Engine, ids, namespace: str, new_tokens: int = 4):
    return engine.submit(GenerationRequest(prompt_ids=ids, namespace=namespace,
                                           sampling=SamplingParams(max_new_tokens=new_tokens)))


def _running_of(engine: Engine, owner: str) -> int:
    return sum(owner_of(r.namespace) == owner for r in list(engine.scheduler.running))


def test_eight_tabs_behind_one_address_run_in_the_same_batches(make_engine):
    engine = make_engine(isolation=True, max_new_tokens_cap=8, chunk_tokens=256)
    gate = StepGate(engine)
    try:
        # The eight arrive together: the worker, woken by the first, waits for the runner's lock
        # until the last is in the inbox (else a busy machine can start a step between two tabs).
        with engine.runner.lock:
            tabs = [_ask(engine, _ids(1000 + 100 * i, 24), f"v-class/s-{i}") for i in range(8)]
    finally:
        gate.open()
    for h in tabs:
        assert list(h)[-1].done
    wait_idle(engine)
    first = {first_chunk_step(engine, h.request_id) for h in tabs}
    tokens = {first_token_step(engine, h.request_id) for h in tabs}
    assert len(first) == 1 and len(tokens) == 1, (first, tokens)  # one step: all eight prefilled together
    assert_clean(engine)


def test_a_second_address_goes_ahead_of_a_classroom(make_engine):
    """Eight tabs of one address are prefilling long prompts; a visitor from another address
    arrives: admitted at once (rows are free) and prefilled ahead of the class's remaining chunks
    but for the oldest prompt's share, so its first token comes within
    ``2 + ceil(question / (chunk - oldest share))`` steps of its arrival, before any tab's."""
    engine = make_engine(isolation=True, max_new_tokens_cap=8, chunk_tokens=64)
    config = engine.scheduler.config
    question = _ids(9000, 40)
    bound = 2 + math.ceil(len(question) / (config.chunk_tokens - config.oldest_prefill_tokens))
    gate = StepGate(engine)
    try:
        with engine.runner.lock:  # the eight arrive together (see the test above)
            tabs = [_ask(engine, _ids(1000 + 700 * i, 600), f"v-class/s-{i}") for i in range(8)]
        gate.allow(2)
        wait_for(lambda: last_step_id(engine) == 2, what="the class's first two steps")
        assert _running_of(engine, "v-class") == 8, "the class was not admitted together on an idle server"
        other = _ask(engine, question, "v-other/s-0")
        arrived = last_step_id(engine)
    finally:
        gate.open()
    for h in [other, *tabs]:
        assert list(h)[-1].done
    wait_idle(engine)
    token_at = first_token_step(engine, other.request_id)
    assert token_at is not None and token_at - arrived <= bound, (token_at, arrived, bound)
    assert all(first_token_step(engine, h.request_id) > token_at for h in tabs)
    assert_clean(engine)


def test_one_address_leaves_rows_for_whoever_arrives(make_engine):
    engine = make_engine(isolation=True, max_new_tokens_cap=8, max_batch=4, chunk_tokens=64)
    cap = owner_row_cap(engine.scheduler.config)
    assert cap == 3
    gate = StepGate(engine)
    try:
        with engine.runner.lock:  # the flood arrives at once (the first test says why)
            flood = [_ask(engine, _ids(1000 + 500 * i, 400), f"v-flood/s-{i}") for i in range(6)]
        gate.allow(1)
        wait_for(lambda: last_step_id(engine) == 1, what="the flood's first step")
        assert _running_of(engine, "v-flood") == cap
        other = _ask(engine, _ids(9000, 20), "v-other/s-0")
        arrived = last_step_id(engine)
        gate.allow(2)  # the step already at the gate took the inbox before it came; the next one admits it
        wait_for(lambda: last_step_id(engine) == arrived + 2, what="two more steps")
        assert first_chunk_step(engine, other.request_id) == arrived + 2, "the newcomer waited for a row"
    finally:
        gate.open()
    for h in [other, *flood]:
        assert list(h)[-1].done
    wait_idle(engine)
    assert_clean(engine)


def test_many_addresses_with_one_tab_each_are_admitted_together(make_engine):
    engine = make_engine(isolation=True, max_new_tokens_cap=8, chunk_tokens=256)
    gate = StepGate(engine)
    try:
        with engine.runner.lock:  # the eight arrive together (the first test says why)
            handles = [_ask(engine, _ids(1000 + 100 * i, 24), f"v-addr{i}/s-0") for i in range(8)]
    finally:
        gate.open()
    for h in handles:
        assert list(h)[-1].done
    wait_idle(engine)
    assert len({first_chunk_step(engine, h.request_id) for h in handles}) == 1
    assert_clean(engine)


def test_one_address_holds_at_most_half_the_inbox(make_engine):
    engine = make_engine(isolation=True, max_new_tokens_cap=4, max_queue=8)
    assert engine.max_waiting_per_owner == 4
    gate = StepGate(engine)
    handles = []
    try:
        handles += [_ask(engine, _ids(1000 + 50 * i, 20), f"v-a/s-{i}") for i in range(4)]
        with pytest.raises(EngineBusy, match="you already have 4 requests waiting"):
            _ask(engine, _ids(5000, 20), "v-a/s-new")  # a new tab of the same address: no place
        handles += [_ask(engine, _ids(6000 + 50 * i, 20), f"v-b/s-{i}") for i in range(4)]  # others still fit
        with pytest.raises(EngineBusy, match="too many requests are waiting"):
            _ask(engine, _ids(7000, 20), "v-c/s-0")  # the inbox itself is full
        gate.allow(1)
        wait_for(lambda: last_step_id(engine) == 1, what="one step")
        # Admitted requests hold no waiting place: the address may ask again.
        handles.append(_ask(engine, _ids(8000, 20), "v-a/s-new"))
    finally:
        gate.open()
    for h in handles:
        assert list(h)[-1].done
    wait_idle(engine)
    assert_clean(engine)


def test_without_isolation_nothing_is_counted_per_address(make_engine):
    engine = make_engine(isolation=False, max_new_tokens_cap=4, max_queue=8)
    gate = StepGate(engine)
    try:
        handles = [_ask(engine, _ids(1000 + 50 * i, 20), "v-a/s-0") for i in range(8)]
    finally:
        gate.open()
    for h in handles:
        assert list(h)[-1].done
    wait_idle(engine)
    assert_clean(engine)
