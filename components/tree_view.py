"""Pure figure builders for the radix tree: ``TreeSnapshot`` in, plotly ``Figure`` out.

Owns: turning a snapshot into something a person can read: which nodes hold the
visitor's last request (reused vs computed), collapsing long chains, grouping
huge fans of leaves, a networkx layout, and two views:

- ``tree``: node-link diagram, root on the left, one row per leaf;
- ``icicle``: one bar per node, x = prefix length in tokens, so depth reads as
  how far into the prompt a node starts and ends.

Knows nothing about Gradio or the engine object; never sees a tree node, only
the snapshot's plain data. Text of other visitors' nodes never reaches it
(the snapshot marks them ``hidden`` and carries no text).
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import networkx as nx
import plotly.graph_objects as go
from plotly.colors import sample_colorscale

from components.common import TOKEN_COLORS
from engine.types import NodeInfo, RequestMetrics, TreeSnapshot

REUSED, COMPUTED = "reused", "computed"
STATUS_COLORS = {REUSED: TOKEN_COLORS["cached"], COMPUTED: TOKEN_COLORS["computed"]}
HIDDEN_COLOR = "#cbd5e1"
RECENCY_SCALE = [[0.0, "#1e3a8a"], [0.35, "#3b82f6"], [0.7, "#93c5fd"], [1.0, "#e2e8f0"]]
HITS_SCALE = [[0.0, "#ede9fe"], [0.5, "#8b5cf6"], [1.0, "#4c1d95"]]
COLOR_MODES = ("recency", "hits")
VIEWS = ("tree", "icicle")
_SPECIAL = re.compile(r"<\|[^|<>]{1,40}\|>")  # chat-template markers such as <|im_start|>


@dataclass
class VisualNode:
    """One drawn mark: a snapshot node, a collapsed chain of them, or a group of leaves."""

    vid: int
    parent_vid: int
    member_ids: list[int]
    start_tokens: int
    end_tokens: int
    num_bytes: int
    hits: int
    last_access_s_ago: float
    lock_ref: int
    namespace: str
    hidden: bool
    text: str
    status: str = ""
    grouped_leaves: int = 0  # > 0: stands for this many leaves too small to draw one by one
    children: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.end_tokens - self.start_tokens


# ---------------------------------------------------------------- last request
def request_path(snapshot: TreeSnapshot, metrics: RequestMetrics | None) -> dict[int, str]:
    """Node id -> ``REUSED`` or ``COMPUTED`` for the nodes now holding the request's tokens.

    Walks the snapshot along ``prompt_ids + output_ids``: tokens before
    ``cached_tokens`` were served from the cache, the rest were computed by the
    request. Matching on ids (not ``matched_path``) stays right after later
    splits; ``matched_path`` is the fallback when the walk finds nothing.
    """
    if metrics is None or not snapshot.nodes:
        return {}
    ids = list(metrics.prompt_ids) + list(metrics.output_ids)
    children: dict[int, list[NodeInfo]] = {}
    for n in snapshot.nodes:
        children.setdefault(n.parent_id, []).append(n)
    out: dict[int, str] = {}
    parent, pos = 0, 0
    while pos < len(ids):
        best, best_len = None, 0
        for c in children.get(parent, ()):
            if c.hidden or not c.token_ids or c.token_ids[0] != ids[pos]:
                continue
            n = _common_len(c.token_ids, ids, pos)
            if n > best_len:
                best, best_len = c, n
        if best is None:
            break
        out[best.node_id] = REUSED if pos < metrics.cached_tokens else COMPUTED
        pos += best_len
        if best_len < best.num_tokens:
            break
        parent = best.node_id
    if not out:
        present = {n.node_id for n in snapshot.nodes}
        out = {i: REUSED for i in metrics.matched_path if i in present}
    return out


def _common_len(edge: Sequence[int], ids: Sequence[int], start: int) -> int:
    n = min(len(edge), len(ids) - start)
    for i in range(n):
        if edge[i] != ids[start + i]:
            return i
    return n


# ---------------------------------------------------------------- visual tree
def visual_tree(snapshot: TreeSnapshot, path: dict[int, str] | None = None, collapse_chains: bool = True,
                max_nodes: int = 1500, max_fan: int | None = None) -> dict[int, VisualNode]:
    """The marks to draw, keyed by visual id (0 is the root).

    A node joins its parent's mark when the parent has exactly one child and
    both look the same (owner, hidden, reused/computed status): a chat's turns
    read as one bar instead of twenty. Past ``max_nodes`` marks, the least
    recently used leaves of the widest fans are drawn as one "+N leaves" mark;
    so are the leaves past ``max_fan`` under any one parent.
    """
    path = path or {}
    kids: dict[int, list[NodeInfo]] = {}
    for n in snapshot.nodes:
        kids.setdefault(n.parent_id, []).append(n)
    root = VisualNode(0, -1, [], 0, 0, 0, 0, 0.0, 0, "", False, "")
    marks: dict[int, VisualNode] = {0: root}
    owner: dict[int, int] = {0: 0}  # snapshot node id -> visual id
    stack = [0]
    while stack:  # parents before children, whatever order the snapshot has
        pid = stack.pop()
        siblings = sorted(kids.get(pid, ()), key=lambda c: c.node_id)
        for n in siblings:
            status = path.get(n.node_id, "")
            parent_mark = marks[owner[pid]]
            if (collapse_chains and pid != 0 and len(siblings) == 1 and not parent_mark.grouped_leaves
                    and (parent_mark.hidden, parent_mark.namespace, parent_mark.status)
                    == (n.hidden, n.namespace, status)):
                m = parent_mark
                m.member_ids.append(n.node_id)
                m.end_tokens = n.depth_tokens
                m.num_bytes += n.num_bytes
                m.hits = min(m.hits, n.hits)
                m.last_access_s_ago = min(m.last_access_s_ago, n.last_access_s_ago)
                m.lock_ref = max(m.lock_ref, n.lock_ref)
                if not n.hidden and len(m.text) < 600:
                    m.text += n.text
            else:
                m = VisualNode(n.node_id, parent_mark.vid, [n.node_id], n.depth_tokens - n.num_tokens,
                               n.depth_tokens, n.num_bytes, n.hits, n.last_access_s_ago, n.lock_ref,
                               n.namespace, n.hidden, n.text, status)
                marks[m.vid] = m
                parent_mark.children.append(m.vid)
            owner[n.node_id] = m.vid
            stack.append(n.node_id)
    widest = max((len(m.children) for m in marks.values()), default=0)
    if len(marks) - 1 > max_nodes or (max_fan is not None and widest > max_fan):
        _group_small_leaves(marks, max_nodes, max_fan or max_nodes)
    return marks


def _group_small_leaves(marks: dict[int, VisualNode], max_nodes: int, max_fan: int) -> None:
    """Keep at most ``cap`` leaves per parent (the most recent, and any on the
    highlighted path); fold the rest of each fan into one mark."""
    fans = {vid: leaves for vid, m in marks.items() if (leaves := [c for c in m.children if not marks[c].children])}
    others = len(marks) - 1 - sum(len(f) for f in fans.values())
    cap = max(2, min(max_fan, (max_nodes - others) // max(1, len(fans))))
    for vid, leaves in fans.items():
        if len(leaves) <= cap + 1:
            continue
        leaves.sort(key=lambda c: (marks[c].status == "", marks[c].last_access_s_ago))
        keep, fold = leaves[: cap - 1], leaves[cap - 1:]
        folded = [marks.pop(c) for c in fold]
        group = VisualNode(
            vid=-min(f.vid for f in folded), parent_vid=vid, member_ids=[i for f in folded for i in f.member_ids],
            start_tokens=min(f.start_tokens for f in folded), end_tokens=max(f.end_tokens for f in folded),
            num_bytes=sum(f.num_bytes for f in folded), hits=sum(f.hits for f in folded),
            last_access_s_ago=min(f.last_access_s_ago for f in folded), lock_ref=max(f.lock_ref for f in folded),
            namespace="", hidden=all(f.hidden for f in folded), text="", grouped_leaves=len(folded))
        marks[group.vid] = group
        marks[vid].children = [c for c in marks[vid].children if c in set(keep)] + [group.vid]


def layout(marks: dict[int, VisualNode]) -> tuple[dict[int, tuple[int, float]], dict[int, tuple[int, int]]]:
    """networkx layout: depth in marks (x) and leaf order (y), plus each mark's leaf span.

    Children are ordered by their oldest member id, so a refresh adds new
    branches below the old ones instead of reshuffling the picture.
    """
    g = nx.DiGraph()
    g.add_node(0)
    oldest = {vid: min(m.member_ids, default=0) for vid, m in marks.items()}
    for vid, m in marks.items():
        for c in sorted(m.children, key=lambda c: oldest[c]):
            g.add_edge(vid, c)
    depth = nx.single_source_shortest_path_length(g, 0)
    pos: dict[int, tuple[int, float]] = {}
    span: dict[int, tuple[int, int]] = {}
    next_leaf = 0
    for vid in nx.dfs_postorder_nodes(g, 0):
        succ = list(g.successors(vid))
        if not succ:
            span[vid] = (next_leaf, next_leaf + 1)
            pos[vid] = (depth[vid], float(next_leaf))
            next_leaf += 1
        else:
            span[vid] = (span[succ[0]][0], span[succ[-1]][1])
            pos[vid] = (depth[vid], (pos[succ[0]][1] + pos[succ[-1]][1]) / 2)
    return pos, span


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
    head = (f"<b>{m.num_tokens:,} tokens</b> · {_fmt_bytes(m.num_bytes)} · prefix {m.start_tokens:,}–"
            f"{m.end_tokens:,}")
    lines = [head, f"hits {m.hits:,} · last used {_ago(m.last_access_s_ago)} · "
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


def _ago(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s ago"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


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
