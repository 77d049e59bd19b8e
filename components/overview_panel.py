"""The side column of the first screen: key numbers and a small live tree.

Owns the story at a glance: how much of the visitor's last prompt came from
the cache, how much faster its prefill was, what the cache holds, and the
tree itself with the last request's path lit up. Sits next to the chat and
the few-shot playground.
"""

from __future__ import annotations

import gradio as gr

from components.common import fmt_bytes, fmt_ms
from components.info_panel import engine_line
from components.live import KEEP_ZOOM, LiveView, drawn, engine_signature, status_line, unchanged
from components.session import visitor_namespace
from components.tree_panel import tree_figure_for
from engine.engine import Engine
from engine.types import RequestMetrics


def _card(value: str, label: str, cls: str = "") -> str:
    return f"<div class='kcard {cls}'><div class='kval'>{value}</div><div class='klab'>{label}</div></div>"


def key_numbers_html(engine: Engine, metrics: RequestMetrics | None, viewer: str) -> str:
    """Cards with numbers only (no prompt text, so nothing to escape or leak)."""
    if metrics is None:
        last = [_card("–", "of your last prompt served from the cache"),
                _card("–", "faster prefill than without reuse")]
    else:
        share = metrics.cached_tokens / metrics.prompt_tokens if metrics.prompt_tokens else 0.0
        last = [_card(f"{share:.0%}", f"of your last prompt from the cache "
                                      f"({metrics.cached_tokens:,} of {metrics.prompt_tokens:,} tokens)", "green"),
                _card(f"{metrics.speedup:.1f}×" if metrics.speedup else "–",
                      f"faster prefill: {fmt_ms(metrics.prefill_ms)} vs {fmt_ms(metrics.baseline_prefill_ms)}"
                      if metrics.speedup else f"prefill {fmt_ms(metrics.prefill_ms)} (no baseline measured)", "blue")]
    stats = engine.stats(viewer)  # in isolation mode: others' activity only in coarse figures
    if engine.isolation:
        mine = engine.recent(namespace=viewer)
        prompt, cached = sum(m.prompt_tokens for m in mine), sum(m.cached_tokens for m in mine)
        who, requests = "your", len(mine)
    else:
        prompt, cached, who, requests = stats.prompt_tokens, stats.cached_tokens, "all", stats.requests
    rate = cached / prompt if prompt else 0.0
    memory_card = (
        _card("unknown", f"the remote server's KV memory; {stats.cached_tokens_now:,} tokens sent, in "
                         f"{stats.num_nodes:,} nodes of the shadow tree")
        if getattr(engine.info(), "backend", "") else
        _card(fmt_bytes(stats.cache_bytes), f"KV cached, {stats.cached_tokens_now:,} tokens in "
                                            f"{stats.num_nodes:,} nodes (budget {fmt_bytes(stats.budget_bytes)})"))
    engine_cards = [
        _card(f"{rate:.0%}", f"token hit rate over {who} {requests:,} request{'s' * (requests != 1)}"),
        memory_card,
    ]
    return ("<div class='kgrid'>" + "".join(last) + "</div><div class='kgrid small'>" + "".join(engine_cards)
            + "</div>")


def build_overview_panel(engine: Engine, last_metrics: gr.State, active: bool = True) -> LiveView:
    gr.Markdown("### What the cache just did", elem_classes=["side-title"])
    gr.Markdown(engine_line(engine), elem_id="engine-line", elem_classes=["legend"])
    numbers = gr.HTML(key_numbers_html(engine, None, ""), elem_classes=["key-numbers"])
    gr.Markdown("**Live radix tree** · green: your last prompt's cached part · orange: what it computed. "
                "Hover for text; the *Radix tree* tab has the full view.", elem_classes=["legend"])
    plot = gr.Plot(show_label=False, elem_classes=["mini-tree", KEEP_ZOOM])
    status = status_line()
    seen = gr.State(None)

    def refresh(metrics, seen_before, request: gr.Request):
        sig = (engine_signature(engine), getattr(metrics, "request_id", None))
        if unchanged(seen_before, sig):
            return gr.skip(), gr.skip(), seen_before
        viewer = visitor_namespace(request, engine)
        fig = tree_figure_for(engine, request, metrics, collapse=None, height=330, compact=True, max_nodes=120,
                              max_fan=12)
        return key_numbers_html(engine, metrics, viewer), fig, drawn(sig)

    live = LiveView(gr.Timer(2.0, active=active), refresh, [last_metrics, seen], [numbers, plot, seen], status)
    live.refresh_on(live.timer.tick, last_metrics.change)
    return live
