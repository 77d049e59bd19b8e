"""The Fleet tab (remote mode in front of a router, ``--fleet``): every replica's real tree side by side.

Owns the tab's layout and live refresh: one small tree per replica (the figure the tree tab
draws, over that replica's blocks from its KV events), a line over each (tokens, hit rate,
requests landed), the replicas' table, the last requests (the replica each landed on, what it
had cached, the most any replica had), the fleet's duplication, and the routing lab's report
(``--routing-lab``) or how to make one. The engine gives the data
(``EngineAPI.fleet_view``); the words are ``components.views.fleet_tables``. Built only when the
engine has a fleet.
"""

from __future__ import annotations

import gradio as gr

from components.panels.common import audience_of
from components.panels.live import KEEP_ZOOM, LiveView, drawn, engine_signature, status_line, unchanged
from components.session import visitor_namespace
from components.views.fleet_tables import (
    ATTRIBUTION_NOTE,
    duplication_line,
    landed_of,
    replica_title,
    replicas_table,
    requests_table,
)
from components.views.routing_lab_report import lab_caption, lab_table
from components.views.tree_figures import tree_figure
from components.views.tree_marks import request_path
from engine.api import EngineAPI
from engine.types import FleetView, RequestMetrics

PER_ROW = 3
INTRO = (
    "This dashboard sends its requests **through the router**; each replica publishes its KV cache as events, and "
    "each small tree below is one replica's **real** cache, drawn from them (colour: how recently used). Your last "
    "request is lit up on the replica it landed on (green: served from that replica's cache, orange: computed). "
    "With `round_robin` a conversation's turns scatter, so each replica computes the shared prefix again."
)

LAB_INTRO = (
    "Measured with `python -m tools.routing_lab`: for each policy, fresh replicas and vLLM's router in front, the "
    "built-in trace (several system prompts, many users, multi-turn chats) replayed through it. **Cached share**: "
    "prompt tokens the replicas served from cache; **duplicate tokens**: held on more than one replica at the end; "
    "beside them what the fleet simulator predicted for the same trace and fleet."
)
LAB_HOWTO = (
    "No report loaded. Run `python -m tools.routing_lab --json lab.json` (each policy on fresh replicas behind the "
    "router) and start this page with `--routing-lab lab.json` to see every policy side by side here."
)


def _landed(view: FleetView, metrics: RequestMetrics | None) -> int | None:
    if metrics is None:
        return None
    return next((q.landed for q in view.requests if q.request_id == metrics.request_id), None)


def replica_figures(view: FleetView, metrics: RequestMetrics | None, viewer: str | None) -> list:
    """One compact tree per replica; the visitor's last request marked on the one it landed on."""
    landed = _landed(view, metrics)
    figs = []
    for i, r in enumerate(view.replicas):
        snap = r.snapshot
        path = request_path(snap, metrics) if i == landed else None
        figs.append(tree_figure(snap, path, collapse_chains=len(snap.nodes) > 24, height=380, compact=True,
                                max_nodes=120, max_fan=12, viewer_owns=viewer))
    return figs


def build_fleet_panel(engine: EngineAPI, last_metrics: gr.State, active: bool = False,
                      lab: dict | None = None) -> LiveView:
    first = engine.fleet_view()
    count = len(first.replicas) if first is not None else 0
    gr.Markdown(f"**Router** {engine.info().backend} · **{count} replicas** behind it.  \n" + INTRO,
                elem_classes=["legend"])
    titles, plots = [], []
    for start in range(0, count, PER_ROW):
        with gr.Row(equal_height=True):
            for i in range(start, min(start + PER_ROW, count)):
                with gr.Column(min_width=280):
                    titles.append(gr.Markdown(f"**replica {i}**", elem_classes=["legend"]))
                    plots.append(gr.Plot(show_label=False, elem_classes=["mini-tree", KEEP_ZOOM]))
    status = status_line()
    duplication = gr.Markdown("")
    gr.Markdown("#### The replicas")
    replicas = gr.Markdown("")
    gr.Markdown("#### The last requests from this page, and where they landed"
                + (" (yours only)" if engine.isolation else ""))
    requests = gr.Markdown("")
    gr.Markdown(ATTRIBUTION_NOTE, elem_classes=["legend"])
    gr.Markdown("#### The routing lab: the same trace under each policy")
    if lab is not None:
        gr.Markdown(LAB_INTRO + "  \n" + lab_caption(lab), elem_classes=["legend"])
        gr.Markdown(lab_table(lab))
    else:
        gr.Markdown(LAB_HOWTO, elem_classes=["legend"])
    seen = gr.State(None)

    def refresh(metrics, seen_before, request: gr.Request):
        sig = (engine_signature(engine), getattr(metrics, "request_id", None))
        skip = [gr.skip()] * (2 * count + 3)
        if unchanged(seen_before, sig):
            return *skip, seen_before
        viewer = visitor_namespace(request, engine)
        view = engine.fleet_view(viewer)
        if view is None:
            return *skip, seen_before
        owns = viewer if engine.isolation else None
        figs = replica_figures(view, metrics, owns)
        audience = audience_of(engine)
        yours = landed_of(view) if engine.isolation else None  # the requests listed are the viewer's own
        heads = [replica_title(i, r, audience, None if yours is None else yours[i]) for i, r in enumerate(view.replicas)]
        return (*heads, *figs, duplication_line(view, audience), replicas_table(view, audience, yours),
                requests_table(view), drawn(sig))

    live = LiveView(gr.Timer(2.0, active=active), refresh, [last_metrics, seen],
                    [*titles, *plots, duplication, replicas, requests, seen], status)
    live.refresh_on(live.timer.tick, last_metrics.change)
    return live
