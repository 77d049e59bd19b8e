"""Honest numbers and clear states (issue 15) without a browser: formatters, the numbers
card when nothing was reused, ratios the right way round, the queue in the wait, lab runs
kept out of the playground's totals, yours/everyone's labels, Stop on a queued request,
and a new chat with fitting starters when the system prompt changes (tiny random Llama)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from analysis.no_reuse import run_measured
from components.chat_presets import CUSTOM_SYSTEM, DEFAULT_SYSTEM, STARTERS_BY_PRESET
from components.panels.chat_panel import IDLE_NUMBERS, on_preset, respond, stop_running
from components.panels.common import long_prompt_note, metrics_markdown, playground_history, status_markdown
from components.panels.overview_panel import key_numbers_html
from components.session import visitor_namespace
from components.views.format import clamp_int, fmt_ms, plural, ratio_words, reuse_words
from engine.engine import Engine
from engine.types import GenerationEvent, GenerationRequest, SamplingParams


@pytest.fixture(scope="module")
def engine(make_module_engine) -> Engine:
    return make_module_engine(max_new_tokens_cap=8)


def run(engine: Engine, prompt: str, tag: str = "chat", namespace: str = "", baseline: bool = True):
    return run_measured(engine, GenerationRequest(prompt=prompt, measure_baseline=baseline, tag=tag,
                                                  namespace=namespace, sampling=SamplingParams(max_new_tokens=2)))


def test_formatters_say_it_the_right_way_round():
    assert ratio_words(591, 475) == "1.2× faster"
    assert ratio_words(100, 143) == "1.4× slower"  # never "0.7× faster"
    assert ratio_words(100, 104) == "about the same speed"
    assert reuse_words(0, 188, 591, 475) == "nothing reused"  # a ratio here would be timing noise
    assert reuse_words(5, 188, 591, 475) == "too little reused"
    assert reuse_words(170, 188, 1000, 300) == "3.3× faster"
    assert reuse_words(170, 188, None, 300) == "–"
    assert [fmt_ms(None), fmt_ms(475.2), fmt_ms(1583), fmt_ms(123_456)] == ["–", "475 ms", "1.6 s", "123 s"]
    assert [plural(1, "request"), plural(2, "request")] == ["1 request", "2 requests"]
    assert [clamp_int(v, 7, 1, 10) for v in (None, "x", float("nan"), float("inf"), -5, "3", 4.9)] == \
        [7, 7, 7, 10, 1, 3, 4]


def test_numbers_card_when_nothing_was_reused_and_after_stop(engine):
    m = run(engine, "a prompt nobody sent before, about otters")
    assert m.cached_tokens == 0
    text = metrics_markdown(m)
    assert "nothing reused" in text and "timing noise" in text and "faster" not in text
    assert m.ttft_ms >= m.queue_ms  # from arrival: the queue is part of it
    assert f"{fmt_ms(m.ttft_ms)} (queue {fmt_ms(m.queue_ms)} + engine {fmt_ms(m.ttft_ms - m.queue_ms)})" in text
    stopped = metrics_markdown(dataclasses.replace(m, finish_reason="cancelled", output_tokens=1))
    assert stopped.startswith("**Stopped** after 1 token")
    early = metrics_markdown(dataclasses.replace(m, finish_reason="cancelled", output_tokens=0, ttft_ms=None))
    assert "stopped before the first token" in early and "None" not in early


def test_long_prompt_gets_a_size_and_an_estimate(engine):
    run(engine, "word " * 80)  # one request to learn this machine's speed from
    assert long_prompt_note(engine, 100) is None
    note = long_prompt_note(engine, 5000)
    assert "5,000 tokens to prefill, about " in note and "recent speed" in note


def test_status_names_the_phase():
    assert "3 requests ahead of you" in status_markdown(GenerationEvent("", phase="queued", queue_ahead=3), 2.0)
    prefill = status_markdown(GenerationEvent("", phase="prefill", prompt_tokens=1000, prefilled_tokens=250,
                                              cached_tokens=200))
    assert "250 of 1,000 tokens" in prefill and "200 of them from the cache" in prefill
    assert "without reuse" in status_markdown(GenerationEvent("hi", phase="baseline"))
    assert "Writing the answer" in status_markdown(GenerationEvent("hello there", token_id=5))


def test_lab_runs_stay_out_of_the_playground_totals(make_engine):
    engine = make_engine(isolation=True, max_new_tokens_cap=8)
    mine = visitor_namespace(SimpleNamespace(session_hash="visitor-a"), engine)
    run(engine, "my own question about tents", namespace=mine)
    run(engine, "a lab prompt, deliberately badly ordered", tag="ordering-lab", namespace=mine)
    run(engine, "another lab prompt", tag="lab-something", namespace=mine)
    history = playground_history(engine, namespace=mine)
    assert [m.tag for m in history] == ["chat"]
    html = key_numbers_html(engine, history[-1], mine)
    assert "over your 1 request " in html  # singular, and only the visitor's own chat
    assert "everyone's KV cache" in html


def test_stop_on_a_queued_request_says_stopped(make_engine):
    engine = make_engine(max_new_tokens_cap=8)
    visitor = SimpleNamespace(session_hash="stopper")
    with engine.runner.lock:  # the worker cannot start the request: it waits in the queue
        steps = respond(engine, "Hello?", [], "Pirate", "", 8, True, True, visitor)
        first = next(steps)
        assert "Waiting" in first[3] or "Prefilling" in first[3]
        stop_running("chat", visitor)
        # The request was registered and cancelled; the stream ends saying so.
    outs = list(steps)
    assert outs and "Stopped" in outs[-1][3]


def test_a_new_system_prompt_starts_a_new_chat_with_fitting_starters(engine):
    out = on_preset(engine, CUSTOM_SYSTEM)
    assert out[3] == [] and out[5] == IDLE_NUMBERS and out[6] is None and out[7] is None  # chat, numbers, metrics
    assert all(b.get("visible") is False for b in out[8:])  # no support-agent starters on a custom prompt
    out = on_preset(engine, "Pirate")
    assert [b["value"] for b in out[8:]] == STARTERS_BY_PRESET["Pirate"]
    assert "win is small" in out[2]  # a short prompt: the hint points at the long handbook
    assert STARTERS_BY_PRESET[DEFAULT_SYSTEM][0] in ("How long is the warranty on tents?",)


def test_cached_line_says_which_tier_the_cached_tokens_came_from():
    from types import SimpleNamespace

    from components.views.format import cached_line

    m = SimpleNamespace(cached_tokens=2300, prompt_tokens=2320, computed_tokens=20, tier_tokens=2240, tier_load_ms=180.0)
    line = cached_line(m)
    assert "2,300 of 2,320" in line and "60 from memory, 2,240 loaded back from the second tier" in line
    assert "second tier" not in cached_line(SimpleNamespace(**{**vars(m), "tier_tokens": 0}))
