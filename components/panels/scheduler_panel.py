"""Scheduler panel: what the engine ran, forward by forward, for everyone at once.

A timeline of the last forwards from ``EngineAPI.step_log``: one row per request,
one bar per forward it took part in (coloured by what it did there: a prefill
chunk or a decode token; the no-reuse measurement runs outside the scheduler), so a forward that served
many requests reads as a column of bars sharing a time span. The viewer's own requests are drawn solid and the others faded: in
isolation mode these are the requests of the viewer's namespace; on a shared
(non-isolated) engine everyone shares one namespace, so it is the request of
the viewer's last answer. Beside it: requests running and waiting, the decode
batch size, output tokens per second. Knows only the engine's plain data.

In isolation mode the viewer sees only the forwards their own requests took part in
(``visible_steps``): a forward of others alone would tell how many chunks and decode tokens
another visitor's request took. Others in the viewer's forwards share one unnamed row, and
their sizes follow the tree's rule (``engine.kvcache.prefix_cache``):
every token figure that includes another visitor's tokens (a forward they took part in, the
totals over the shown forwards, the KV held by running requests) shows only the
``HIDDEN_BUCKET_TOKENS`` bucket it fits in, so the timeline is no hit or prompt-length
oracle. Only a figure made of the viewer's own work alone is exact. Others' bars are not drawn
at all (issue 58: one "others" bar per shared forward counted another visitor's prompt chunks
and answer tokens), and every figure goes through ``engine.visibility``: a forward's batch
size, the requests running and waiting and the decode batch sizes are everyone's, coarse, and
no step number is shown (the step counter counts everyone's forwards).
"""

from __future__ import annotations

import gradio as gr
import plotly.graph_objects as go

from components.panels.live import KEEP_ZOOM, LiveView
from components.session import own_namespace
from components.views.format import fmt_figure
from engine.api import EngineAPI
from engine.snapshot_view import is_own
from engine.types import RequestMetrics, StepRecord
from engine.visibility import Audience, Unit, everyone, own, shipped

SHOWN_FORWARDS = 120
COLORS = {"prefill": "#f59e0b", "decode": "#3b82f6"}
LABELS = {"prefill": "prefill chunk", "decode": "batched decode"}
REMOTE_EMPTY = "Remote server: it schedules its own requests, so there are no forwards of this app's to show."


def _is_mine(rec: StepRecord, i: int, namespace: str | None, my_ids: set[int]) -> bool:
    if rec.request_ids[i] in my_ids:
        return True
    return namespace is not None and is_own(namespace, rec.namespaces[i])


def _exact(rec: StepRecord, namespace: str | None, my_ids: set[int]) -> bool:
    """May the viewer see this forward's token counts exactly? With isolation off
    (``namespace`` None) everything is shared; with it on, only forwards of their own alone."""
    return namespace is None or all(_is_mine(rec, i, namespace, my_ids) for i in range(len(rec.request_ids)))


def _tokens(n: int, exact: bool, audience: Audience) -> str:
    """A forward's token figure: the viewer's own when only their requests took part, else everyone's."""
    return fmt_figure(own(n, Unit.TOKENS) if exact else everyone(n, Unit.TOKENS), audience)


OTHERS_ROW = "others"


def visible_steps(steps: list[StepRecord], namespace: str | None,
                  my_ids: set[int] | frozenset[int] = frozenset()) -> list[StepRecord]:
    """The forwards a viewer may see: all of them on a shared engine (``namespace`` None); in
    isolation mode only those the viewer's own requests took part in. Forwards of others alone
    would tell, request by request, how many chunks and tokens someone else's request took (its
    prompt's and its answer's length)."""
    if namespace is None:
        return steps
    return [r for r in steps if any(_is_mine(r, i, namespace, set(my_ids)) for i in range(len(r.request_ids)))]


def timeline_figure(steps: list[StepRecord], namespace: str | None = None,
                    my_ids: set[int] | frozenset[int] = frozenset(), empty_text: str | None = None) -> go.Figure:
    """Bars per (request, forward): x is wall time in seconds before the last forward ended.
    With ``namespace`` (isolation mode) only the viewer's forwards (``visible_steps``), the
    others in them drawn on one unnamed row with coarse token counts."""
    steps = visible_steps(steps, namespace, my_ids)
    fig = go.Figure()
    if not steps:
        fig.add_annotation(text=empty_text or "No forwards yet: send a chat message and watch it run.", showarrow=False,
                           x=0.5, y=0.5, xref="paper", yref="paper")
        fig.update_xaxes(visible=False)
        fig.update_yaxes(visible=False)
        fig.update_layout(height=320, margin=dict(l=10, r=10, t=30, b=10))
        return fig
    end = steps[-1].finished_at
    order: list[str] = []
    series: dict[tuple[str, bool], dict[str, list]] = {}
    my_ids = set(my_ids)
    audience = Audience(namespace is not None)
    for rec in steps:
        start = rec.finished_at - rec.duration_ms / 1000 - end
        exact = _exact(rec, namespace, my_ids)
        computed, cached = _tokens(rec.computed_tokens, exact, audience), _tokens(rec.cached_tokens, exact, audience)
        batch = fmt_figure(own(rec.batch_size, Unit.COUNT) if exact else everyone(rec.batch_size, Unit.COUNT),
                           audience)
        for i, rid in enumerate(rec.request_ids):
            mine = _is_mine(rec, i, namespace, my_ids)
            if audience.public and not mine:  # others' bars: withheld (their count is their chunks and tokens)
                continue
            row = OTHERS_ROW if namespace is not None and not mine else f"#{rid}"
            if row not in order:
                order.append(row)
            kind = "prefill" if rid in rec.prefill_request_ids else "decode"
            s = series.setdefault((kind, mine), dict(x=[], base=[], y=[], text=[]))
            s["x"].append(max(rec.duration_ms / 1000, 1e-3))
            s["base"].append(start)
            s["y"].append(row)
            from_cache = f", {cached} from cache" if rec.cached_tokens else ""
            who = "another visitor's request" if row == OTHERS_ROW else f"request #{rid}{' (yours)' if mine else ''}"
            step = "" if audience.public else f" in step {rec.step_id}"  # the step counter counts everyone's
            s["text"].append(f"{who}<br>{LABELS[kind]}{step}, one forward for {batch} request(s)<br>"
                             f"{computed} tokens computed in it{from_cache}<br>{rec.duration_ms:.0f} ms")
    for (kind, mine), s in sorted(series.items(), key=lambda kv: (kv[0][0], not kv[0][1])):
        fig.add_trace(go.Bar(
            x=s["x"], base=s["base"], y=s["y"], orientation="h", hovertext=s["text"], hoverinfo="text",
            name=f"{LABELS[kind]}{' (yours)' if mine else ''}", marker_color=COLORS[kind],
            marker_opacity=1.0 if mine else 0.35, marker_line_width=1 if mine else 0,
            marker_line_color="#0f172a"))
    fig.update_layout(barmode="overlay", height=max(260, 40 + 18 * len(order)), bargap=0.25,
                      margin=dict(l=10, r=10, t=50, b=10), uirevision="scheduler",
                      legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0),
                      xaxis_title="seconds before now (last forward shown)")
    fig.update_yaxes(categoryorder="array", categoryarray=list(reversed(order)),
                     title="request")
    return fig


def scheduler_markdown(engine: EngineAPI, steps: list[StepRecord], namespace: str | None = None,
                       my_ids: set[int] | frozenset[int] = frozenset()) -> str:
    """The figures beside the timeline; with ``namespace`` (isolation mode) token figures that
    include other visitors' work are coarse."""
    s = engine.stats()
    steps = visible_steps(steps, namespace, my_ids)
    audience = Audience(namespace is not None, engine.info().kv_bytes_per_token)
    decodes = [r for r in steps if r.kind == "decode"]
    exact = all(_exact(r, namespace, set(my_ids)) for r in steps)
    computed = _tokens(sum(r.computed_tokens for r in steps), exact, audience)
    cached = _tokens(sum(r.cached_tokens for r in steps), exact, audience)
    reserved = fmt_figure(everyone(s.running_bytes, Unit.BYTES), audience)
    rate = fmt_figure(everyone(s.tokens_per_s, Unit.RATE), audience)
    if audience.public:
        rate += " (in steps of 10)"
    mean = everyone(sum(r.batch_size for r in decodes) / len(decodes) if decodes else 0.0)
    batch = (f"mean {fmt_figure(mean, audience)}, largest "
             f"{fmt_figure(everyone(max((r.batch_size for r in decodes), default=0), Unit.COUNT), audience)} over the "
             f"last {fmt_figure(own(len(decodes), Unit.COUNT), audience)} decodes shown")
    return "\n".join([
        "| scheduler right now | |", "|---|---|",
        f"| requests running, everyone | **{fmt_figure(everyone(s.running, Unit.COUNT), audience)}** (at most "
        f"{fmt_figure(shipped(s.max_batch), audience)} in a batch) |",
        f"| requests waiting, everyone | **{fmt_figure(everyone(s.waiting, Unit.COUNT), audience)}** |",
        f"| output tokens/s, everyone | **{rate}** (last 10 s) |",
        f"| decode batch size | {batch} |",
        f"| tokens in the shown forwards | {computed} computed, {cached} served from the cache |",
        f"| KV held for running requests, everyone | {reserved} of the "
        f"{fmt_figure(shipped(s.budget_bytes, Unit.BYTES), audience)} budget (their own "
        "tokens: cached prefixes are read in place, never copied) |",
    ])


def build_scheduler_panel(engine: EngineAPI, last_metrics: gr.State | None = None, active: bool = False) -> LiveView:
    shown = ("Every forward your requests took part in (other visitors' own forwards stay private)"
             if engine.isolation else "Every forward the engine ran")
    gr.Markdown(f"{shown}, newest at the right. Requests run **together**: one forward is a "
                "column of bars, a decode token (blue) for each answering request and prompt **chunks** (orange) "
                "for new ones, so a long prompt never stops anyone's stream. Your requests are drawn solid.",
                elem_classes=["legend"])
    with gr.Row():
        with gr.Column(scale=3):
            plot = gr.Plot(show_label=False, elem_id="scheduler-plot", elem_classes=[KEEP_ZOOM])
        with gr.Column(scale=2):
            table = gr.Markdown(scheduler_markdown(engine, [], "" if engine.isolation else None))

    remote = not engine.capabilities.scheduler_steps
    empty = REMOTE_EMPTY if remote else None

    def refresh(last: RequestMetrics | None, request: gr.Request):
        steps = engine.step_log(SHOWN_FORWARDS)
        ns = own_namespace(request, engine)
        my_ids = {last.request_id} if isinstance(last, RequestMetrics) else set()
        return timeline_figure(steps, ns, my_ids, empty), scheduler_markdown(engine, steps, ns, my_ids)

    inputs = [last_metrics] if last_metrics is not None else [gr.State(None)]
    live = LiveView(gr.Timer(1.0, active=active), refresh, inputs, [plot, table])
    live.refresh_on(live.timer.tick)
    return live
