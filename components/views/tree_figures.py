"""Pure figure builders for the radix tree: ``TreeSnapshot`` in, plotly ``Figure`` out.

Owns the look of the tree in two views, from the marks ``components.views.tree_marks``
picks and places:

- ``tree``: node-link diagram, root on the left, a column per cached run and a row per
  branch, placed so that a redraw after new requests moves no node drawn before
  (``tree_places.stable_layout``; a big tree that had to be folded is laid out depth
  first instead, and says its marks may move); labels only where they collide with nothing;
- ``icicle``: one bar per node, x = prefix length in tokens, so depth reads as
  how far into the prompt a node starts and ends.

Size by tokens, colour by recency or hits, the last request's path in green
(reused) and orange (computed), nodes in the second tier (``spilled``) hollow in the
tree, hatched in the icicle, dotted edges, named in the hover and the legend; the hover text and labels
themselves come from ``tree_text`` (escaped there). Knows nothing about Gradio or the engine object;
other visitors' nodes reach it ``hidden``, without text.
"""

from __future__ import annotations

import functools
import html
import math

import plotly.graph_objects as go
from plotly.colors import sample_colorscale

from components.views.chart_style import TOKEN_COLORS
from components.views.tree_marks import COMPUTED, REUSED, VisualNode, layout, visual_tree
from components.views.tree_places import node_places, stable_layout
from components.views.tree_text import hover_text, mark_label, tier_words
from engine.types import TreeSnapshot
from engine.visibility import Unit, everyone

STATUS_COLORS = {REUSED: TOKEN_COLORS["cached"], COMPUTED: TOKEN_COLORS["computed"]}
HIDDEN_COLOR = "#cbd5e1"
SPILLED_LINE = "#475569"  # outline of a node in the second tier: drawn hollow (tree) or hatched (icicle)
SPILLED = "spilled"  # edge style key of a spilled mark off the last request's path
RECENCY_SCALE = ((0.0, "#1e3a8a"), (0.35, "#3b82f6"), (0.7, "#93c5fd"), (1.0, "#e2e8f0"))
HITS_SCALE = ((0.0, "#ede9fe"), (0.5, "#8b5cf6"), (1.0, "#4c1d95"))
COLOR_MODES = ("recency", "hits")
VIEWS = ("tree", "icicle")


# ---------------------------------------------------------------- figures
def tree_figure(snapshot: TreeSnapshot, path: dict[int, str] | None = None, color_by: str = "recency",
                view: str = "tree", viewer_owns: str | None = None, collapse_chains: bool = True,
                max_nodes: int | None = None, max_fan: int | None = None, height: int = 520,
                compact: bool = False) -> go.Figure:
    """The live tree as a figure (``view`` is ``"tree"`` or ``"icicle"``).

    ``viewer_owns`` is the viewer's namespace, used only to label nodes "yours".
    ``max_nodes`` and ``max_fan`` cap the marks drawn, in all and under one
    parent (defaults: 300 and 40 for the tree, where every leaf needs a row
    of its own; 2,000 and 500 for the icicle, where a leaf can be a line).

    The figure is assembled from plain dicts and built without plotly's
    per-element validation, which alone took most of a second for 2,000 marks
    (tests validate the same dicts once: ``go.Figure(fig.to_dict())``).
    """
    icicle = view == "icicle"
    max_nodes = max_nodes or (2000 if icicle else 300)
    max_fan = max_fan or (500 if icicle else 40)
    marks = visual_tree(snapshot, path, collapse_chains, max_nodes, max_fan)
    fig_layout = _base_layout(snapshot, height, f"{view}-{color_by}", compact)
    if len(marks) == 1:
        fig_layout["annotations"] = [dict(
            text="The cache is empty.<br>Send a message: its tokens appear here as a branch.", x=0.5, y=0.5,
            xref="paper", yref="paper", showarrow=False, font=dict(size=14))]
        return go.Figure(layout=fig_layout)
    colors, cbar = _colors(marks, color_by)
    hover = {vid: hover_text(m, viewer_owns, snapshot.tier_kind) for vid, m in marks.items() if vid}
    if icicle:
        traces = _icicle_traces(marks, layout(marks)[1], colors, hover, fig_layout, label=len(marks) <= 40)
    else:
        if any(m.grouped_nodes for m in marks.values()):
            # Folded (a big tree): which subtrees fold changes as the tree grows, so places cannot
            # be kept anyway; the compact depth-first layout reads best, and the title says so.
            pos = {vid: (float(x), y) for vid, (x, y) in layout(marks)[0].items()}
            if "title" in fig_layout:
                fig_layout["title"]["text"] += " · big tree folded: marks may move as it grows"
        else:
            pos = stable_layout(marks, node_places(snapshot))
        traces = _tree_traces(marks, pos, colors, hover, fig_layout, label=len(marks) <= (30 if compact else 60),
                              label_width=12 if compact else 22, compact=compact)
    traces.append(dict(type="scatter", x=[None], y=[None], mode="markers", hoverinfo="skip", showlegend=False,
                       marker=dict(colorscale=cbar[0], cmin=cbar[1], cmax=cbar[2], color=[cbar[1]],
                                   showscale=not compact,
                                   colorbar=dict(title=dict(text=cbar[3], side="right"), thickness=10,
                                                 len=0.6, tickvals=cbar[4], ticktext=cbar[5]))))
    if any(m.spilled for m in marks.values()):
        _spilled_legend(traces, fig_layout, snapshot.tier_kind, icicle)
    return go.Figure(data=traces, layout=fig_layout, _validate=False)


def _spilled_legend(traces: list[dict], fig_layout: dict, tier_kind: str, icicle: bool) -> None:
    """One legend entry that says what the hollow (hatched) marks are; no other trace shows in it."""
    for t in traces:
        t.setdefault("showlegend", False)
    sample = (dict(type="bar", x=[None], y=[None], orientation="h",
                   marker=dict(color="white", line=dict(color=SPILLED_LINE, width=1), pattern=dict(shape="/")))
              if icicle else
              dict(type="scatter", x=[None], y=[None], mode="markers",
                   marker=dict(size=12, color="white", symbol="circle", line=dict(color=SPILLED_LINE, width=2))))
    traces.append(dict(sample, name=tier_words(tier_kind) + ": not in memory, loaded back when needed",
                       showlegend=True, hoverinfo="skip"))
    # On a line of its own between the title and the plot: inside the plot it covered the root's bar.
    fig_layout.update(showlegend=True, legend=dict(orientation="h", x=0, xanchor="left", y=1, yanchor="bottom",
                                                   bgcolor="rgba(255,255,255,0.85)", font=dict(size=11)))


def _base_layout(snapshot: TreeSnapshot, height: int, revision: str, compact: bool) -> dict:
    out = dict(
        # compact (beside the chat): room above for plotly's toolbar, so no label sits under it
        # (a second tier's legend gets a line of its own under the title)
        height=height, margin=dict(l=8, r=8, t=28 if compact else 52 if any(n.spilled for n in snapshot.nodes) else 30,
                                   b=8), plot_bgcolor="white",
        paper_bgcolor="white", hovermode="closest", showlegend=False, uirevision=revision, dragmode="zoom",
        hoverlabel=dict(align="left", font=dict(size=12)), font=dict(size=11),
        xaxis=dict(visible=False), yaxis=dict(visible=False, autorange="reversed"))
    if not compact:
        spilled = [n for n in snapshot.nodes if n.spilled]
        in_memory = f"{len(snapshot.nodes) - len(spilled):,} nodes" if spilled else f"{len(snapshot.nodes):,} nodes"
        tier = f" · +{sum(n.num_tokens for n in spilled):,} tokens in the second tier" if spilled else ""
        out["title"] = dict(
            text=f"{in_memory} · {snapshot.num_tokens:,} tokens · "
                 + (f"{snapshot.num_bytes / 2**20:,.1f} MiB of {snapshot.budget_bytes / 2**20:,.0f} MiB"
                    if snapshot.bytes_per_token else REMOTE_TITLES.get(snapshot.origin, REMOTE_TITLES["shadow"]))
                 + tier,
            x=0.01, y=1, yref="container", yanchor="top", pad=dict(t=8), font=dict(size=13))
    return out


REMOTE_TITLES = {  # remote mode: where the tree comes from (``TreeSnapshot.origin``)
    "events": "the server's own blocks, from its KV events",
    "shadow": "shadow tree of what was sent (server memory unknown)",
}


def _outline(m: VisualNode) -> tuple[str, float]:
    """Outline colour and width: the last request's status, else red when locked."""
    if m.status:
        return STATUS_COLORS[m.status], 3
    if m.lock_ref:
        return "#dc2626", 3
    return (SPILLED_LINE, 2) if m.spilled else ("white", 1)


# Label geometry, in pixels. The figure's width is the page's to choose (Gradio sizes the plot to its
# column), so labels are placed for a narrow plot: the small tree on a phone (about 326 px wide, 480 on
# a desktop) and the tree tab on a laptop; a wider plot only spreads the marks apart.
LABEL_FONT_PX = 10
CHAR_WIDTH_EM = 0.6  # a generous average glyph width of plotly's sans-serif font, in font sizes
LABEL_WIDTH_PX = {True: 320, False: 900}  # compact (beside the chat) or not: the narrowest plot labels are placed for
COLORBAR_PX = 70  # what the colour bar (and its tick labels) takes off the plot's width
PAD_PX = dict(left=40, right=16, top=20, bottom=20)  # around the marks, for the root's label and the edge rows'
ROOT_LABEL = "root"


def label_box(cx: float, cy: float, marker_px: float, text: str, where: str,
              font_px: float = LABEL_FONT_PX) -> tuple[float, float, float, float]:
    """The box (x0, y0, x1, y1; pixels, y down) plotly gives a point's text at ``where``
    (a ``textposition``): offset from the marker by plotly's own rule (radius / 0.8 + 1)."""
    w, h = len(text) * font_px * CHAR_WIDTH_EM, font_px * 1.1
    r = marker_px / 1.6 + 1
    vertical, _, horizontal = where.partition(" ")
    x0 = {"center": cx - w / 2, "right": cx + r, "left": cx - r - w}[horizontal]
    y0 = {"top": cy - r - h, "bottom": cy + r, "middle": cy - h / 2}[vertical]
    return (x0, y0, x0 + w, y0 + h)


def _overlaps(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _place_labels(marks: dict[int, VisualNode], vids: list[int], pos: dict[int, tuple[float, float]],
                  size_px: dict[int, float], to_px, area: tuple[float, float], label_width: int) -> dict[int, str]:
    """Mark -> textposition for the labels that fit; the rest keep their text in the hover only.

    Greedy, most telling marks first (``vids`` come sorted by ``_label_rank``): each label
    tries above or below its marker (alternating by column, as before), then beside it, and
    takes the first place that stays inside the plot and covers no other label and no marker.
    """
    w, h = area
    markers = {v: (x - size_px[v] / 2, y - size_px[v] / 2, x + size_px[v] / 2, y + size_px[v] / 2)
               for v in [0, *vids] for x, y in [to_px(*pos[v])]}
    cx, cy = to_px(*pos[0])
    taken = [label_box(cx, cy, size_px[0], ROOT_LABEL, "middle left")]
    out: dict[int, str] = {}
    for v in vids:  # in ``_label_rank`` order
        cx, cy = to_px(*pos[v])
        text = mark_label(marks[v], label_width)
        first, second = ("top", "bottom") if round(pos[v][0]) % 2 == 0 else ("bottom", "top")
        for where in (f"{first} center", f"{second} center", f"{first} right", f"{second} right",
                      f"{first} left", f"{second} left"):
            box = label_box(cx, cy, size_px[v], html.unescape(text), where)
            if (box[0] < 0 or box[1] < 0 or box[2] > w or box[3] > h
                    or any(_overlaps(box, b) for b in taken)
                    or any(_overlaps(box, b) for u, b in markers.items() if u != v)):
                continue
            taken.append(box)
            out[v] = where
            break
    return out


def _label_rank(m: VisualNode) -> tuple:
    """Which labels matter most: the last request's path, then the biggest marks."""
    return (not m.status, -(m.grouped_tokens or m.num_tokens), m.vid)


def _tree_traces(marks, pos, colors, hover, fig_layout: dict, label: bool, label_width: int = 22,
                 compact: bool = False) -> list[dict]:
    size_of = {v: m.grouped_tokens or m.num_tokens for v, m in marks.items()}
    max_tok = max(size_of.values(), default=1) or 1
    size_px = {v: 8 + 34 * math.sqrt(size_of[v] / max_tok) for v in marks}
    size_px[0] = 9
    edges: dict[str, tuple[list, list]] = {"": ([], []), REUSED: ([], []), COMPUTED: ([], []), SPILLED: ([], [])}
    for vid, m in marks.items():
        if vid == 0:
            continue
        (x0, y0), (x1, y1) = pos[m.parent_vid], pos[vid]
        xs, ys = edges[m.status or (SPILLED if m.spilled else "")]
        xs += [x0, x0, x1, None]  # elbow: down the parent's column, then across
        ys += [y0, y1, y1, None]
    traces = [dict(type="scatter", x=xs, y=ys, mode="lines", hoverinfo="skip",
                   line=dict(color=STATUS_COLORS.get(status, "#94a3b8"), width=4 if status in STATUS_COLORS else 1.2,
                             dash="dot" if status == SPILLED else "solid"))
              for status, (xs, ys) in edges.items()]
    # most telling first: labels are placed in this order, and the page script hides later ones first
    vids = sorted((v for v in marks if v), key=lambda v: _label_rank(marks[v]))
    outlines = [_outline(marks[v]) for v in vids]
    points = dict(
        type="scatter", x=[pos[v][0] for v in vids], y=[pos[v][1] for v in vids], customdata=vids,
        mode="markers+text" if label else "markers", hovertext=[hover[v] for v in vids], hoverinfo="text",
        marker=dict(size=[size_px[v] for v in vids], color=[colors[v] for v in vids],
                    symbol=["square" if marks[v].grouped_nodes else "diamond" if marks[v].lock_ref else "circle"
                            for v in vids],
                    line=dict(color=[c for c, _ in outlines], width=[w for _, w in outlines]), opacity=0.95))
    xs_all, rows = [p[0] for p in pos.values()], [p[1] for p in pos.values()]
    x_lo, x_hi, last_row = min(xs_all), max(xs_all), max(rows)
    if label:  # ranges that leave fixed room in pixels around the marks, so labels can be placed in pixels
        m = fig_layout["margin"]
        area_w = LABEL_WIDTH_PX[compact] - m["l"] - m["r"] - (0 if compact else COLORBAR_PX)
        area_h = fig_layout["height"] - m["t"] - m["b"]
        pad = {k: max(v, max(size_px.values()) / 2 + 2) for k, v in PAD_PX.items()}  # no marker cut off either
        sx = (area_w - pad["left"] - pad["right"]) / max(x_hi - x_lo, 1.0)
        sy = (area_h - pad["top"] - pad["bottom"]) / max(last_row, 1.0)
        x_range = [x_lo - pad["left"] / sx, x_hi + pad["right"] / sx]
        y_range = [last_row + pad["bottom"] / sy, -pad["top"] / sy]  # reversed: the first row on top

        def to_px(x: float, y: float) -> tuple[float, float]:
            return ((x - x_range[0]) * sx, (y - y_range[1]) * sy)

        where = _place_labels(marks, vids, pos, size_px, to_px, (area_w, area_h), label_width)
        points.update(text=[mark_label(marks[v], label_width) if v in where else "" for v in vids],
                      textfont=dict(size=LABEL_FONT_PX, color="#334155"),
                      textposition=[where.get(v, "top center") for v in vids])
    else:  # no labels: plotly's own autorange leaves room for the markers
        x_range, y_range = [x_lo - 0.6, x_hi + 0.6], None
    traces.append(dict(type="scatter", x=[pos[0][0]], y=[pos[0][1]], mode="markers+text", text=[ROOT_LABEL],
                       textposition="middle left", hoverinfo="skip", textfont=dict(size=LABEL_FONT_PX),
                       marker=dict(size=size_px[0], color="#0f172a", symbol="square")))
    traces.append(points)
    fig_layout["xaxis"]["range"] = x_range
    if y_range:
        fig_layout["yaxis"]["range"] = y_range
        fig_layout["yaxis"].pop("autorange", None)
    return traces


def _icicle_traces(marks, span, colors, hover, fig_layout: dict, label: bool) -> list[dict]:
    vids = [v for v in marks if v]
    outlines = [_outline(marks[v]) for v in vids]
    bars = dict(
        type="bar", orientation="h", base=[marks[v].start_tokens for v in vids],
        x=[max(marks[v].num_tokens, 0.5) for v in vids], y=[(span[v][0] + span[v][1]) / 2 for v in vids],
        width=[(span[v][1] - span[v][0]) * 0.94 for v in vids], hovertext=[hover[v] for v in vids],
        hoverinfo="text",
        marker=dict(color=[colors[v] for v in vids],
                    line=dict(color=[c for c, _ in outlines], width=[w if w > 1 else 0.5 for _, w in outlines])))
    if any(marks[v].spilled for v in vids):  # hatched: in the second tier
        bars["marker"]["pattern"] = dict(shape=["/" if marks[v].spilled else "" for v in vids], fgcolor=SPILLED_LINE,
                                         size=6)
    if label:
        bars.update(text=[mark_label(marks[v], 40) for v in vids], textposition="inside", insidetextanchor="start",
                    textfont=dict(size=10), constraintext="inside")
    fig_layout.update(bargap=0, xaxis=dict(visible=True, title=dict(text="prefix length (tokens)"),
                                           gridcolor="#e2e8f0", zeroline=False))
    return [bars]


def _colors(marks: dict[int, VisualNode], color_by: str):
    """A colour per mark, plus the colour bar: (scale, min, max, title, tick values, tick labels)."""
    vids = [v for v in marks if v]
    if color_by == "hits":
        top = max(1, max((marks[v].hits for v in vids), default=1))
        vals = {v: min(1.0, marks[v].hits / top) for v in vids}
        scale, cbar = HITS_SCALE, (_as_lists(HITS_SCALE), 0, top, "hits", [0, top], ["0", f"{top:,}"])
    else:  # recency on a log scale: seconds to hours all stay readable
        horizon = math.log10(1 + 3600)
        vals = {v: min(1.0, math.log10(1 + marks[v].last_access_s_ago) / horizon) for v in vids}
        ticks = [0, math.log10(11) / horizon, math.log10(61) / horizon, math.log10(601) / horizon, 1]
        scale, cbar = RECENCY_SCALE, (_as_lists(RECENCY_SCALE), 0, 1, "last used", ticks, ["now", "10 s", "1 min", "10 min", "1 h"])
    lut = _palette(scale)
    colors = {v: "white" if marks[v].spilled else HIDDEN_COLOR if marks[v].hidden
              else lut[round(vals[v] * (len(lut) - 1))] for v in vids}
    return colors, cbar


def _as_lists(scale: tuple) -> list[list]:
    return [list(stop) for stop in scale]


@functools.cache
def _palette(scale: tuple) -> tuple[str, ...]:
    """256 colours sampled along ``scale`` once (sampling per mark cost tens of ms per figure)."""
    return tuple(sample_colorscale(_as_lists(scale), [i / 255 for i in range(256)]))


# The Latency tab's growth curve times prefill on filler text in a namespace of its own, cleared
# when done: while it runs, its nodes say so instead of showing the filler as if someone asked it.
def snapshot_summary(snapshot: TreeSnapshot) -> dict:
    """A JSON-able view for the API: text is null for other visitors' nodes; ``spilled`` nodes
    are in the second tier (``tier_kind``), not in the pool. ``snapshot`` is a viewer's view
    (``engine.snapshot_view.for_viewer``: others' nodes and evictions already in buckets)."""
    return {
        "num_tokens": snapshot.num_tokens, "num_bytes": snapshot.num_bytes, "budget_bytes": snapshot.budget_bytes,
        "evicted_tokens": everyone(snapshot.evicted_tokens, Unit.TOKENS).value,  # bucketed by for_viewer
        "bytes_per_token": snapshot.bytes_per_token,
        "tier_kind": snapshot.tier_kind,
        "nodes": [{"node_id": n.node_id, "parent_id": n.parent_id, "num_tokens": n.num_tokens,
                   "depth_tokens": n.depth_tokens, "num_bytes": n.num_bytes, "hits": n.hits, "lock_ref": n.lock_ref,
                   "shared": n.namespace == "" and not n.hidden, "hidden": n.hidden, "spilled": n.spilled,
                   "text": None if n.hidden else n.text} for n in snapshot.nodes],
    }
