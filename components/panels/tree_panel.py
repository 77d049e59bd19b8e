"""Live radix tree panel: the engine's tree, redrawn while anyone runs requests.

Owns the tree tab's controls (view, colour, chain collapsing), its live
refresh, and the ``tree_snapshot`` API endpoint. The drawing itself lives in
``components.views.tree_figures``. In isolation mode every visitor sees other visitors'
nodes as shape and size only (the engine's snapshot hides their text).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import gradio as gr

from components.panels.engine_state import engine_state
from components.panels.live import KEEP_ZOOM, LiveView, drawn, engine_signature, shared_snapshot, status_line, unchanged
from components.session import visitor_namespace
from components.views.tree_figures import snapshot_summary, tree_figure
from components.views.tree_marks import request_path
from engine.api import EngineAPI
from engine.types import RequestMetrics, TreeSnapshot

LEGEND = (
    "Each mark is a run of tokens the cache holds; a branch is where two prompts diverged. "
    "**Size** = tokens, **colour** = how recently used (or how often hit). "
    "Your last request: <span style='color:#16a34a'>**green** = served from the cache</span>, "
    "<span style='color:#ea580c'>**orange** = computed</span>. ◆ = locked by a running request; "
    "grey = another visitor's tokens (text hidden); ■ **+N nodes** = whole branches folded to keep a big tree "
    "readable (hover: how many nodes and tokens). Hover a node for its text; drag a box to zoom in, double-click to "
    "zoom out."
)

REMOTE_NOTE = (
    "  \n**Remote server:** this is a *shadow* tree of the token ids this dashboard sent, coloured by the cached "
    "tokens the server reported (the fallback for servers that publish no KV events, such as llama.cpp). The "
    "server's own cache may keep whole blocks only (vLLM: 16 or 32 tokens) and evicts on its own: this tree cannot "
    "see either."
)
REMOTE_EVENTS_NOTE = (
    "  \n**Remote server, its real cache:** drawn from the KV events the server publishes (vLLM or SGLang "
    "`--kv-events-config`): its own blocks, merged into radix nodes, evictions as they happen; hatched = held in "
    "another medium (host memory, storage). Your last request is coloured by walking its tokens down those blocks "
    "(green = the blocks the server reported as cached). Blocks that no request of yours reaches are another "
    "client's (grey, no text, under isolation). Until the first event arrives, the shadow tree of what was sent is "
    "drawn instead."
)


REMOTE_FLEET_NOTE = (
    "  \n**Remote, in front of a router:** this is the *shadow* tree of the token ids this dashboard sent through "
    "the router, coloured by the cached tokens each answer reported. Each replica's own cache, from its KV events, "
    "is in the **Fleet** tab."
)


def remote_note(engine: EngineAPI) -> str:
    """What the tree is, in remote mode: the server's own blocks (KV events), the shadow tree, or
    (in front of a router) the shadow tree with the replicas' real trees in the Fleet tab."""
    if not engine.capabilities.remote:
        return ""
    if engine.fleet_view() is not None:
        return REMOTE_FLEET_NOTE
    return REMOTE_EVENTS_NOTE if engine.kv_event_figures() else REMOTE_NOTE


def tree_figure_for(engine: EngineAPI, request: gr.Request | None, metrics: RequestMetrics | None,
                    color_by: str = "recency", view: str = "tree", collapse: bool | None = True, **kw):
    """The tree as this visitor may see it; ``collapse=None`` collapses chains only
    past a couple of dozen nodes (a small tree reads better node by node)."""
    viewer = visitor_namespace(request, engine)
    snap = shared_snapshot(engine, viewer)
    if collapse is None:
        collapse = len(snap.nodes) > 24
    owns = viewer if engine.isolation else None
    key = (owns, metrics.request_id if metrics is not None else None, color_by, view, collapse,
           tuple(sorted(kw.items())))
    return engine_state(engine, "tree_panel.figures", SnapshotMemo).get(snap, key, lambda: tree_figure(
        snap, request_path(snap, metrics), color_by=color_by, view=view, viewer_owns=owns, collapse_chains=collapse,
        **kw))


class SnapshotMemo:
    """What is built from a shared snapshot (tree figures, endpoint summaries), reused by every
    session that asks for the same picture of the same snapshot (same viewer rule, last request,
    colour, view), so N open tabs cost one figure per change, not N. Figures are only read after they are made
    (Gradio serialises them), so sessions may share one. Bounded; oldest dropped first."""

    MAX_FIGURES = 32

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._figures: OrderedDict[tuple, tuple[TreeSnapshot, Any]] = OrderedDict()

    def get(self, snap: TreeSnapshot, key: tuple, make: Callable[[], Any]) -> Any:
        full_key = (id(snap), *key)
        with self._lock:
            hit = self._figures.get(full_key)
        if hit is not None and hit[0] is snap:
            return hit[1]
        fig = make()  # outside the lock: sessions drawing other pictures do not wait
        with self._lock:
            self._figures[full_key] = (snap, fig)
            while len(self._figures) > self.MAX_FIGURES:
                self._figures.popitem(last=False)
        return fig


def build_tree_panel(engine: EngineAPI, last_metrics: gr.State, active: bool = False) -> LiveView:
    with gr.Row():
        view = gr.Radio(["tree", "icicle"], value="tree", label="View",
                        info="icicle: x = prefix length in tokens; best past a few hundred nodes", scale=2)
        color_by = gr.Radio(["recency", "hits"], value="recency", label="Colour by", scale=1)
        collapse = gr.Checkbox(value=True, label="Collapse chains", info="draw a run of single children as one",
                               scale=1)
    plot = gr.Plot(show_label=False, elem_id="tree-plot", elem_classes=[KEEP_ZOOM])
    status = status_line(elem_id="tree-status")
    gr.Markdown(LEGEND + remote_note(engine), elem_classes=["legend"])
    seen = gr.State(None)

    def refresh(metrics, color, mode, chains, seen_before, request: gr.Request):
        sig = (engine_signature(engine), getattr(metrics, "request_id", None), color, mode, chains)
        if unchanged(seen_before, sig):
            return gr.skip(), seen_before
        fig = tree_figure_for(engine, request, metrics, color_by=color, view=mode, collapse=chains, height=600)
        return fig, drawn(sig)

    live = LiveView(gr.Timer(2.0, active=active), refresh, [last_metrics, color_by, view, collapse, seen],
                    [plot, seen], status)
    live.refresh_on(live.timer.tick, view.change, color_by.change, collapse.change)

    def tree_snapshot(request: gr.Request) -> dict:
        """The radix tree as plain data: one entry per node (text is null for other visitors' nodes)."""
        return snapshot_summary_for(engine, visitor_namespace(request, engine))

    # Public and unauthenticated: bounded like the tab. Each call is served from the shared
    # snapshot (one tree walk per second at most, whoever asks) and its summary is built
    # once per snapshot and view; at most SNAPSHOT_API_CONCURRENCY calls run at once, the
    # rest queue behind them in Gradio's queue (whose size the app caps).
    gr.api(tree_snapshot, api_name="tree_snapshot", concurrency_limit=SNAPSHOT_API_CONCURRENCY)
    return live


SNAPSHOT_API_CONCURRENCY = 2
def snapshot_summary_for(engine: EngineAPI, viewer: str) -> dict:
    """``snapshot_summary`` of the viewer's shared snapshot, reused while that view is the same
    object (``shared_snapshot`` hands every stranger one view, and each visitor the same one
    until the tree changes)."""
    snap = shared_snapshot(engine, viewer)
    return engine_state(engine, "tree_panel.summaries", SnapshotMemo).get(snap, ("summary",),
                                                                         lambda: snapshot_summary(snap))
