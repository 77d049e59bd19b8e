"""Latency side by side: over the history, prefill with reuse against without on
the same request (for requests that measured a baseline), and the speedup
against the number of tokens served from the cache.

In isolation mode a visitor sees only their own requests: other visitors'
timings would tell which prefixes they hit.
"""

from __future__ import annotations

import gradio as gr

from components.charts import latency_bars, speedup_scatter
from components.common import fmt_ms
from components.live import KEEP_ZOOM, LiveView, drawn, engine_signature, unchanged
from components.session import own_namespace
from engine.engine import Engine
from engine.types import RequestMetrics

HISTORY = 40


def latency_summary(history: list[RequestMetrics]) -> str:
    timed = [m for m in history if m.baseline_prefill_ms is not None]
    if not timed:
        return ("No request has measured prefill without reuse yet. Chat or run few-shot queries with "
                "**Measure prefill without reuse** ticked.")
    with_reuse = sum(m.prefill_ms for m in timed)
    without = sum(m.baseline_prefill_ms for m in timed)
    best = max(timed, key=lambda m: m.speedup or 0)
    return (f"Over the last **{len(timed)}** measured requests: prefill took **{fmt_ms(with_reuse)}** with reuse "
            f"against **{fmt_ms(without)}** without "
            f"(**{without / with_reuse:.1f}×** speedup overall; best {best.speedup:.1f}× on request "
            f"#{best.request_id}, {best.cached_tokens:,} of {best.prompt_tokens:,} tokens cached). Both numbers "
            "are measured on the same request in the same process.")


def build_latency_panel(engine: Engine, active: bool = False) -> LiveView:
    summary = gr.Markdown(latency_summary([]))
    bars = gr.Plot(show_label=False, elem_id="latency-bars", elem_classes=[KEEP_ZOOM])
    scatter = gr.Plot(show_label=False, elem_id="speedup-scatter", elem_classes=[KEEP_ZOOM])
    seen = gr.State(None)

    def refresh(seen_before, request: gr.Request):
        sig = engine_signature(engine)
        if unchanged(seen_before, sig):
            return gr.skip(), gr.skip(), gr.skip(), seen_before
        ns = own_namespace(request, engine)
        history = engine.recent(HISTORY, namespace=ns)
        return latency_summary(history), latency_bars(history), speedup_scatter(history), drawn(sig)

    live = LiveView(gr.Timer(3.0, active=active), refresh, [seen], [summary, bars, scatter, seen])
    live.refresh_on(live.timer.tick)
    return live
