"""The "Your traffic" tab: a pasted log is simulated on a tree of its own, within limits."""

from __future__ import annotations

import json

import pytest

from components.panels.replay_panel import MAX_CHARS, MAX_LINES, example_log, simulate_pasted
from components.views.replay_report import causes_html, headline_html, report_figures, scoped
from engine.types import EngineError


@pytest.fixture(scope="module")
def engine(make_module_engine):
    return make_module_engine(budget_bytes=8 * 2**20)


def test_pasted_log_is_simulated_on_its_own_tree(engine):
    before = engine.stats()
    lines = [json.dumps({"messages": [{"role": "system", "content": "Be brief and kind to every customer."},
                                      {"role": "user", "content": f"Question {i}?"}]}) for i in range(5)]
    lines += ['{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}, '
              '{"from": "human", "value": "bye"}]}', "not json"]
    report = simulate_pasted(engine, "\n".join(lines), "none", 8)
    assert report.mode == "simulation" and report.requests == 7 and report.skipped_count == 1
    assert report.cached_tokens > 0 and report.budget_tokens == 8 * 2**20 // engine.runner.kv_bytes_per_token
    after = engine.stats()
    assert (after.requests, after.cached_tokens_now, after.num_nodes) == (before.requests, before.cached_tokens_now,
                                                                          before.num_nodes)  # nothing shared
    figs = report_figures(report)
    assert {"hit_rate", "tokens", "causes", "tree", "granularity"} <= set(figs)
    assert scoped(headline_html(report)).startswith('<div class="replay-report"><style>')


def test_pasted_text_is_escaped_in_the_pieces(engine):
    lines = [json.dumps({"prompt": f"A static text long enough to be cached: {fruit} <img src=x onerror=alert(1)>"})
             for fruit in ("apple", "banana", "cherry")]
    report = simulate_pasted(engine, "\n".join(lines), "5m", 8)
    assert any(c.examples for c in report.causes)
    page = causes_html(report)
    assert "<img" not in page and "&lt;" in page  # shown token by token, each escaped


def test_example_log_fits_the_limits(engine):
    text = example_log()
    assert len(text) <= MAX_CHARS and text.count("\n") < MAX_LINES
    report = simulate_pasted(engine, text, "1h", 64)
    assert report.requests + report.skipped_count == 24 and report.requests > 0 and report.ttl_s == 3600


@pytest.mark.parametrize("text, message", [
    ("", "Paste a log first"), (None, "Paste a log first"), ("x" * (MAX_CHARS + 1), "characters long"),
    ('{"prompt": "a"}\n' * (MAX_LINES + 1), "lines"),
])
def test_limits_and_empty_input_say_why(engine, text, message):
    with pytest.raises(EngineError, match=message):
        simulate_pasted(engine, text, "none", 8)


def test_odd_budget_and_ttl_values_are_tamed(engine):
    report = simulate_pasted(engine, '{"prompt": "hello there"}', "forever", float("nan"))
    assert report.ttl_s is None and report.budget_tokens > 0


@pytest.mark.browser
def test_the_tab_shows_the_report_in_chromium(chromium_executable, tmp_path, make_engine):
    import os

    from playwright.sync_api import sync_playwright

    from tests.helpers_app import CHROMIUM_ARGS, launched_app

    engine = make_engine()
    with launched_app(engine) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_executable, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1440, "height": 1400})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(url)
        page.get_by_role("tab", name="Your traffic").click()
        page.get_by_role("button", name="Fill in a generated example").click()
        page.wait_for_function("[...document.querySelectorAll('textarea')].some(t => t.value.includes('timestamp'))",
                               timeout=30_000)
        page.get_by_role("button", name="Simulate my log").click()
        page.wait_for_selector("text=prefix caching would serve", timeout=120_000)
        page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 5", timeout=30_000)
        token = page.locator(".replay-report .tok.computed").first
        assert token.evaluate("e => getComputedStyle(e).backgroundColor") == "rgb(255, 237, 213)"  # styled inline
        page.screenshot(path=os.environ.get("REPLAY_TAB_SCREENSHOT", str(tmp_path / "tab.png")), full_page=False)
        browser.close()
        assert not errors, errors
    assert engine.cache.num_tokens == 0 and engine.stats().requests == 0  # the shared engine saw nothing
