"""Screenshot the Radix tree tab in front of a real vLLM with KV events (docs/remote-tree.png).

Starts the dashboard in remote mode against ``--backend`` (a vLLM started with
``--kv-events-config``, e.g. ``python -m tools.vllm_server --blocks 150``), sends a few chat
turns through it and one long prompt straight to vLLM (another client: drawn as such), then
opens the tree tab in headless Chromium (Playwright driving Debian's binary) and saves it.

Usage: python -m tools.remote_tree_shot --backend http://127.0.0.1:PORT docs/remote-tree.png
"""

from __future__ import annotations

import argparse
import random
import time

import httpx

import app
from engine.types import GenerationRequest, SamplingParams
from tools.vllm_server import free_port

SYSTEM = ("You are a patient tutor who explains how serving engines reuse the KV cache of shared prefixes. "
          "Answer in two sentences.")
QUESTIONS = ("What is a radix tree?", "Why are blocks 32 tokens here?", "What does eviction do?")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", required=True)
    p.add_argument("--chromium", default="/usr/bin/chromium")
    p.add_argument("out")
    a = p.parse_args()
    args = app.parse_args(["--backend", a.backend + "/v1", "--max-new-tokens", "24"])
    engine = app.build_remote_engine(args)
    for q in QUESTIONS:
        m = engine.run(GenerationRequest(messages=({"role": "system", "content": SYSTEM}, {"role": "user", "content": q}),
                                         sampling=SamplingParams(max_new_tokens=24), tag="chat"))
        print(f"{q!r}: {m.prompt_tokens} prompt tokens, {m.cached_tokens} reported cached, "
              f"{m.cached_tokens_blocks} by the blocks")
    rng = random.Random(7)
    httpx.post(a.backend + "/v1/completions", timeout=300, json={
        "model": engine.model, "prompt": [rng.randrange(300, 40000) for _ in range(150)], "max_tokens": 1})
    time.sleep(1.0)
    print("events:", engine.kv_event_figures())
    from components.demo import launch_kwargs

    demo = app.build_app(engine)
    port = free_port()
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True,
                **launch_kwargs(app.app_kwargs(engine)))
    from playwright.sync_api import sync_playwright

    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=a.chromium, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"http://127.0.0.1:{port}/")
            page.get_by_role("tab", name="Radix tree").click()
            page.wait_for_selector("#tree-plot .js-plotly-plot", timeout=60_000)
            page.wait_for_timeout(2500)
            page.locator("#tree-plot").scroll_into_view_if_needed()
            page.screenshot(path=a.out)
            browser.close()
    finally:
        demo.close()
        engine.close()
    print("saved", a.out)


if __name__ == "__main__":
    main()
