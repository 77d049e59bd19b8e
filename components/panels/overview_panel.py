"""The side column of the first screen: key numbers and a small live tree.

Owns the story at a glance: how much of the visitor's last prompt came from
the cache, how much faster its prefill was, what the cache holds, and the
tree itself with the last request's path lit up. Sits next to the chat and
the few-shot playground.
"""

from __future__ import annotations

import gradio as gr

from components.panels.common import audience_of, playground_history, totals
from components.panels.info_panel import engine_line
from components.panels.live import KEEP_ZOOM, LiveView, cache_figures, drawn, engine_signature, status_line, unchanged
from components.panels.tree_panel import tree_figure_for
from components.session import visitor_namespace
from components.views.format import fmt_figure, fmt_ms, fmt_pct, plural, reuse_is_noise, reuse_words
from components.views.timing_view import speed_card, timing_for, timing_pending
from engine.api import EngineAPI
from engine.types import RequestMetrics


def _card(value: str, label: str, cls: str = "") -> str:
    return f"<div class='kcard {cls}'><div class='kval'>{value}</div><div class='klab'>{label}</div></div>"


def _speed_card(m: RequestMetrics, timing=None, pending: bool = False) -> str:
    """The prefill comparison, honestly: no ratio when nothing was reused, "slower" when slower.
    With a paired timing (``components.views.timing_view``) its two numbers, else the request's own;
    ``pending``: that timing is under way."""
    if pending and timing is None:
        return _card("timing…", f"prefill {fmt_ms(m.prefill_ms)} in the batch; now timing it with and without "
                                "reuse, back to back (a few seconds)", "blue")
    paired = speed_card(m, timing) if timing is not None and not reuse_is_noise(m.cached_tokens, m.prompt_tokens) \
        else None
    if paired is not None:
        return _card(*paired, "blue")
    if m.baseline_prefill_ms is None:
        return _card("–", f"prefill {fmt_ms(m.prefill_ms)} (no-reuse timing off)", "blue")
    words = reuse_words(m.cached_tokens, m.prompt_tokens, m.baseline_prefill_ms, m.prefill_ms)
    times = f"{fmt_ms(m.prefill_ms)} with reuse vs {fmt_ms(m.baseline_prefill_ms)} without"
    if reuse_is_noise(m.cached_tokens, m.prompt_tokens):
        return _card("no reuse", f"{words}: both runs computed every token ({times}: timing noise)", "blue")
    if words.startswith("about"):
        return _card("≈ 1×", f"prefill at about the same speed: {times}", "blue")
    value, _, rest = words.partition(" ")
    return _card(value, f"{rest} prefill: {times}", "blue")


def key_numbers_html(engine: EngineAPI, metrics: RequestMetrics | None, viewer: str, timing=None,
                     pending: bool = False) -> str:
    """Cards with numbers only (no prompt text, so nothing to escape or leak). Totals are
    the playground's (lab runs left out); in isolation mode, the visitor's own."""
    if metrics is None:
        last = [_card("–", "of your prompt served from the cache (shown when a request finishes)"),
                _card("–", "prefill with reuse vs without")]
    else:
        share = metrics.cached_tokens / metrics.prompt_tokens if metrics.prompt_tokens else 0.0
        stopped = " (stopped early)" if metrics.finish_reason == "cancelled" else ""
        last = [_card(fmt_pct(share), f"of your last prompt from the cache{stopped} "
                                      f"({metrics.cached_tokens:,} of {metrics.prompt_tokens:,} tokens)", "green"),
                _speed_card(metrics, timing, pending)]
    stats = cache_figures(engine, viewer)  # in isolation mode: others' activity only in coarse figures
    mine = playground_history(engine, namespace=viewer if engine.isolation else None)
    cached, prompt = totals(mine)
    rate = cached / prompt if prompt else 0.0
    whose = "your" if engine.isolation else "the playground's"
    cache_label = "everyone's KV cache" if engine.isolation else "KV cache"
    seen = audience_of(engine)
    tokens, nodes = fmt_figure(stats.tokens, seen), fmt_figure(stats.nodes, seen)
    engine_cards = [
        _card(fmt_pct(rate), f"token hit rate over {whose} {plural(len(mine), 'request')} (lab runs not counted)"),
        _card(f"{tokens} tokens", f"held by the remote server, in {nodes} nodes of its own blocks (its KV events; "
                                  "bytes unknown)")
        if engine.kv_event_figures().get("active") else
        _card("unknown", f"the remote server's KV memory; {tokens} tokens sent, in {nodes} nodes of the shadow tree")
        if not engine.capabilities.local_cache else
        _card(fmt_figure(stats.kv_bytes, seen), f"{cache_label}: {tokens} tokens in {nodes} nodes (budget "
                                                f"{fmt_figure(stats.budget, seen)})"),
    ]
    return ("<div class='kgrid'>" + "".join(last) + "</div><div class='kgrid small'>" + "".join(engine_cards)
            + "</div>")


def build_overview_panel(engine: EngineAPI, last_metrics: gr.State, active: bool = True,
                         last_timing: gr.State | None = None) -> LiveView:
    gr.Markdown("### What the cache just did", elem_classes=["side-title"])
    gr.Markdown(engine_line(engine), elem_id="engine-line", elem_classes=["legend"])
    numbers = gr.HTML(key_numbers_html(engine, None, ""), elem_classes=["key-numbers"])
    gr.Markdown("**Live radix tree** · green: your last prompt's cached part · orange: what it computed. "
                "Hover for text; the *Radix tree* tab has the full view.", elem_classes=["legend"])
    plot = gr.Plot(show_label=False, elem_classes=["mini-tree", KEEP_ZOOM])
    status = status_line()
    seen = gr.State(None)
    last_timing = last_timing if last_timing is not None else gr.State(None)

    def refresh(metrics, stored_timing, seen_before, request: gr.Request):
        timing = timing_for(metrics, stored_timing)
        pending = timing_pending(metrics, stored_timing)
        sig = (engine_signature(engine), getattr(metrics, "request_id", None), timing is not None, pending)
        if unchanged(seen_before, sig):
            return gr.skip(), gr.skip(), seen_before
        viewer = visitor_namespace(request, engine)
        fig = tree_figure_for(engine, request, metrics, collapse=None, height=330, compact=True, max_nodes=120,
                              max_fan=12)
        return key_numbers_html(engine, metrics, viewer, timing, pending), fig, drawn(sig)

    live = LiveView(gr.Timer(2.0, active=active), refresh, [last_metrics, last_timing, seen], [numbers, plot, seen],
                    status)
    live.refresh_on(live.timer.tick, last_metrics.change, last_timing.change)
    return live
