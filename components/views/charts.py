"""Pure figure builders for the numbers: request metrics and engine stats in, plotly figures out.

Owns the look of every chart except the tree (``components.views.tree_figures``):
cached-vs-computed bars, the memory gauge, hit rate over time, prefill with
vs without reuse, speedup against cached tokens. No Gradio, no engine calls.
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from components.views.chart_style import BASELINE_COLOR, CACHED_COLOR, COMPUTED_COLOR, MiB, empty_figure, styled
from components.views.format import reuse_words
from engine.types import RequestMetrics
from engine.visibility import Audience, Figure, Unit, everyone

PRIVATE = Audience(public=False)  # the operator's own page: every figure exact

EMPTY_HEIGHT = 150  # an empty chart is a short line that says why, not a large blank frame


def _figure(height: int, title: str = "") -> go.Figure:
    return styled(go.Figure(), height, title)


def _empty(text: str, height: int, title: str) -> go.Figure:
    return empty_figure(text, min(height, EMPTY_HEIGHT), title)


def reuse_bars(cached: Sequence[int], computed: Sequence[int], labels: Sequence[str] | None = None,
               title: str = "Prompt tokens per request: cached vs computed", height: int = 300) -> go.Figure:
    """Stacked bars, one per request, in the order the requests ran."""
    if not cached:
        return _empty("No requests yet", height, title)
    fig = _figure(height, title)
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


def memory_gauge(used_kv: Figure, budget_kv: Figure, tree_kv: Figure | None = None, audience: Audience = PRIVATE,
                 height: int = 260) -> go.Figure:
    """Bytes of KV in use against the budget (declared figures: on a public page, ``audience``,
    everyone's KV shows in 256-token buckets and the tree's part not at all): the pool holds all
    of it, the tree's part (dark) and running requests' own (the bar's rest)."""
    everyone = audience.public
    used, budget = (audience.show(used_kv).value or 0) / MiB, max(audience.show(budget_kv).value or 0, 1) / MiB
    tree_bytes = audience.show(tree_kv).value if tree_kv is not None and not everyone else None
    tree = min(tree_bytes / MiB, used) if tree_bytes else 0.0
    steps = [dict(range=[0, budget], color="#f1f5f9")]
    if tree and not everyone:
        steps.append(dict(range=[0, tree], color="#bbf7d0"))
    running = f"<br><sup>tree {tree:,.1f} MiB · running requests {used - tree:,.1f} MiB</sup>" if not everyone else ""
    fig = go.Figure(go.Indicator(
        mode="gauge+number", value=used, number=dict(suffix=" MiB", valueformat=",.1f", font=dict(size=36)),
        title=dict(text=f"KV in use{' (everyone’s)' if everyone else ''}, of {budget:,.0f} MiB budget{running}",
                   font=dict(size=14)),
        gauge=dict(axis=dict(range=[0, budget]), bar=dict(color=CACHED_COLOR, thickness=0.35),
                   steps=steps,
                   threshold=dict(line=dict(color="#dc2626", width=3), thickness=0.8, value=budget))))
    fig.update_layout(height=height, margin=dict(l=30, r=30, t=60, b=10), paper_bgcolor="white",
                      uirevision="gauge")
    return fig


def hit_rate_figure(history: Sequence[RequestMetrics], height: int = 300, title: str = "",
                    audience: Audience = PRIVATE) -> go.Figure:
    """Per-request share of prompt tokens served from the cache, the running token hit
    rate, and the cache's size after each request: everyone's KV, so on a public deployment
    (``audience``) only in whole 256-token buckets (issue 58: the exact bytes between two of a
    visitor's requests counted everyone else's tokens)."""
    title = title or "Hit rate over time"
    if not history:
        return _empty("No requests yet: send a chat message or a few-shot query", height, title)
    fig = _figure(height, title)
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
    held = [audience.show(everyone(m.cache_bytes, Unit.BYTES)).value for m in history]
    coarse = " (everyone's, in 256-token steps)" if audience.public else ""
    fig.add_trace(go.Scatter(x=x, y=[b / MiB if b is not None else None for b in held], name=f"cache MiB{coarse}",
                             yaxis="y2", mode="lines", line=dict(color="#64748b", dash="dot"),
                             hovertemplate=f"cache {'at most ' if coarse else ''}%{{y:,.1f}} MiB<extra></extra>"))
    fig.update_layout(yaxis=dict(title="tokens from cache", tickformat=".0%", range=[0, 1.05]),
                      yaxis2=dict(title="cache MiB", overlaying="y", side="right", showgrid=False, rangemode="tozero"),
                      xaxis=dict(title="request id", type="category", nticks=20), bargap=0.3)
    return fig


def latency_bars(history: Sequence[RequestMetrics], height: int = 340) -> go.Figure:
    """Prefill with reuse against without, for requests that measured both."""
    title = "Prefill per request: with vs without reuse"
    rows = [m for m in history if m.baseline_prefill_ms is not None]
    if not rows:
        return _empty("No request measured a baseline yet: few-shot queries fill it (chat turns are timed on their card)", height,
                            title)
    fig = _figure(height, title)
    x = [f"#{m.request_id} {m.tag}" for m in rows]
    words = [reuse_words(m.cached_tokens, m.prompt_tokens, m.baseline_prefill_ms, m.prefill_ms) for m in rows]
    info = [[m.cached_tokens, m.prompt_tokens, w] for m, w in zip(rows, words, strict=True)]
    tmpl = ("%{x}: %{y:,.0f} ms<br>%{customdata[0]:,} of %{customdata[1]:,} tokens cached · "
            "with reuse: %{customdata[2]}<extra>%{fullData.name}</extra>")
    # Say why on bars where reuse did not help: nothing reused (noise) or measured slower.
    flags = ["" if w.endswith("faster") else w.replace("about the same speed", "same") for w in words]
    fig.add_trace(go.Bar(x=x, y=[m.baseline_prefill_ms for m in rows], name="without reuse",
                         marker_color=BASELINE_COLOR, customdata=info, hovertemplate=tmpl))
    fig.add_trace(go.Bar(x=x, y=[m.prefill_ms for m in rows], name="with reuse", marker_color=CACHED_COLOR,
                         customdata=info, hovertemplate=tmpl, text=flags, textposition="outside",
                         cliponaxis=False, textfont=dict(size=10, color="#b45309")))
    fig.update_layout(barmode="group", bargap=0.25, yaxis=dict(title="prefill ms"),
                      xaxis=dict(type="category", title="request"))
    return fig


def speedup_scatter(history: Sequence[RequestMetrics], height: int = 340) -> go.Figure:
    """Prefill speedup against the number of tokens served from the cache."""
    title = "Speedup vs cached tokens"
    rows = [m for m in history if m.speedup is not None]
    if not rows:
        return _empty("Speedups appear once requests measure a baseline", height, title)
    fig = _figure(height, title)
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


def _speedup_label(speedup: float) -> str:
    return f"{speedup:.0f}×" if speedup >= 10 else f"{speedup:.1f}×"


def growth_figure(points: Sequence, device: str = "", height: int = 340, note: str = "") -> go.Figure:
    """Prefill time with and without reuse against the cached length (``GrowthPoint``s of
    ``analysis.prefill_timing``), on a log-log scale so 256 and 4,096 tokens both read."""
    title = f"Prefill with and without reuse against cached length{f' ({device})' if device else ''}"
    if not points:
        return _empty(note or "Not measured yet", height, title)
    fig = _figure(height, title)
    x = [p.cached_tokens for p in points]
    reused = [p.cached_tokens if getattr(p, "reused_tokens", None) is None else p.reused_tokens for p in points]
    info = [[p.suffix_tokens, p.speedup, p.pairs, r] for p, r in zip(points, reused, strict=True)]
    tmpl = ("%{x:,} cached (%{customdata[3]:,} reused) + %{customdata[0]} new tokens: %{y:,.0f} ms<br>"
            "reuse %{customdata[1]:.1f}× faster (%{customdata[2]} pair(s))<extra>%{fullData.name}</extra>")
    fig.add_trace(go.Scatter(x=x, y=[p.full_ms for p in points], name="without reuse (every token computed)",
                             mode="lines+markers", line=dict(color=BASELINE_COLOR, width=3), customdata=info,
                             hovertemplate=tmpl))
    fig.add_trace(go.Scatter(x=x, y=[p.reuse_ms for p in points], name="with reuse (cached part copied)",
                             mode="lines+markers+text", line=dict(color=CACHED_COLOR, width=3), customdata=info,
                             hovertemplate=tmpl, text=[_speedup_label(p.speedup)
                                                       + (f" ({r:,} reused)" if r < p.cached_tokens else "")
                                                       for p, r in zip(points, reused, strict=True)],
                             textposition="bottom center", textfont=dict(size=11, color="#15803d")))
    fig.update_xaxes(title_text="tokens served from the cache", type="log", tickvals=x,
                     ticktext=[f"{v:,}" for v in x])
    fig.update_yaxes(title_text="prefill ms", type="log")
    return fig
