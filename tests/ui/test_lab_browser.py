"""The ordering lab in headless Chromium: one click on a preset runs both orderings and the
page shows the headline, the side-by-side charts and the trees (tiny random model: the
counts are real engine runs, only the weights are random)."""

from __future__ import annotations

import pytest

from engine.engine import Engine
from tests.helpers_app import assert_clean, launched_app, wait_idle

pytestmark = [pytest.mark.browser]

ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]


def test_one_click_shows_both_orderings(tiny_runner, chromium_executable):
    from playwright.sync_api import sync_playwright

    engine = Engine(tiny_runner)
    with launched_app(engine) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_executable, args=ARGS)
        page = browser.new_page(viewport={"width": 1440, "height": 1000})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(url)
        page.get_by_role("tab", name="Prompt-ordering lab").click()
        page.get_by_role("button", name="RAG: documents vs question").click()
        page.wait_for_selector("text=ordering: prefill", timeout=120_000)
        headline = page.locator("h2", has_text="ordering: prefill").first.inner_text()
        assert "Bad ordering" in headline and "cache hit rate" in headline
        page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 3", timeout=30_000)
        assert page.get_by_text("Good: documents, then question").first.is_visible()
        assert page.get_by_text("Why:").first.is_visible()  # the miss explainer opened on a bad request
        browser.close()
        assert not errors, errors
    wait_idle(engine)
    assert_clean(engine)
    assert engine.cache.num_tokens == 0  # the lab left nothing behind
