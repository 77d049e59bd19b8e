"""The first answer right after a start (issue 28): the growth curve's prefills (about 25 s of
compute on two CPU cores) start with the app, in the background; a visitor who asks at once
must not queue behind them.

The fast test starts the app as ``python app.py`` does (warm start, page and API served, growth
curve in the background) on the tiny random Llama and asks over ``/v1`` while the curve is under
way; it counts the curve's compute blocks that start between the question's arrival and its
first token (at most the one already on its way), never seconds. The slow test measures first
text in seconds on the embedded model against the same app idle."""

from __future__ import annotations

import json
import time

import pytest

from analysis.prefill_timing import timer_for
from components.chat_presets import SYSTEM_PRESETS
from components.panels.chat_panel import chat_messages
from components.session import page_keyed
from components.warm_start import chat_default, warm_start
from engine.engine import Engine
from engine.types import GenerationRequest, SamplingParams
from tests.helpers_app import assert_clean, first_token_step, last_step_id, launched_app, wait_idle

QUESTION = ("Here are my notes from this week's support shifts; which of them should go to the "
            "returns team and which to billing? " + " ".join(
                f"Note {i}: a customer wrote about order {1000 + 37 * i}, asking what to do next." for i in range(14)))


def _first_text_s(engine: Engine, visitor: str) -> float:
    msgs = chat_messages(SYSTEM_PRESETS[chat_default(engine)], [], QUESTION)
    ids = engine.prompt_ids(GenerationRequest(messages=tuple(msgs)))
    shared = page_keyed(engine, GenerationRequest(prompt_ids=tuple(ids)), None).key.public_len
    req = GenerationRequest(prompt_ids=tuple(ids), namespace=visitor, public_len=shared,
                            sampling=SamplingParams(max_new_tokens=4), tag="chat")
    t0 = time.perf_counter()
    for event in engine.generate(req):
        if event.token_id is not None:
            first = time.perf_counter() - t0
            break
    else:
        raise AssertionError("no token")
    wait_idle(engine)
    return first


def test_a_question_right_after_start_waits_for_at_most_one_block_of_the_growth_curve(tiny_runner, monkeypatch,
                                                                                      make_engine):
    """The curve's first compute block is held until the question is in the engine (so the
    question arrives while the curve is under way, at an exact point, whatever the machine's
    speed). Its prompt takes four steps of prefill; no block of the curve may start between
    its arrival and its first token (before the curve yielded, one ran between every two steps)."""
    import random
    import threading

    import httpx

    from components.warm_start import start_growth_curve

    engine = make_engine(isolation=True, max_new_tokens_cap=8)
    warm_start(engine)  # before the page is served, as app.py does
    blocks: list[int] = []  # the last step logged when each of the curve's compute blocks started
    held, go = threading.Event(), threading.Event()
    forward_last = tiny_runner.forward_last

    def counted(ids, kv):  # only background work calls it from here on (on the compute thread)
        blocks.append(last_step_id(engine))
        if not held.is_set():
            held.set()
            go.wait(120)
        return forward_last(ids, kv)

    monkeypatch.setattr(tiny_runner, "forward_last", counted)
    forward_paged = tiny_runner.forward_paged

    def counted_paged(pool, *args, **kwargs):  # the curve's timed blocks run on scratch pools (scratch_prefill)
        if pool is not engine.cache.pool:
            blocks.append(last_step_id(engine))
        return forward_paged(pool, *args, **kwargs)

    monkeypatch.setattr(tiny_runner, "forward_paged", counted_paged)
    rng = random.Random(5)
    question = {"prompt": [rng.randrange(1000, 20_000) for _ in range(900)], "max_tokens": 8, "temperature": 0,
                "stream": True}
    steps_of_prefill = -(-900 // engine.scheduler.config.chunk_tokens)
    assert steps_of_prefill >= 4
    with launched_app(engine) as url, httpx.Client(base_url=url, timeout=300) as http:
        curve = start_growth_curve(engine)
        assert curve is not None
        timer = timer_for(engine)
        try:
            assert held.wait(120), "the growth curve did not start"
            with http.stream("POST", "v1/completions", json=question) as reply:
                assert reply.status_code == 200  # submitted: the stream starts once the engine has it
                arrived = last_step_id(engine)  # the compute thread is held: no step runs
                go.set()
                text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in reply.iter_lines()
                               if line.startswith("data: {"))
        finally:
            go.set()
        assert text
        curve.join(300)
    assert timer.curve.state == "done" and len(timer.curve.points) >= 2, timer.curve
    wait_idle(engine)
    mine = engine.recent()[-1]
    token_at = first_token_step(engine, mine.request_id)
    assert token_at is not None and token_at - arrived >= steps_of_prefill
    during = [s for s in blocks[1:] if s < token_at]
    assert not during, (blocks, arrived, token_at)
    assert len(blocks) > 2  # the curve went on after the answer
    assert_clean(engine)


@pytest.mark.slow
def test_first_answer_right_after_start_is_as_fast_as_on_an_idle_app(real_runner, make_engine):
    """Idle first (the app warm and nothing else running), then the growth curve starts as at a
    start (its filler and timed prefills, shortened to two lengths to bound the test) and a
    visitor asks half a second later. A start is tried up to three times and the best counts:
    the suite's other workers share these two cores, and one burst of their work landing on the
    one timed question is not a slow first answer (each try is a fresh visitor and a fresh curve)."""
    import threading

    from components.warm_start import growth_filler

    engine = make_engine(real_runner, isolation=True, max_new_tokens_cap=16)
    warm_start(engine)
    idle = sorted(_first_text_s(engine, f"v-idle-{i}") for i in range(3))
    bound = idle[1] * 1.5 + 0.75  # one background block (at most 256 tokens) may be under way when the visitor asks
    timer = timer_for(engine)
    tries: list[float] = []
    for attempt in range(3):
        curve = threading.Thread(target=timer.growth_curve, args=(growth_filler(engine, 1100),),
                                 kwargs={"lengths": (512, 1024)}, daemon=True)
        curve.start()
        time.sleep(0.5)  # the curve is under way
        assert timer.curve.state == "running"
        tries.append(_first_text_s(engine, f"v-first-{attempt}"))
        curve.join(600)
        assert timer.curve.state == "done", timer.curve
        if tries[-1] <= bound:
            break
    after_start = min(tries)
    print(f"first text right after start {', '.join(f'{s:.2f}' for s in tries)} s; "
          f"idle {', '.join(f'{s:.2f}' for s in idle)} s")
    assert after_start <= bound, (tries, idle)
    assert_clean(engine)
