"""Pure figure builders for the radix tree: ``TreeSnapshot`` in, plotly ``Figure`` out.

Owns the look of the tree in two views, from the marks ``components.tree_marks``
picks and places:

- ``tree``: node-link diagram, root on the left, one row per leaf;
- ``icicle``: one bar per node, x = prefix length in tokens, so depth reads as
  how far into the prompt a node starts and ends.

Size by tokens, colour by recency or hits, the last request's path in green
(reused) and orange (computed), hover text escaped. Knows nothing about Gradio
or the engine object; other visitors' nodes reach it ``hidden``, without text.
"""

from __future__ import annotations

import html
import math
import re

import plotly.graph_objects as go
from plotly.colors import sample_colorscale

from components.chart_style import TOKEN_COLORS
from components.format import fmt_ago, fmt_bytes
from components.tree_marks import COMPUTED, REUSED, VisualNode, layout, visual_tree
from engine.types import TreeSnapshot

STATUS_COLORS = {REUSED: TOKEN_COLORS["cached"], COMPUTED: TOKEN_COLORS["computed"]}
HIDDEN_COLOR = "#cbd5e1"
RECENCY_SCALE = [[0.0, "#1e3a8a"], [0.35, "#3b82f6"], [0.7, "#93c5fd"], [1.0, "#e2e8f0"]]
HITS_SCALE = [[0.0, "#ede9fe"], [0.5, "#8b5cf6"], [1.0, "#4c1d95"]]
COLOR_MODES = ("recency", "hits")
VIEWS = ("tree", "icicle")
_SPECIAL = re.compile(r"<\|[^|<>]{1,40}\|>")  # chat-template markers such as <|im_start|>


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
    """
    icicle = view == "icicle"
    max_nodes = max_nodes or (2000 if icicle else 300)
    max_fan = max_fan or (500 if icicle else 40)
    marks = visual_tree(snapshot, path, collapse_chains, max_nodes, max_fan)
    fig = go.Figure()
    _base_layout(fig, snapshot, height, f"{view}-{color_by}", compact)
    if len(marks) == 1:
        fig.add_annotation(text="The cache is empty.<br>Send a message: its tokens appear here as a branch.",
                           x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False, font=dict(size=14))
        return fig
    pos, span = layout(marks)
    colors, cbar = _colors(marks, color_by)
    hover = {vid: _hover(m, viewer_owns) for vid, m in marks.items() if vid}
    if view == "icicle":
        _draw_icicle(fig, marks, span, colors, hover, label=len(marks) <= 40)
    else:
        _draw_tree(fig, marks, pos, colors, hover, label=len(marks) <= (14 if compact else 40))
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", hoverinfo="skip", showlegend=False,
                             marker=dict(colorscale=cbar[0], cmin=cbar[1], cmax=cbar[2], color=[cbar[1]],
                                         showscale=not compact,
                                         colorbar=dict(title=dict(text=cbar[3], side="right"), thickness=10,
                                                       len=0.6, tickvals=cbar[4], ticktext=cbar[5]))))
    return fig


def _base_layout(fig: go.Figure, snapshot: TreeSnapshot, height: int, revision: str, compact: bool) -> None:
    fig.update_layout(
        height=height, margin=dict(l=8, r=8, t=8 if compact else 30, b=8), plot_bgcolor="white",
        paper_bgcolor="white", hovermode="closest", showlegend=False, uirevision=revision, dragmode="zoom",
        hoverlabel=dict(align="left", font_size=12), font=dict(size=11),
        xaxis=dict(visible=False), yaxis=dict(visible=False, autorange="reversed"))
    if not compact:
        fig.update_layout(title=dict(
            text=f"{len(snapshot.nodes):,} nodes · {snapshot.num_tokens:,} tokens · "
                 f"{snapshot.num_bytes / 2**20:,.1f} MiB of {snapshot.budget_bytes / 2**20:,.0f} MiB",
            x=0.01, font=dict(size=13)))


def _draw_tree(fig, marks, pos, colors, hover, label: bool) -> None:
    max_tok = max((m.num_tokens for m in marks.values()), default=1) or 1
    edges: dict[str, tuple[list, list]] = {"": ([], []), REUSED: ([], []), COMPUTED: ([], [])}
    for vid, m in marks.items():
        if vid == 0:
            continue
        (x0, y0), (x1, y1) = pos[m.parent_vid], pos[vid]
        xs, ys = edges[m.status]
        xs += [x0, x0, x1, None]  # elbow: down the parent's column, then across
        ys += [y0, y1, y1, None]
    for status, (xs, ys) in edges.items():
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", hoverinfo="skip",
                                 line=dict(color=STATUS_COLORS.get(status, "#94a3b8"), width=4 if status else 1.2)))
    vids = [v for v in marks if v]
    sizes = [8 + 34 * math.sqrt(marks[v].num_tokens / max_tok) for v in vids]
    line_colors = [STATUS_COLORS.get(marks[v].status, "#dc2626" if marks[v].lock_ref else "white") for v in vids]
    line_widths = [3 if (marks[v].status or marks[v].lock_ref) else 1 for v in vids]
    symbols = ["diamond" if marks[v].lock_ref else "square" if marks[v].grouped_leaves else "circle" for v in vids]
    texts = [_label(marks[v]) for v in vids] if label else None
    fig.add_trace(go.Scatter(
        x=[pos[v][0] for v in vids], y=[pos[v][1] for v in vids], mode="markers+text" if label else "markers",
        text=texts, textfont=dict(size=10, color="#334155"),
        textposition=["bottom center" if pos[v][0] % 2 else "top center" for v in vids],  # neighbours alternate
        hovertext=[hover[v] for v in vids], hoverinfo="text",
        marker=dict(size=sizes, color=[colors[v] for v in vids], symbol=symbols,
                    line=dict(color=line_colors, width=line_widths), opacity=0.95)))
    fig.add_trace(go.Scatter(x=[pos[0][0]], y=[pos[0][1]], mode="markers+text", text=["root"],
                             textposition="middle left", hoverinfo="skip",
                             marker=dict(size=9, color="#0f172a", symbol="square")))
    fig.update_xaxes(range=[-0.6, max(p[0] for p in pos.values()) + (1.2 if label else 0.6)])  # room for labels


def _draw_icicle(fig, marks, span, colors, hover, label: bool) -> None:
    vids = [v for v in marks if v]
    fig.add_trace(go.Bar(
        text=[_label(marks[v], 40) for v in vids] if label else None, textposition="inside",
        insidetextanchor="start", textfont=dict(size=10), constraintext="inside", orientation="h",
        base=[marks[v].start_tokens for v in vids], x=[max(marks[v].num_tokens, 0.5) for v in vids],
        y=[(span[v][0] + span[v][1]) / 2 for v in vids], width=[(span[v][1] - span[v][0]) * 0.94 for v in vids],
        hovertext=[hover[v] for v in vids], hoverinfo="text",
        marker=dict(color=[colors[v] for v in vids],
                    line=dict(color=[STATUS_COLORS.get(marks[v].status, "#dc2626" if marks[v].lock_ref else "white")
                                     for v in vids],
                              width=[3 if (marks[v].status or marks[v].lock_ref) else 0.5 for v in vids]))))
    fig.update_layout(bargap=0, xaxis=dict(visible=True, title=dict(text="prefix length (tokens)"),
                                           gridcolor="#e2e8f0", zeroline=False))


def _colors(marks: dict[int, VisualNode], color_by: str):
    """A colour per mark, plus the colour bar: (scale, min, max, title, tick values, tick labels)."""
    vids = [v for v in marks if v]
    if color_by == "hits":
        top = max(1, max((marks[v].hits for v in vids), default=1))
        vals = {v: min(1.0, marks[v].hits / top) for v in vids}
        scale, cbar = HITS_SCALE, (HITS_SCALE, 0, top, "hits", [0, top], ["0", f"{top:,}"])
    else:  # recency on a log scale: seconds to hours all stay readable
        horizon = math.log10(1 + 3600)
        vals = {v: min(1.0, math.log10(1 + marks[v].last_access_s_ago) / horizon) for v in vids}
        ticks = [0, math.log10(11) / horizon, math.log10(61) / horizon, math.log10(601) / horizon, 1]
        scale, cbar = RECENCY_SCALE, (RECENCY_SCALE, 0, 1, "last used", ticks, ["now", "10 s", "1 min", "10 min", "1 h"])
    sampled = sample_colorscale(scale, [vals[v] for v in vids]) if vids else []
    colors = {v: (HIDDEN_COLOR if marks[v].hidden else c) for v, c in zip(vids, sampled, strict=True)}
    return colors, cbar


def _owner(m: VisualNode, viewer_owns: str | None) -> str:
    if m.hidden:
        return "another visitor's (text hidden)"
    if m.namespace == "":
        return "shared"
    if viewer_owns and m.namespace == viewer_owns:
        return "yours"
    if viewer_owns and m.namespace.startswith(viewer_owns + "/"):
        return f"yours ({html.escape(m.namespace[len(viewer_owns) + 1:])})"
    return f"namespace {html.escape(m.namespace)}"


def _hover(m: VisualNode, viewer_owns: str | None) -> str:
    head = (f"<b>{m.num_tokens:,} tokens</b> · {fmt_bytes(m.num_bytes)} · prefix {m.start_tokens:,}–"
            f"{m.end_tokens:,}")
    lines = [head, f"hits {m.hits:,} · last used {fmt_ago(m.last_access_s_ago)} · "
                   + (f"<b>locked</b> by {m.lock_ref} running request(s)" if m.lock_ref else "unlocked"),
             _owner(m, viewer_owns)]
    if m.grouped_leaves:
        lines.insert(0, f"<b>{m.grouped_leaves:,} smaller leaves</b> grouped to keep the view readable")
    elif len(m.member_ids) > 1:
        lines.append(f"{len(m.member_ids)} nodes in a chain, drawn as one")
    if m.status:
        lines.append({REUSED: "your last request was <b>served</b> from here",
                      COMPUTED: "your last request <b>computed</b> this"}[m.status])
    if not m.hidden and m.text and not m.grouped_leaves:
        lines.append("<i>" + _wrap(m.text) + "</i>")
    return "<br>".join(lines)


def _wrap(text: str, width: int = 64, max_lines: int = 6) -> str:
    """Escaped, wrapped text for a hover box (plotly reads a small HTML subset)."""
    text = text.replace("\r", "").replace("\t", " ")
    out: list[str] = []
    for para in text.split("\n"):
        while para and len(out) < max_lines:
            out.append(para[:width])
            para = para[width:]
        if len(out) >= max_lines:
            break
    shown = "\n".join(out)
    more = "…" if len(shown) < len(text.rstrip("\n")) else ""
    return "<br>".join(html.escape(line) for line in out) + more


def _label(m: VisualNode, width: int = 22) -> str:
    if m.hidden:
        return "(private)"
    if m.grouped_leaves:
        return f"+{m.grouped_leaves} leaves"
    text = _gist(m.text)
    return f"{m.num_tokens:,} tok · " + html.escape(text[:width] + ("…" if len(text) > width else ""))


def _gist(text: str) -> str:
    """The first substantial run of text between chat-template markers, "role: text" style:
    a node that starts with the tail of an earlier turn is labelled by what it adds."""
    segments = [seg.strip() for seg in _SPECIAL.split(text) if seg.strip()]
    seg = next((s for s in segments if len(s) >= 12), " ".join(segments))
    role, sep, rest = seg.partition("\n")
    if sep and role.isalpha() and len(role) <= 12:
        seg = f"{role}: {rest}"
    return " ".join(seg.split())


# ---------------------------------------------------------------- plain data
def snapshot_summary(snapshot: TreeSnapshot) -> dict:
    """A JSON-able view for the API: text is null for other visitors' nodes."""
    return {
        "num_tokens": snapshot.num_tokens, "num_bytes": snapshot.num_bytes, "budget_bytes": snapshot.budget_bytes,
        "evicted_tokens": snapshot.evicted_tokens, "bytes_per_token": snapshot.bytes_per_token,
        "nodes": [{"node_id": n.node_id, "parent_id": n.parent_id, "num_tokens": n.num_tokens,
                   "depth_tokens": n.depth_tokens, "num_bytes": n.num_bytes, "hits": n.hits, "lock_ref": n.lock_ref,
                   "shared": n.namespace == "" and not n.hidden, "hidden": n.hidden,
                   "text": None if n.hidden else n.text} for n in snapshot.nodes],
    }
