"""The first answer right after a start (issue 28): the growth curve's prefills (about 25 s of
compute on two CPU cores) start with the app, in the background; a visitor who asks at once
must get first text about as fast as on the same app idle. Both measured in one run, on the
embedded model, through the engine the page uses."""

from __future__ import annotations

import time

import pytest

from components.chat_panel import chat_messages
from components.chat_presets import SYSTEM_PRESETS
from components.session import public_len
from components.warm_start import chat_default, warm_start
from engine.engine import Engine
from engine.types import GenerationRequest, SamplingParams
from tests.helpers_app import assert_clean, wait_idle

QUESTION = ("Here are my notes from this week's support shifts; which of them should go to the "
            "returns team and which to billing? " + " ".join(
                f"Note {i}: a customer wrote about order {1000 + 37 * i}, asking what to do next." for i in range(14)))


def _first_text_s(engine: Engine, visitor: str) -> float:
    msgs = chat_messages(SYSTEM_PRESETS[chat_default(engine)], [], QUESTION)
    ids = engine.prompt_ids(GenerationRequest(messages=tuple(msgs)))
    req = GenerationRequest(prompt_ids=tuple(ids), namespace=visitor, public_len=public_len(engine, ids),
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


@pytest.mark.slow
def test_first_answer_right_after_start_is_as_fast_as_on_an_idle_app(real_runner):
    """Idle first (the app warm and nothing else running), then the growth curve starts as at a
    start (its filler and timed prefills, shortened to two lengths to bound the test) and a
    visitor asks half a second later."""
    import threading

    from components.warm_start import growth_filler

    engine = Engine(real_runner, isolation=True, max_new_tokens_cap=16)
    warm_start(engine)
    idle = sorted(_first_text_s(engine, f"v-idle-{i}") for i in range(3))
    timer = engine.prefill_timer()
    curve = threading.Thread(target=timer.growth_curve, args=(growth_filler(engine, 1100),),
                             kwargs={"lengths": (512, 1024)}, daemon=True)
    curve.start()
    time.sleep(0.5)  # the curve is under way
    assert timer.curve.state == "running"
    after_start = _first_text_s(engine, "v-first")
    print(f"first text right after start {after_start:.2f} s; idle {', '.join(f'{s:.2f}' for s in idle)} s")
    curve.join(600)
    assert timer.curve.state == "done", timer.curve
    # One background block (at most 256 tokens) may be under way when the visitor asks.
    assert after_start <= idle[1] * 1.5 + 0.75, (after_start, idle)
    assert_clean(engine)
