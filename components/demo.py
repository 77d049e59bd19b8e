"""The whole app: a title, a two-line story, and one tab per panel, all on one shared engine.

Layout only: each panel builds and wires itself (``build_*_panel``). Panels
that follow the engine live hand back a ``LiveView``; this module fires them
on page load and tab select, and keeps only the visible tab's timers running.
Per-visitor state (the chat, the last request's metrics) is Gradio session
state; the engine is shared.
"""

from __future__ import annotations

import gradio as gr

from components import start_check
from components.panels.chat_panel import build_chat_panel
from components.panels.fewshot_panel import build_fewshot_panel
from components.panels.fleet_panel import build_fleet_panel
from components.panels.growth_panel import build_growth_panel
from components.panels.info_panel import build_info_panel
from components.panels.lab.tab import build_ordering_lab
from components.panels.latency_panel import build_latency_panel
from components.panels.live import KEEP_ZOOM_JS, LiveView
from components.panels.memory_panel import build_memory_panel
from components.panels.overview_panel import build_overview_panel
from components.panels.replay_panel import build_replay_panel
from components.panels.reuse_check_panel import build_reuse_check
from components.panels.routing_panel import build_routing_panel
from components.panels.scheduler_panel import build_scheduler_panel
from components.panels.tree_panel import build_tree_panel
from components.session import share_page_blocks
from engine.api import EngineAPI
from server.request_guard import guard_middleware

TITLE = "Radix Cache Playground"
STATE_SESSIONS = 500  # Gradio's default keeps 10,000 sessions' inputs and state in memory
STORY = (
    "Every prompt you send runs on a real LLM whose KV cache lives in a **radix tree**: any prefix that an earlier "
    "request already computed is **served from the cache** instead of being prefilled again (SGLang's "
    "RadixAttention).  \nPut **static content first and per-request content last**, and watch prefill get several "
    "times faster; get the order wrong and the cache can't help."
)

CSS = """
.gradio-container {max-width: 1440px !important}
#story {font-size: 1.02rem}
.start-hint {background: #f0fdf4; border-left: 4px solid #22c55e; padding: 6px 10px; border-radius: 6px}
.start-hint p {margin: 0}
.starter button, button.starter {font-weight: 600}
.turn-numbers table {font-size: 0.92rem}
.legend {font-size: 0.85rem; color: #475569}
.side-title h3 {margin: 0}
.kgrid {display: grid; grid-template-columns: 1fr 1fr; gap: 8px; margin-bottom: 8px}
.kcard {border: 1px solid #e2e8f0; border-radius: 10px; padding: 8px 12px; background: #f8fafc}
.kcard.green {background: #f0fdf4; border-color: #86efac}
.kcard.blue {background: #eff6ff; border-color: #93c5fd}
.kval {font-size: 1.7rem; font-weight: 700; line-height: 1.2; color: #0f172a}
.kgrid.small .kval {font-size: 1.15rem}
.klab {font-size: 0.8rem; color: #475569}
"""

# ---- Layout fixes from the first-visitor walk (issue 15, items 12-13; UI helper's block) ----
CSS += """
.prose table {display: block; overflow-x: auto; max-width: 100%}
.prose th, .prose td, .fewshot-table th, .fewshot-table th * {word-break: normal !important;
  overflow-wrap: normal !important; hyphens: none}
.turn-numbers th {white-space: nowrap}
.prompt-tokens {max-height: 240px; overflow-y: auto}
.chat-notes {font-size: 0.82rem; color: #475569}
.chat-notes p {margin: 0}
.send-row button {white-space: nowrap}
.system-pick input {padding-right: 30px !important; text-overflow: ellipsis}
@media (max-width: 640px) {
  .gradio-container {padding-left: 6px !important; padding-right: 6px !important}
  .kval {font-size: 1.3rem}
  #lab-results h2 {font-size: 1.15rem}
}
"""


def launch_kwargs(app_kwargs: dict | None = None) -> dict:
    """Settings for ``demo.launch``: theme and CSS go here in Gradio 6, not to Blocks.

    Public-page settings (tests/app/test_public_hosting.py checks them): no error details to
    visitors; no run history (Gradio would keep each visitor's prompts in the browser, or
    in a bucket); no /monitoring page; uploads and deep links refused and request bodies capped
    (``server.request_guard.RequestGuard``: the app takes no files); Gradio keeps per-session
    state (inputs, ``gr.State``) for at most ``STATE_SESSIONS`` sessions, oldest dropped first.
    ``app_kwargs`` (the HTTP API's routes, see ``app.app_kwargs``) join the guard's middleware.
    Every launch takes these, so here Gradio's start-up check becomes patient (``start_check``)."""
    start_check.install()
    return dict(theme=gr.themes.Soft(), css=CSS, js=KEEP_ZOOM_JS, show_error=False, footer_links=[],
                run_history=False, enable_monitoring=False, max_file_size="1kb",
                state_session_capacity=STATE_SESSIONS, app_kwargs={"middleware": guard_middleware(), **(app_kwargs or {})})


def build_demo(engine: EngineAPI, routing_lab: dict | None = None) -> gr.Blocks:
    """The page over ``engine``; ``routing_lab``, a routing-lab report for the Fleet tab
    (``components.views.routing_lab_report``), where the engine has a fleet."""
    share_page_blocks(engine)  # the presets everyone may share, handed to the engine that keys by them
    live: dict[str, list[LiveView]] = {}  # tab label -> the live views inside it
    with gr.Blocks(title=TITLE) as demo:
        gr.Markdown(f"# {TITLE}")
        gr.Markdown(STORY, elem_id="story")
        last_metrics = gr.State(None)  # this visitor's last RequestMetrics
        last_timing = gr.State(None)  # (request_id, PrefillTiming) of this visitor's last timed chat turn
        with gr.Tabs(overflow_behavior="wrap") as tabs:  # every tab one tap away on a phone
            with gr.Tab("Chat"):
                with gr.Row():
                    with gr.Column(scale=3):
                        build_chat_panel(engine, last_metrics, last_timing)
                        if engine.capabilities.logprobs:
                            build_reuse_check(engine, last_metrics)
                    with gr.Column(scale=2):
                        live["Chat"] = [build_overview_panel(engine, last_metrics, active=True,
                                                             last_timing=last_timing)]
            with gr.Tab("Prompt-ordering lab"):
                build_ordering_lab(engine)
            with gr.Tab("Few-shot"):
                with gr.Row():
                    with gr.Column(scale=3):
                        build_fewshot_panel(engine, last_metrics)
                    with gr.Column(scale=2):
                        live["Few-shot"] = [build_overview_panel(engine, last_metrics, active=False)]
            with gr.Tab("Radix tree"):
                live["Radix tree"] = [build_tree_panel(engine, last_metrics)]
            if engine.fleet_view() is not None:  # remote mode in front of a router with --fleet
                with gr.Tab("Fleet"):
                    live["Fleet"] = [build_fleet_panel(engine, last_metrics, lab=routing_lab)]
            with gr.Tab("Cache memory"):
                live["Cache memory"] = [build_memory_panel(engine)]
            with gr.Tab("Scheduler"):
                live["Scheduler"] = [build_scheduler_panel(engine, last_metrics)]
            with gr.Tab("Latency"):
                growth = build_growth_panel(engine)  # first: the one chart measured before anyone asks
                live["Latency"] = [build_latency_panel(engine)] + ([growth] if growth is not None else [])
            with gr.Tab("Your traffic"):
                build_replay_panel(engine)
            with gr.Tab("Routing"):
                build_routing_panel()
            with gr.Tab("Engine info"):
                live["Engine info"] = [build_info_panel(engine)]
        _wire_live(demo, tabs, live)
    return demo


def _wire_live(demo: gr.Blocks, tabs: gr.Tabs, live: dict[str, list[LiveView]]) -> None:
    """Draw the first tab on load; on a tab switch, draw it now and run only its timers."""
    for view in live.get("Chat", []):
        view.refresh_on(demo.load)
    views = [v for vs in live.values() for v in vs]
    timers = [v.timer for v in views]

    def on_select(evt: gr.SelectData):
        shown = live.get(str(evt.value), [])
        return [gr.Timer(active=any(v is s for s in shown)) for v in views]

    tabs.select(on_select, None, timers, api_visibility="private", show_progress="hidden")
    for label, vs in live.items():
        for v in vs:
            v.refresh_on(*_tab_selects(tabs, label))


def _tab_selects(tabs: gr.Tabs, label: str) -> list:
    """The select trigger of the tab called ``label`` inside ``tabs``."""
    return [child.select for child in tabs.children if isinstance(child, gr.Tab) and child.label == label]
