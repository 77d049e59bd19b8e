"""Pure figure builders for the numbers: request metrics and engine stats in, plotly figures out.

Owns the look of every chart except the tree (``components.tree_figures``):
cached-vs-computed bars, the memory gauge, hit rate over time, prefill with
vs without reuse, speedup against cached tokens. No Gradio, no engine calls.
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from components.common import TOKEN_COLORS
from engine.types import EngineStats, RequestMetrics

CACHED_COLOR, COMPUTED_COLOR = TOKEN_COLORS["cached"], TOKEN_COLORS["computed"]
BASELINE_COLOR = "#94a3b8"
MiB = 2**20


def _figure(height: int, title: str = "", revision: str | None = None) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(height=height, margin=dict(l=50, r=16, t=40 if title else 12, b=40), plot_bgcolor="white",
                      paper_bgcolor="white", title=dict(text=title, x=0.01, font=dict(size=14)),
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1),
                      uirevision=revision or title, font=dict(size=11))
    fig.update_xaxes(gridcolor="#f1f5f9")
    fig.update_yaxes(gridcolor="#e2e8f0", zeroline=False)
    return fig


def _empty(fig: go.Figure, text: str) -> go.Figure:
    fig.add_annotation(text=text, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False,
                       font=dict(size=13, color="#64748b"))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def reuse_bars(cached: Sequence[int], computed: Sequence[int], labels: Sequence[str] | None = None,
               title: str = "Prompt tokens per request: cached vs computed", height: int = 300) -> go.Figure:
    """Stacked bars, one per request, in the order the requests ran."""
    fig = _figure(height, title)
    if not cached:
        return _empty(fig, "No requests yet")
    x = list(range(1, len(cached) + 1))
    hover = list(labels) if labels else None
    fig.add_trace(go.Bar(x=x, y=list(cached), name="served from cache", marker_color=CACHED_COLOR,
                         hovertext=hover, hovertemplate="request %{x}: %{y:,} cached<br>%{hovertext}<extra></extra>"
                         if hover else "request %{x}: %{y:,} cached<extra></extra>"))
    fig.add_trace(go.Bar(x=x, y=list(computed), name="computed", marker_color=COMPUTED_COLOR,
                         hovertemplate="request %{x}: %{y:,} computed<extra></extra>"))
    fig.update_layout(barmode="stack", bargap=0.25)
    fig.update_xaxes(title_text="request", dtick=1 if len(x) <= 20 else None)
    fig.update_yaxes(title_text="tokens")
    return fig


def memory_gauge(stats: EngineStats, height: int = 260) -> go.Figure:
    """Bytes of KV in use against the budget."""
    used, budget = stats.cache_bytes / MiB, max(stats.budget_bytes, 1) / MiB
    fig = go.Figure(go.Indicator(
        mode="gauge+number", value=used, number=dict(suffix=" MiB", valueformat=",.1f", font=dict(size=36)),
        title=dict(text=f"KV cache in use, of {budget:,.0f} MiB budget", font=dict(size=14)),
        gauge=dict(axis=dict(range=[0, budget]), bar=dict(color=CACHED_COLOR),
                   steps=[dict(range=[0, budget], color="#f1f5f9")],
                   threshold=dict(line=dict(color="#dc2626", width=3), thickness=0.8, value=budget))))
    fig.update_layout(height=height, margin=dict(l=30, r=30, t=50, b=10), paper_bgcolor="white",
                      uirevision="gauge")
    return fig


def hit_rate_figure(history: Sequence[RequestMetrics], height: int = 300) -> go.Figure:
    """Per-request share of prompt tokens served from the cache, the running token hit
    rate, and the cache's size after each request."""
    fig = _figure(height, "Hit rate over time")
    if not history:
        return _empty(fig, "No requests yet: send a chat message or a few-shot query")
    x = [m.request_id for m in history]
    share = [m.cached_tokens / m.prompt_tokens if m.prompt_tokens else 0 for m in history]
    running, cached, total = [], 0, 0
    for m in history:
        cached, total = cached + m.cached_tokens, total + m.prompt_tokens
        running.append(cached / total if total else 0)
    fig.add_trace(go.Bar(x=x, y=share, name="this request", marker_color="#bbf7d0",
                         customdata=[[m.cached_tokens, m.prompt_tokens, m.tag] for m in history],
                         hovertemplate="request %{x} (%{customdata[2]}): %{customdata[0]:,} of %{customdata[1]:,} "
                                       "tokens cached<extra></extra>"))
    fig.add_trace(go.Scatter(x=x, y=running, name="running token hit rate", mode="lines+markers",
                             line=dict(color="#15803d", width=3), hovertemplate="running: %{y:.0%}<extra></extra>"))
    fig.add_trace(go.Scatter(x=x, y=[m.cache_bytes / MiB for m in history], name="cache MiB", yaxis="y2",
                             mode="lines", line=dict(color="#64748b", dash="dot"),
                             hovertemplate="cache %{y:,.1f} MiB<extra></extra>"))
    fig.update_layout(yaxis=dict(title="tokens from cache", tickformat=".0%", range=[0, 1.05]),
                      yaxis2=dict(title="cache MiB", overlaying="y", side="right", showgrid=False, rangemode="tozero"),
                      xaxis=dict(title="request id", type="category", nticks=20), bargap=0.3)
    return fig


def latency_bars(history: Sequence[RequestMetrics], height: int = 340) -> go.Figure:
    """Prefill with reuse against without, for requests that measured both."""
    fig = _figure(height, "Prefill time per request: with reuse vs without (same request)")
    rows = [m for m in history if m.baseline_prefill_ms is not None]
    if not rows:
        return _empty(fig, "No request measured a baseline yet (tick “Measure prefill without reuse”)")
    x = [f"#{m.request_id} {m.tag}" for m in rows]
    info = [[m.cached_tokens, m.prompt_tokens, m.speedup or 0] for m in rows]
    tmpl = ("%{x}: %{y:,.0f} ms<br>%{customdata[0]:,} of %{customdata[1]:,} tokens cached · "
            "%{customdata[2]:.1f}× faster<extra>%{fullData.name}</extra>")
    fig.add_trace(go.Bar(x=x, y=[m.baseline_prefill_ms for m in rows], name="without reuse",
                         marker_color=BASELINE_COLOR, customdata=info, hovertemplate=tmpl))
    fig.add_trace(go.Bar(x=x, y=[m.prefill_ms for m in rows], name="with reuse", marker_color=CACHED_COLOR,
                         customdata=info, hovertemplate=tmpl))
    fig.update_layout(barmode="group", bargap=0.25, yaxis=dict(title="prefill ms"),
                      xaxis=dict(type="category", title="request"))
    return fig


def speedup_scatter(history: Sequence[RequestMetrics], height: int = 340) -> go.Figure:
    """Prefill speedup against the number of tokens served from the cache."""
    fig = _figure(height, "Speedup vs cached tokens")
    rows = [m for m in history if m.speedup is not None]
    if not rows:
        return _empty(fig, "Speedups appear once requests measure a baseline")
    fig.add_trace(go.Scatter(
        x=[m.cached_tokens for m in rows], y=[m.speedup for m in rows], mode="markers",
        marker=dict(size=11, color=[m.computed_tokens for m in rows], colorscale="Oranges", showscale=True,
                    line=dict(color="#334155", width=1), colorbar=dict(title="computed<br>tokens", thickness=10)),
        customdata=[[m.request_id, m.prompt_tokens, m.computed_tokens, m.prefill_ms, m.baseline_prefill_ms]
                    for m in rows],
        hovertemplate="request %{customdata[0]}: %{y:.1f}× faster<br>%{x:,} cached, %{customdata[2]:,} computed of "
                      "%{customdata[1]:,}<br>%{customdata[3]:,.0f} ms vs %{customdata[4]:,.0f} ms<extra></extra>"))
    fig.add_hline(y=1, line=dict(color="#94a3b8", dash="dash"), annotation_text="no gain",
                  annotation_position="bottom right")
    fig.update_layout(xaxis=dict(title="tokens served from cache", rangemode="tozero"),
                      yaxis=dict(title="speedup (×)", rangemode="tozero"))
    return fig
