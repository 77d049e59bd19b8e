"""The one home for how charts look: the colours that mean "served from the cache",
"computed" and "no reuse", the house layout, and the empty-state figure.

Every figure builder (numbers, lab, tree) styles through ``styled`` and draws an
empty state with ``empty_figure``. Titles sit in the top margin and legends just
above the plot area (or below it for side-by-side panels), so on a phone a title
never lands on a legend. Pure plotly; no Gradio, no engine.
"""

from __future__ import annotations

import plotly.graph_objects as go

CACHED_COLOR, COMPUTED_COLOR = "#22c55e", "#f97316"
TOKEN_COLORS = {"cached": CACHED_COLOR, "computed": COMPUTED_COLOR}  # HighlightedText labels
BASELINE_COLOR = "#94a3b8"  # "without reuse" bars and reference lines
MUTED_TEXT = "#64748b"
MiB = 2**20


def styled(fig: go.Figure, height: int, title: str = "", legend_below: bool = False,
           revision: str | None = None, subtitle: str = "") -> go.Figure:
    """House look. ``legend_below`` for side-by-side subplots, whose titles sit where a
    legend would; ``subtitle`` is a smaller second line under the title; ``revision`` keeps
    the visitor's zoom across redraws of the same chart."""
    legend = (dict(orientation="h", yanchor="top", y=-0.22, xanchor="center", x=0.5) if legend_below else
              dict(orientation="h", yanchor="bottom", y=1.02, xanchor="left", x=0))
    top = (62 if title else 44) if not legend_below else (60 if title else 56)
    top += 18 if subtitle else 0
    fig.update_layout(height=height, margin=dict(l=56, r=20, t=top, b=90 if legend_below else 44),
                      plot_bgcolor="white", paper_bgcolor="white",
                      title=dict(text=title, x=0.01, xanchor="left", y=0.98, yanchor="top", yref="container",
                                 font=dict(size=14), subtitle=dict(text=subtitle, font=dict(size=11, color=MUTED_TEXT))),
                      legend=legend, font=dict(size=12), uirevision=revision or title or "chart")
    fig.update_xaxes(gridcolor="#f1f5f9")
    fig.update_yaxes(gridcolor="#e2e8f0", zeroline=False)
    return fig


def empty_figure(text: str, height: int = 260, title: str = "") -> go.Figure:
    """A blank chart that says why it is blank."""
    fig = styled(go.Figure(), height, title)
    fig.add_annotation(text=text, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False,
                       font=dict(size=13, color=MUTED_TEXT))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig
