"""Screenshot the Fleet tab in front of a real fleet (docs/fleet.png, issue 45).

Starts ``--replicas`` replicas of this app behind vLLM's router (``tools.fleet``, round robin), the
dashboard in remote mode with ``--fleet`` and, given, the routing lab's report (``--routing-lab``,
from ``python -m tools.routing_lab --json``), sends a few chat turns of two system prompts through the
router, then opens the Fleet tab in headless Chromium (Playwright driving Debian's binary) and saves
the whole tab: the replicas' real trees, where each request landed, and the routing lab's table.

Usage: python -m tools.fleet_shot [--model PATH] [--routing-lab lab.json] docs/fleet.png
"""

from __future__ import annotations

import argparse

import app
from engine.types import GenerationRequest, SamplingParams
from tools.fleet import Fleet
from tools.fleet.trace import QUESTIONS, SYSTEM_PROMPTS
from tools.remote_tree_shot import CHROMIUM_ARGS
from tools.vllm_server import free_port


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--model", default=None, help="the replicas' model (default: the embedded one)")
    p.add_argument("--routing-lab", default="", metavar="FILE")
    p.add_argument("--chromium", default="/usr/bin/chromium")
    p.add_argument("out")
    a = p.parse_args()
    lab = app.load_routing_lab(a.routing_lab) if a.routing_lab else None
    with Fleet(a.replicas, "round_robin", model=a.model, budget_mb=64) as fleet:
        flags = ["--backend", fleet.url, "--fleet", ",".join(r.url for r in fleet.members), "--max-new-tokens", "12"]
        engine = app.build_remote_engine(app.parse_args(flags + (["--model", a.model] if a.model else [])))
        try:
            for i, q in enumerate(QUESTIONS[:6]):
                system = SYSTEM_PROMPTS[i % 2]
                m = engine.run(GenerationRequest(
                    messages=({"role": "system", "content": system}, {"role": "user", "content": q}),
                    sampling=SamplingParams(max_new_tokens=12), tag="chat"))
                print(f"{q!r}: {m.prompt_tokens} prompt tokens, {m.cached_tokens} cached")
            shoot(engine, lab, a.chromium, a.out)
        finally:
            engine.close()
    print("saved", a.out)


def shoot(engine, lab: dict | None, chromium: str, out: str) -> None:
    from playwright.sync_api import sync_playwright

    from components.demo import launch_kwargs

    demo = app.build_app(engine, routing_lab=lab)
    port = free_port()
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True,
                **launch_kwargs(app.app_kwargs(engine)))
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"http://127.0.0.1:{port}/")
            page.get_by_role("tab", name="Fleet").click()
            page.wait_for_selector(".mini-tree .js-plotly-plot", state="attached", timeout=60_000)
            page.wait_for_timeout(4000)  # a refresh or two: every tree drawn
            panel = page.locator("[role=tabpanel]:visible").first
            panel.screenshot(path=out)
            browser.close()
    finally:
        demo.close()


if __name__ == "__main__":
    main()
