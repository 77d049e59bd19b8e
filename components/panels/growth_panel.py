"""How the win grows: prefill time with and without reuse against the cached length, on
this machine, measured once (in the background at start, or on request) and kept.

Reads ``timer_for(engine).curve`` (``analysis.prefill_timing.GrowthCurve``); starting a
measurement is ``components.warm_start.start_growth_curve``. On a public deployment
(isolation on) a curve that was measured is not measured again: it is the same for everyone.
"""

from __future__ import annotations

import functools
import time

import gradio as gr

from analysis.prefill_timing import timer_for
from components.panels.live import LiveView
from components.views.charts import growth_figure
from components.views.format import plural
from components.warm_start import start_growth_curve

WHY_BY_DEVICE = {
    "cpu": ("**On a CPU** prefill is compute-bound: every prompt token costs about the same, so each cached token "
            "saves its share and a few hundred cached tokens already save a visible part of a second."),
    "gpu": ("**On a GPU** any forward pays a fixed cost of a few milliseconds (kernel launches, reading the weights) "
            "and a few hundred tokens fit inside it, so reusing them barely shows; only thousands of cached tokens "
            "add up to more than that fixed cost, and then reuse wins several-fold."),
}


def curve_markdown(curve, isolation: bool) -> str:
    """What the chart shows, how and when it was measured, and why it looks the way it does."""
    why = "\n\n".join(WHY_BY_DEVICE.values())
    if curve.state == "none":
        return "Not measured yet: **Measure** runs it once on this machine (about half a minute on two CPU cores).\n\n" + why
    if curve.state == "failed":
        return f"The measurement failed ({curve.error}).\n\n" + why
    pairs = {p.pairs for p in curve.points}
    how = (f"Each point: {plural(curve.points[0].suffix_tokens, 'token')} of question computed after the cached part, "
           f"timed with reuse (the cached part copied into a scratch buffer) and without (every token computed), back "
           f"to back on the model's thread, {plural(max(pairs), 'pair')} per length" if curve.points else "")
    if curve.state == "running":
        return (f"*Measuring on this machine ({len(curve.points)} of {len(curve.lengths)} lengths done)…* "
                f"{how}.\n\n{why}")
    short = [p for p in curve.points if getattr(p, "reused_less", False)]
    if short:
        how += (". Reused less than its length (part of the filler was evicted meanwhile): "
                + ", ".join(f"{p.cached_tokens:,} cached, {p.reused_tokens:,} reused" for p in short))
    when = time.strftime("%H:%M UTC", time.gmtime(curve.finished_at))
    again = " Measured once for everyone on this public page." if isolation else ""
    return (f"Measured at {when} on **{curve.device}** ({curve.dtype}), not on a quiet machine if others were "
            f"using it. {how}.{again}\n\n{why}")


def build_growth_panel(engine, active: bool = False) -> LiveView | None:
    """The chart, its words and a Measure button; a ``LiveView`` that redraws when the curve changes."""
    gr.Markdown("### How the win grows with the cached length")
    timer = functools.partial(timer_for, engine)
    if not engine.capabilities.prefill_timing:
        gr.Markdown("*Remote mode: the backend's prefill cannot be timed from here block by block.*")
        return None
    plot = gr.Plot(show_label=False, elem_id="growth-plot")
    text = gr.Markdown(elem_id="growth-text")
    measure = gr.Button("Measure", size="sm", variant="secondary", elem_id="growth-measure", visible=False)
    seen = gr.State(None)

    def draw():
        curve = timer().curve
        fig = growth_figure(curve.points, curve.device, note="Not measured yet: click Measure"
                            if curve.state == "none" else curve.error or "Measuring…")
        can_measure = curve.state != "running" and not (engine.isolation and curve.state == "done")
        label = "Measure again" if curve.state == "done" else "Measure"
        return fig, curve_markdown(curve, engine.isolation), gr.update(visible=can_measure, value=label)

    def refresh(seen_before):
        curve = timer().curve
        sig = (curve.state, len(curve.points), curve.finished_at)
        if seen_before == sig:
            return gr.skip(), gr.skip(), gr.skip(), seen_before
        return (*draw(), sig)

    def start():
        if not (engine.isolation and timer().curve.state == "done"):
            start_growth_curve(engine)
            time.sleep(0.2)  # let it mark itself running before the redraw
        return (*draw(), None)

    measure.click(start, None, [plot, text, measure, seen], api_visibility="private", show_progress="hidden")
    live = LiveView(gr.Timer(2.0, active=active), refresh, [seen], [plot, text, measure, seen])
    live.refresh_on(live.timer.tick)
    return live
