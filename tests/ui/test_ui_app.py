"""The launched app on the real embedded model, driven by gradio_client like a visitor:
two chat turns and a few-shot request stream real text, the second turn is served
mostly from the cache, and the tree snapshot holds what was sent."""

from __future__ import annotations

import re

import pytest

from components.chat_presets import DEFAULT_SYSTEM, FEW_SHOT_PRESETS, STARTER_QUESTIONS, SYSTEM_PRESETS
from tests.components.test_ui_build import tree_paths
from tests.helpers_app import assert_clean, flat_text, launched_app, visitor, wait_idle

pytestmark = pytest.mark.slow

CACHED_RE = re.compile(r"\*\*([\d,]+) of ([\d,]+) prompt tokens served from the cache\*\*")


def cached_of(numbers_md: str) -> tuple[int, int]:
    m = CACHED_RE.search(numbers_md)
    assert m, numbers_md
    return int(m.group(1).replace(",", "")), int(m.group(2).replace(",", ""))


@pytest.fixture(scope="module")
def app(real_runner, make_module_engine):
    engine = make_module_engine(real_runner, budget_bytes=256 * 2**20, max_new_tokens_cap=64)
    with launched_app(engine) as url:
        yield engine, url


def chat_turn(client, text: str, history: list, max_new: int = 12):
    """One streamed chat turn: (every streamed output, the last one)."""
    job = client.submit(text, history, DEFAULT_SYSTEM, "", max_new, True, api_name="/chat")
    outputs = list(job)
    return outputs, job.result()


def test_two_chat_turns_and_a_fewshot_request(app):
    engine, url = app
    client = visitor(url)
    streamed1, (history1, box1, tokens1, numbers1) = chat_turn(client, STARTER_QUESTIONS[0], [])
    replies = [flat_text(out[0][-1]["content"]) for out in streamed1 if out[0] and out[0][-1]["role"] == "assistant"]
    grown = [r for r in replies if r]
    assert len(set(grown)) >= 3, "the reply should arrive token by token"
    assert len(grown[-1]) > len(grown[0])
    assert flat_text(history1[-1]["content"]).strip() and box1 == ""
    cached1, prompt1 = cached_of(numbers1)

    _, (history2, _, tokens2, numbers2) = chat_turn(client, STARTER_QUESTIONS[1], history1)
    cached2, prompt2 = cached_of(numbers2)
    assert len(history2) == 4
    assert cached2 > cached1 and cached2 >= prompt1  # turn 1's prompt (and most of its reply) came from the cache
    assert cached2 / prompt2 > 0.8
    assert "without reuse" in numbers2 and "×" in numbers2  # baseline measured on the same request
    labels = [label for _, label in ((t["token"], t["class_or_confidence"]) for t in tokens2)]
    assert labels[0] == "cached" and labels[-1] == "computed"

    preset = FEW_SHOT_PRESETS["Sentiment"]
    table = {"headers": ["Input", "Output"], "data": [list(e) for e in preset["examples"]]}
    job = client.submit(preset["instruction"], table, preset["queries"][0], False, 4, False, api_name="/fewshot")
    streamed = list(job)
    answer, _, numbers3 = job.result()
    assert answer.strip() and len(streamed) >= 2
    cached_of(numbers3)

    snap = client.predict(api_name="/tree_snapshot")
    wait_idle(engine)
    assert_clean(engine)
    assert snap["num_tokens"] == engine.snapshot().num_tokens
    paths = tree_paths(snap)
    system_text = SYSTEM_PRESETS[DEFAULT_SYSTEM]
    assert any(system_text in p and STARTER_QUESTIONS[0] in p and STARTER_QUESTIONS[1] in p for p in paths)
    assert any(preset["instruction"] in p and preset["queries"][0] in p for p in paths)
    # One branch point at least: the chat and the few-shot prompt share only the template's opening.
    assert len(paths) >= 2
