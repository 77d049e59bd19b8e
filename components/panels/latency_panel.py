"""Latency side by side: over the history, prefill with reuse against without on
the same request (for requests that measured a baseline), and the speedup
against the number of tokens served from the cache.

In isolation mode a visitor sees only their own requests: other visitors'
timings would tell which prefixes they hit.
"""

from __future__ import annotations

import gradio as gr

from components.panels.common import history_refresh
from components.panels.live import KEEP_ZOOM, LiveView
from components.views.charts import latency_bars, speedup_scatter
from components.views.format import fmt_ms, plural, ratio_words, reuse_is_noise
from engine.api import EngineAPI
from engine.types import RequestMetrics

HISTORY = 40


def latency_summary(history: list[RequestMetrics], mine: bool = False) -> str:
    """Prefill with reuse against without over the measured requests, in honest words:
    requests that reused (almost) nothing, or measured slower, are counted apart."""
    timed = [m for m in history if m.baseline_prefill_ms is not None]
    if not timed:
        return ("No request has measured prefill without reuse yet. Send a chat message (each answer's card times "
                "prefill with and without reuse, back to back) or run few-shot queries with "
                "**Measure prefill without reuse** ticked.")
    with_reuse = sum(m.prefill_ms for m in timed)
    without = sum(m.baseline_prefill_ms for m in timed)
    best = max(timed, key=lambda m: m.speedup or 0)
    noise = [m for m in timed if reuse_is_noise(m.cached_tokens, m.prompt_tokens)]
    slower = [m for m in timed if m not in noise and (m.speedup or 0) < 1]
    whose = "your last" if mine else "the last"
    text = (f"Over {whose} **{plural(len(timed), 'measured request')}** (lab runs not counted): prefill took "
            f"**{fmt_ms(with_reuse)}** with reuse against **{fmt_ms(without)}** without "
            f"(**{ratio_words(without, with_reuse)}** overall; best {best.speedup or 0:.1f}× on request "
            f"#{best.request_id}, {best.cached_tokens:,} of {best.prompt_tokens:,} tokens cached). Both numbers "
            "are measured on the same request in the same process.")
    if noise:
        text += (f"\n\n*{plural(len(noise), 'request')} reused (almost) nothing: both runs computed every token, "
                 "so their difference is timing noise (bars marked “nothing reused”).*")
    if slower:
        text += (f"\n\n*{plural(len(slower), 'request')} measured slower with reuse: with few tokens to compute "
                 "either way, copying the cached part costs about as much as computing it, and timing noise decides.*")
    return text


def build_latency_panel(engine: EngineAPI, active: bool = False) -> LiveView:
    summary = gr.Markdown(latency_summary([]))
    bars = gr.Plot(show_label=False, elem_id="latency-bars", elem_classes=[KEEP_ZOOM])
    scatter = gr.Plot(show_label=False, elem_id="speedup-scatter", elem_classes=[KEEP_ZOOM])
    seen = gr.State(None)

    def draw(history: list[RequestMetrics], ns: str | None) -> tuple:
        history = history[-HISTORY:]
        return latency_summary(history, mine=engine.isolation), latency_bars(history), speedup_scatter(history)

    refresh = history_refresh(engine, draw, 3)
    live = LiveView(gr.Timer(3.0, active=active), refresh, [seen], [summary, bars, scatter, seen])
    live.refresh_on(live.timer.tick)
    return live
