"""The Routing tab: a generated workload routed over a simulated fleet under every policy, within
limits, touching no engine; and the tab in Chromium."""

from __future__ import annotations

import pytest

from analysis.replay.fleet_policies import POLICIES
from components.panels.routing_panel import BUDGET_TOKENS, REPLICAS, REQUESTS, simulate
from components.views.routing_table import POLICY_WORDS, routing_markdown
from engine.types import EngineError


def test_every_policy_runs_on_the_same_workload_and_the_table_names_each():
    runs, pooled = simulate(4, 400, 10_000)
    assert [r.policy for r in runs] == list(POLICIES) and set(POLICY_WORDS) == set(POLICIES)
    assert len({(r.requests, r.prompt_tokens) for r in runs}) == 1  # one workload for all
    assert all(r.replicas == 4 and r.budget_tokens == 10_000 and 0 <= r.hit_rate <= r.ceiling_rate + 1e-9 <= 1
               for r in runs if r.policy != "oracle")
    by = {r.policy: r for r in runs}
    assert by["cache_aware"].hit_rate > by["round_robin"].hit_rate  # the lesson the tab teaches
    assert by["round_robin"].duplication.share > by["cache_aware"].duplication.share
    assert pooled.replicas == 1 and pooled.budget_tokens == 40_000
    table = routing_markdown(runs, pooled)
    assert all(f"**{p}**" in table for p in POLICIES) and "one cache, all the memory" in table


@pytest.mark.parametrize("args", [(1e9, 1e9, 1e12), (-5, 0, -1), ("8", "300.7", "2000")])
def test_settings_are_clamped_to_the_limits(args):
    runs, _ = simulate(*args)
    assert REPLICAS[0] <= runs[0].replicas <= REPLICAS[1]
    assert REQUESTS[0] <= runs[0].requests <= REQUESTS[1]
    assert BUDGET_TOKENS[0] <= runs[0].budget_tokens <= BUDGET_TOKENS[1]


@pytest.mark.parametrize("bad", ["eight", None, float("nan"), [3]])
def test_a_bad_setting_is_a_sentence(bad):
    with pytest.raises(EngineError, match="must be a number from"):
        simulate(bad, 400, 10_000)


@pytest.mark.browser
def test_the_tab_shows_the_table_in_chromium(chromium_executable, tmp_path, make_engine):
    import os

    from playwright.sync_api import sync_playwright

    from tests.helpers_app import CHROMIUM_ARGS, launched_app

    engine = make_engine()
    with launched_app(engine) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_executable, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1440, "height": 1200})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(url)
        page.get_by_role("tab", name="Routing").click()
        page.get_by_role("button", name="Simulate the fleet").click()
        page.wait_for_selector("text=Routing alone moves the share", timeout=120_000)
        body = page.inner_text("body")
        assert "cache_aware" in body and "round_robin" in body and "Traceback" not in body
        page.screenshot(path=os.environ.get("ROUTING_TAB_SCREENSHOT", str(tmp_path / "tab.png")), full_page=False)
        browser.close()
        assert not errors, errors
    assert engine.stats().requests == 0  # no model ran
