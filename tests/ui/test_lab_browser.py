"""The ordering lab in headless Chromium on a private-mode page: the chat says what is
private and what is shared; one click on a preset runs both orderings and the page shows
the headline, the side-by-side charts and the trees; a custom template's results land
below its editor, titled with the template, with no preset highlighted (tiny random
model: the counts are real engine runs, only the weights are random)."""

from __future__ import annotations

import pytest

from tests.helpers_app import CHROMIUM_ARGS, assert_clean, launched_app, wait_idle

pytestmark = [pytest.mark.browser]



def test_one_click_shows_both_orderings(chromium_executable, make_engine):
    from playwright.sync_api import sync_playwright

    engine = make_engine(isolation=True)
    with launched_app(engine) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_executable, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(url)
        # Private mode is said once, near the chat, with what stays shared.
        note = page.locator(".chat-notes").first
        note.wait_for(timeout=60_000)
        assert "Private mode" in note.inner_text() and "Shared:" in note.inner_text()

        page.get_by_role("tab", name="Prompt-ordering lab").click()
        page.get_by_role("button", name="RAG: documents vs question").click()
        page.wait_for_selector("h2:has-text(\" the good ordering (\")", timeout=120_000)
        headline = page.locator("h2", has_text=" the good ordering (").first.inner_text()
        assert headline.startswith("Bad ordering (question, then documents): prefill") and "cache hit rate" in headline
        page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 3", timeout=30_000)
        assert page.get_by_text("Good: documents, then question").first.is_visible()
        assert page.get_by_text("Why:").first.is_visible()  # the miss explainer opened on a bad request

        # A custom template: results right below its editor, named after it, no preset lit.
        page.get_by_text("Write your own template").click()
        run_custom = page.locator("#lab-custom").first.get_by_role("button", name="Run both orderings")
        run_custom.click()
        page.wait_for_selector("h2:has-text(\" your template (\")", timeout=120_000)
        results = page.locator("#lab-results").first
        assert "Your template against the suggested order" in results.inner_text()
        assert results.bounding_box()["y"] > run_custom.bounding_box()["y"]
        lit = page.locator("button.primary", has_text="RAG: documents vs question")
        assert lit.count() == 0  # the last preset's highlight went out
        browser.close()
        assert not errors, errors
    wait_idle(engine)
    assert_clean(engine)
    assert engine.cache.num_tokens == 0  # the lab left nothing behind
