"""Pure figure builders for the prompt-ordering lab: lab results in, plotly figures out.

Owns the look of the lab's charts: total prefill per ordering (with and without
reuse), cached vs computed tokens per request, the tree each ordering left
behind (drawn along the prefix-length axis), the request-order comparison and
the block-granularity simulation. No Gradio, no engine calls: every function
takes plain data (the engine's result dataclasses) and returns a figure.
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from analysis.lab.granularity import GranularityResult
from analysis.lab.ordering_runs import VariantResult
from analysis.lab.request_order_demo import POLICY_NAMES, ScheduleResult
from components.views.chart_style import BASELINE_COLOR, CACHED_COLOR, COMPUTED_COLOR, empty_figure, styled
from components.views.format import fmt_ms
from components.views.lab.markdown import comparison, short_name
from engine.types import NodeInfo

# Every figure here is the viewer's own (the lab's runs: the visitor's own prompts in their own namespaces, and the request-order demo's dedicated engine): engine.visibility.
FIGURES_WHOSE = "own"

__all__ = ["empty_figure", "granularity_figure", "per_request_figure", "prefill_summary_figure", "schedule_figure",
           "trees_figure"]
SHARED_COLOR, PRIVATE_COLOR = "#16a34a", "#fb923c"
BLOCK_COLORS = {1: "#16a34a", 16: "#2563eb", 64: "#7c3aed"}


def _layout(fig: go.Figure, height: int, title: str, legend_below: bool = False) -> go.Figure:
    return styled(fig, height, title, legend_below=legend_below)


def prefill_summary_figure(results: Sequence[VariantResult], height: int = 300) -> go.Figure:
    """Total prefill time per ordering: with reuse (measured) and without reuse
    (the same prompts prefilled from scratch, measured), one row per ordering."""
    if not results or not any(r.requests for r in results):
        return empty_figure("Click a preset to run it", height)
    names = [short_name(r.name) for r in results][::-1]  # short: the full names are in the table
    rows = list(results)[::-1]
    fig = go.Figure()
    if all(r.baseline_total_ms is not None for r in rows):
        fig.add_trace(go.Bar(y=names, x=[r.baseline_total_ms for r in rows], orientation="h",
                             name="without reuse (measured)", marker_color=BASELINE_COLOR,
                             text=[fmt_ms(r.baseline_total_ms) for r in rows], textposition="auto",
                             hovertemplate="%{y}<br>no reuse: %{x:,.0f} ms<extra></extra>"))
    fig.add_trace(go.Bar(y=names, x=[r.total_prefill_ms for r in rows], orientation="h",
                         name="with the radix cache", marker_color=[_variant_color(r, results) for r in rows],
                         text=[f"{fmt_ms(r.total_prefill_ms)} · {r.hit_rate:.0%} cached" for r in rows],
                         textposition="auto",
                         hovertemplate="%{y}<br>with reuse: %{x:,.0f} ms<extra></extra>"))
    fig.update_layout(barmode="group", bargap=0.3)
    fig.update_xaxes(title_text="total prefill time of all requests (ms)")
    found = comparison(results)
    phrase = (f"prefill at {found.words}" if found.words.startswith("about") else f"{found.words} prefill") \
        if found else ""
    title = f"{found.subject}: {phrase}" if found else "Total prefill time"
    subtitle = (f"{fmt_ms(found.subject_ms)} vs {fmt_ms(found.reference_ms)}: total prefill with the radix cache"
                if found else "")
    return styled(fig, height, title, subtitle=subtitle)


def _variant_color(r: VariantResult, results: Sequence[VariantResult]) -> str:
    best = max(results, key=lambda x: x.hit_rate)
    return CACHED_COLOR if r is best else COMPUTED_COLOR


def per_request_figure(results: Sequence[VariantResult], height: int = 360) -> go.Figure:
    """One panel per ordering: stacked bars of cached and computed tokens per request."""
    if not results:
        return empty_figure("Per-request tokens appear here", height)
    fig = make_subplots(rows=1, cols=len(results), shared_yaxes=True, horizontal_spacing=0.04,
                        subplot_titles=[f"{short_name(r.name)}<br><sup>{r.hit_rate:.0%} cached</sup>"
                                        for r in results])
    for col, r in enumerate(results, start=1):
        x = [req.label for req in r.requests]
        fig.add_trace(go.Bar(x=x, y=[q.cached_tokens for q in r.requests], name="served from cache",
                             marker_color=CACHED_COLOR, showlegend=col == 1, legendgroup="cached",
                             customdata=[q.prefill_ms for q in r.requests],
                             hovertemplate="%{x}: %{y:,} cached<br>prefill %{customdata:,.0f} ms<extra></extra>"),
                      row=1, col=col)
        fig.add_trace(go.Bar(x=x, y=[q.computed_tokens for q in r.requests], name="computed",
                             marker_color=COMPUTED_COLOR, showlegend=col == 1, legendgroup="computed",
                             hovertemplate="%{x}: %{y:,} computed<extra></extra>"), row=1, col=col)
    fig.update_layout(barmode="stack", bargap=0.25)
    fig.update_yaxes(title_text="prompt tokens", row=1, col=1)
    for ann in fig.layout.annotations:
        ann.font.size = 13
    return _layout(fig, height, "", legend_below=True)


def tree_rows(nodes: Sequence[NodeInfo]) -> dict[int, tuple[float, int]]:
    """Row (y) and number of leaves below, per node: leaves get rows 0, 1, 2 ... in
    depth-first order, a parent sits at the mean row of its children."""
    children: dict[int, list[NodeInfo]] = {}
    for n in nodes:
        children.setdefault(n.parent_id, []).append(n)
    out: dict[int, tuple[float, int]] = {}
    next_row = 0

    def visit(node: NodeInfo) -> tuple[float, int]:
        nonlocal next_row
        kids = sorted(children.get(node.node_id, []), key=lambda c: c.node_id)
        if not kids:
            out[node.node_id] = (float(next_row), 1)
            next_row += 1
            return out[node.node_id]
        placed = [visit(k) for k in kids]
        out[node.node_id] = (sum(p[0] for p in placed) / len(placed), sum(p[1] for p in placed))
        return out[node.node_id]

    ids = {n.node_id for n in nodes}
    for root in sorted((n for n in nodes if n.parent_id not in ids), key=lambda n: n.node_id):
        visit(root)
    return out


def reuse_counts(r: VariantResult) -> dict[int, int]:
    """Per node of the tree an ordering left behind: how many of its requests were served
    that node's tokens from the cache (the node's whole prefix was part of their cached prefix)."""
    by_id = {n.node_id: n for n in r.tree}
    paths: dict[int, tuple[int, ...]] = {}

    def path(n: NodeInfo) -> tuple[int, ...]:
        if n.node_id not in paths:
            parent = by_id.get(n.parent_id)
            paths[n.node_id] = (path(parent) if parent is not None else ()) + tuple(n.token_ids)
        return paths[n.node_id]

    out = {}
    for n in r.tree:
        p = path(n)
        out[n.node_id] = sum(1 for q in r.requests if q.cached_tokens >= len(p) and q.prompt_ids[:len(p)] == p)
    return out


def trees_figure(results: Sequence[VariantResult], height: int = 380) -> go.Figure:
    """The tree each ordering left behind, along the prefix-length axis: each node is a
    bar from the token where it starts to the token where it ends. Green: served from
    the cache to later requests; orange: computed and never reused."""
    if not results:
        return empty_figure("The trees each ordering leaves behind appear here", height)
    fig = make_subplots(rows=1, cols=len(results), horizontal_spacing=0.05,
                        subplot_titles=[f"{short_name(r.name)}<br><sup>{len(r.tree)} nodes, "
                                        f"{sum(n.num_tokens for n in r.tree):,} tokens</sup>" for r in results])
    for col, r in enumerate(results, start=1):
        rows = tree_rows(r.tree)
        reused = reuse_counts(r)
        by_id = {n.node_id: n for n in r.tree}
        for shared in (True, False):
            picked = [n for n in r.tree if (reused[n.node_id] > 0) == shared]
            if not picked:
                continue
            fig.add_trace(go.Bar(
                y=[rows[n.node_id][0] for n in picked], x=[n.num_tokens for n in picked],
                base=[n.depth_tokens - n.num_tokens for n in picked], orientation="h", width=0.6,
                marker_color=SHARED_COLOR if shared else PRIVATE_COLOR, legendgroup=str(shared),
                name="served from the cache to later requests" if shared else "computed, never reused",
                showlegend=col == 1, hovertext=[_node_hover(n, reused[n.node_id]) for n in picked],
                hoverinfo="text"), row=1, col=col)
        xs, ys = [], []
        for n in r.tree:  # elbow connectors from a parent's end to its child's start
            parent = by_id.get(n.parent_id)
            if parent is not None:
                x = parent.depth_tokens
                xs += [x, x, None]
                ys += [rows[parent.node_id][0], rows[n.node_id][0], None]
        if xs:
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line=dict(color="#94a3b8", width=1),
                                     hoverinfo="skip", showlegend=False), row=1, col=col)
        fig.update_yaxes(visible=False, row=1, col=col)
        fig.update_xaxes(title_text="prefix (tokens)", rangemode="tozero", row=1, col=col)
    fig.update_layout(barmode="overlay")
    for ann in fig.layout.annotations:
        ann.font.size = 13
    return _layout(fig, height, "", legend_below=True)


def _node_hover(n: NodeInfo, reused_by: int) -> str:
    text = n.text if not n.hidden else "(hidden)"
    text = text.replace("<", "‹").replace(">", "›")
    if len(text) > 240:
        text = text[:239] + "…"
    wrapped = "<br>".join(text[i:i + 70] for i in range(0, len(text), 70)) or "–"
    return (f"<b>tokens {n.depth_tokens - n.num_tokens:,}–{n.depth_tokens:,}</b> ({n.num_tokens:,} tokens)<br>"
            f"served from the cache to {reused_by} request{'s' if reused_by != 1 else ''}<br>{wrapped}")


def schedule_figure(results: Sequence[ScheduleResult], height: int = 340) -> go.Figure:
    """One panel per policy: cached vs computed tokens per request, in the order they ran."""
    if not results:
        return empty_figure("Run the queue to compare the two orders", height)
    titles = [f"{POLICY_NAMES.get(r.policy, r.policy)}<br><sup>{r.hit_rate:.0%} cached · "
              f"{fmt_ms(r.total_prefill_ms)} prefill · {r.evicted_tokens:,} tokens evicted</sup>" for r in results]
    fig = make_subplots(rows=1, cols=len(results), shared_yaxes=True, horizontal_spacing=0.04,
                        subplot_titles=titles)
    for col, r in enumerate(results, start=1):
        x = [f"{i + 1}. {q.label}" for i, q in enumerate(r.requests)]
        fig.add_trace(go.Bar(x=x, y=[q.cached_tokens for q in r.requests], name="served from cache",
                             marker_color=CACHED_COLOR, showlegend=col == 1, legendgroup="c"), row=1, col=col)
        fig.add_trace(go.Bar(x=x, y=[q.computed_tokens for q in r.requests], name="computed",
                             marker_color=COMPUTED_COLOR, showlegend=col == 1, legendgroup="p"), row=1, col=col)
        fig.update_xaxes(title_text="run order · request", tickangle=-45, row=1, col=col)
    fig.update_layout(barmode="stack", bargap=0.2)
    fig.update_yaxes(title_text="prompt tokens", row=1, col=1)
    for ann in fig.layout.annotations:
        ann.font.size = 13
    return _layout(fig, height + 40, "", legend_below=True)


def granularity_figure(rows: Sequence[tuple[str, Sequence[GranularityResult]]], height: int = 320) -> go.Figure:
    """Cached tokens per ordering when matching per token and in blocks (a simulation)."""
    if not rows:
        return empty_figure("Run a preset: its token ids are replayed here at block sizes 1, 16 and 64", height)
    fig = go.Figure()
    sizes = sorted({g.block_size for _, gs in rows for g in gs})
    names = [name for name, _ in rows]
    for size in sizes:
        vals = [next((g for g in gs if g.block_size == size), None) for _, gs in rows]
        per_token = [next((g for g in gs if g.block_size == 1), None) for _, gs in rows]
        lost = [(t.cached_tokens - v.cached_tokens) if (t and v) else 0 for t, v in zip(per_token, vals, strict=True)]
        fig.add_trace(go.Bar(x=names, y=[v.cached_tokens if v else 0 for v in vals],
                             name="per token" if size == 1 else f"{size}-token blocks",
                             marker_color=BLOCK_COLORS.get(size, "#64748b"),
                             text=[f"{v.hit_rate:.0%}" + (f"<br>−{lo:,}" if lo else "") if v else ""
                                   for v, lo in zip(vals, lost, strict=True)],
                             textposition="outside", cliponaxis=False,
                             hovertemplate="%{x}<br>%{y:,} tokens cached<extra>" +
                                           ("per token" if size == 1 else f"{size}-token blocks") + "</extra>"))
    fig.update_layout(barmode="group", bargap=0.25)
    top = max((g.cached_tokens for _, gs in rows for g in gs), default=0)
    fig.update_yaxes(title_text="cached prompt tokens (simulated)", range=[0, max(1, top) * 1.25])  # room for labels
    return _layout(fig, height, "Simulation: block matching over this run's real token ids")
