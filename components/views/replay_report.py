"""The replay report, drawn: a ``ReplayReport`` in, plotly figures and HTML pieces out.

Owns the look of the replay report, for both of its readers: the command line
(``python -m tools.replay --report``, one self-contained HTML file with
plotly.js inlined, which opens offline) and the "Your traffic" tab (the same
figures as ``gr.Plot``, the same pieces as HTML). Reuses the tree view's icicle
(``components.views.tree_figures``) and the lab's granularity chart. Every piece of
log text is HTML-escaped here. No Gradio, no engine calls: plain data in.

Why here and not in ``engine/tools``: ``engine/`` never imports plotly (the
layering test), and one drawing module serves the CLI and the tab alike; the
CLI loads it lazily, only when a report is asked for.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

import plotly.graph_objects as go

from analysis.lab.granularity import GranularityResult
from analysis.replay.replay_stats import EXPECTED, MissExample, ReplayReport, percent, summary_text
from components.views.chart_style import TOKEN_COLORS
from components.views.lab.figures import empty_figure, granularity_figure
from components.views.tree_figures import tree_figure

# Every figure here is the viewer's own (a replay of the visitor's own log on a simulated cache): engine.visibility.
FIGURES_WHOSE = "own"

CACHED_COLOR, COMPUTED_COLOR = TOKEN_COLORS["cached"], TOKEN_COLORS["computed"]
EXPECTED_COLOR = "#94a3b8"
BASELINE_COLOR = "#64748b"


def _layout(fig: go.Figure, title: str, height: int = 320) -> go.Figure:
    fig.update_layout(height=height, margin=dict(l=60, r=20, t=56, b=48), plot_bgcolor="white",
                      paper_bgcolor="white", title=dict(text=title, x=0.01, font=dict(size=15)),
                      legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="right", x=1),
                      font=dict(size=12))
    fig.update_xaxes(gridcolor="#f1f5f9")
    fig.update_yaxes(gridcolor="#e2e8f0", zeroline=False)
    return fig


def _request_axis(fig: go.Figure, report: ReplayReport) -> None:
    k = report.series.per_bucket
    fig.update_xaxes(title_text="request (in replay order)" if k == 1 else
                     f"request (in replay order; each point: {k:,} requests)", tickformat=",d",
                     dtick=1 if len(report.series.count) <= 12 else None)


# ------------------------------------------------------------------ figures
def hit_rate_figure(report: ReplayReport, height: int = 300) -> go.Figure:
    s = report.series
    if not s.count:
        return empty_figure("No request replayed", height)
    x = s.first_request()
    running, c_sum, p_sum = [], 0, 0
    for c, p in zip(s.cached, s.prompt, strict=True):
        c_sum, p_sum = c_sum + c, p_sum + p
        running.append(c_sum / p_sum if p_sum else 0.0)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=[c / p if p else 0.0 for c, p in zip(s.cached, s.prompt, strict=True)],
                             mode="lines", name="this request" if s.per_bucket == 1 else "these requests",
                             line=dict(color="#bbf7d0", width=1), hovertemplate="request %{x:,}: %{y:.0%}<extra></extra>"))
    fig.add_trace(go.Scatter(x=x, y=running, mode="lines", name="over the log so far",
                             line=dict(color=CACHED_COLOR, width=3),
                             hovertemplate="first %{x:,} requests: %{y:.0%}<extra></extra>"))
    fig.update_yaxes(title_text="prompt tokens from cache", tickformat=".0%", range=[0, 1.02])
    _request_axis(fig, report)
    return _layout(fig, f"Token hit rate over the log: {report.hit_rate:.0%} overall", height)


def tokens_figure(report: ReplayReport, height: int = 320) -> go.Figure:
    s = report.series
    if not s.count:
        return empty_figure("No request replayed", height)
    x = s.first_request()
    cached = [c / n for c, n in zip(s.cached, s.count, strict=True)]
    computed = [(p - c) / n for p, c, n in zip(s.prompt, s.cached, s.count, strict=True)]
    per = "per request" if s.per_bucket == 1 else "mean per request"
    fig = go.Figure()
    fig.add_trace(go.Bar(x=x, y=cached, name="served from cache", marker_color=CACHED_COLOR,
                         hovertemplate="request %{x:,}: %{y:,.0f} cached<extra></extra>"))
    fig.add_trace(go.Bar(x=x, y=computed, name="computed", marker_color=COMPUTED_COLOR,
                         hovertemplate="request %{x:,}: %{y:,.0f} computed<extra></extra>"))
    fig.update_layout(barmode="stack", bargap=0.05 if len(x) <= 200 else 0)
    fig.update_traces(marker_line_width=0 if len(x) > 200 else 0.5)
    fig.update_yaxes(title_text=f"prompt tokens ({per})")
    _request_axis(fig, report)
    return _layout(fig, "Cached vs computed tokens per request", height)


def prefill_figure(report: ReplayReport, height: int = 300) -> go.Figure | None:
    """Measured prefill with reuse, and without where ``--baseline`` measured it; None in a simulation."""
    s = report.series
    if report.mode != "measured" or not s.count:
        return None
    x = s.first_request()
    fig = go.Figure()
    if report.baseline_prefill_ms:
        fig.add_trace(go.Scatter(x=x, y=[b / n if n else None for b, n in zip(s.baseline_ms, s.baseline_count,
                                                                              strict=True)],
                                 mode="lines+markers", name="without reuse (measured)",
                                 line=dict(color=BASELINE_COLOR)))
    fig.add_trace(go.Scatter(x=x, y=[p / n for p, n in zip(s.prefill_ms, s.count, strict=True)],
                             mode="lines+markers", name="with the radix cache (measured)",
                             line=dict(color=CACHED_COLOR, width=3)))
    fig.update_yaxes(title_text="prefill (ms)", rangemode="tozero")
    _request_axis(fig, report)
    title = "Prefill time per request (measured)"
    if report.baseline_prefill_ms and report.reuse_prefill_ms_measured:
        title += (f": {report.reuse_prefill_ms_measured / 1000:,.1f} s with reuse vs "
                  f"{report.baseline_prefill_ms / 1000:,.1f} s without")
    return _layout(fig, title, height)


def causes_figure(report: ReplayReport, height: int = 300) -> go.Figure:
    causes = [c for c in report.causes if c.computed_tokens > 0]
    if not causes:
        return empty_figure("No computed tokens to explain", height)
    causes = causes[::-1]
    fig = go.Figure(go.Bar(
        y=[c.label for c in causes], x=[c.share_of_computed for c in causes], orientation="h",
        marker_color=[EXPECTED_COLOR if c.kind in EXPECTED else COMPUTED_COLOR for c in causes],
        text=[f"{c.share_of_computed:.0%} · {c.computed_tokens:,} tokens · {c.requests:,} req" for c in causes],
        textposition="auto", hovertemplate="%{y}<br>%{x:.1%} of computed tokens<extra></extra>"))
    fig.update_xaxes(title_text="share of computed prompt tokens", tickformat=".0%", rangemode="tozero")
    fig.update_yaxes(automargin=True)
    return _layout(fig, "Why tokens were computed (orange: avoidable; grey: expected)", max(height, 60 + 44 * len(causes)))


def granularity_chart(report: ReplayReport, height: int = 300) -> go.Figure:
    rows = [GranularityResult(b, (cached,), (report.prompt_tokens,)) for b, cached in sorted(report.granularity.items())]
    return granularity_figure([("this log", rows)], height)


def icicle_figure(report: ReplayReport, height: int = 460) -> go.Figure:
    if report.tree is None or not report.tree.nodes:
        return empty_figure("The cache is empty at the end of the log", height)
    return tree_figure(report.tree, color_by="hits", view="icicle", height=height)


def report_figures(report: ReplayReport) -> dict[str, go.Figure]:
    """Every figure of the report, in reading order."""
    figs = {"hit_rate": hit_rate_figure(report), "tokens": tokens_figure(report)}
    prefill = prefill_figure(report)
    if prefill is not None:
        figs["prefill"] = prefill
    figs.update(causes=causes_figure(report), tree=icicle_figure(report), granularity=granularity_chart(report))
    return figs


# ------------------------------------------------------------------ HTML pieces
def _e(text: str) -> str:
    return html.escape(text, quote=True)


def _tokens(pieces: Sequence[str], cls: str) -> str:
    out = []
    for p in pieces:
        shown = p.replace("\n", "↵\n").replace("\t", "→\t") if p else "·"
        out.append(f'<span class="tok {cls}">{_e(shown)}</span>')
    return "".join(out)


def example_html(e: MissExample) -> str:
    held = "cached earlier, then evicted" if e.kind in ("evicted", "expired") else "the cache held instead"
    cached_row = (f'<div class="row"><span class="lab">{held}</span>'
                  f'<span class="toks">{_tokens(e.cached_after_pieces, "held")}</span></div>'
                  if e.cached_after_pieces else "")
    return (f'<div class="example"><div class="ehead">log line {e.line:,} (request {e.request:,}): '
            f'{e.cached_tokens:,} of {e.prompt_tokens:,} tokens from cache, <b>{e.computed_tokens:,} computed</b>'
            f'</div><div class="reason">{_e(e.reason)}</div>'
            f'<div class="row"><span class="lab">this request</span><span class="toks">'
            f'{_tokens(e.before_pieces, "cached")}{_tokens(e.after_pieces, "computed")}</span></div>'
            f'{cached_row}</div>')


def causes_html(report: ReplayReport) -> str:
    if not report.causes:
        return "<p>No request was replayed.</p>"
    rows = "".join(
        f"<tr><td>{_e(c.label)}</td><td>{c.share_of_computed:.0%}</td><td>{c.computed_tokens:,}</td>"
        f"<td>{c.requests:,}</td><td>{_e(c.advice) if c.advice else '–'}</td></tr>" for c in report.causes)
    parts = ['<table><tr><th>cause</th><th>share of computed tokens</th><th>computed tokens</th><th>requests</th>'
             f'<th>what to do</th></tr>{rows}</table>',
             '<p class="note">Each request is compared with what the cache held before it (the miss explainer of '
             'the ordering lab). Tokens shown one by one: <span class="tok cached">from cache</span> '
             '<span class="tok computed">computed</span> <span class="tok held">what the cache held there</span>.</p>']
    for c in report.causes:
        if c.examples and c.kind != "full-hit":
            parts.append(f"<h3>{_e(c.label)}: the {len(c.examples)} worst</h3>")
            parts.extend(example_html(e) for e in c.examples)
    return "\n".join(parts)


def templates_html(report: ReplayReport) -> str:
    if not report.templates:
        return ('<p class="note">No template could be inferred: no two single-turn prompts of the same shape '
                'share enough text.</p>')
    parts = []
    for t in report.templates:
        lint, inf = t.lint, t.inferred
        parts.append(f"<h3>Prompts “{_e(t.shape)}…” ({t.requests_seen:,} requests; the template fits "
                     f"{inf.matched} of {inf.samples} sampled)</h3>")
        parts.append(f"<pre>{_e(_clip(inf.template))}</pre>")
        if lint.warnings:
            parts.append("<ul>" + "".join(f"<li>⚠️ {_e(w.message)}</li>" for w in lint.warnings) + "</ul>")
        else:
            parts.append("<p>✅ No per-request part comes before static text.</p>")
        share = f"Estimated reusable share of each prompt: <b>{lint.reusable_share:.0%}</b>"
        if lint.reusable_share_suggested is not None:
            share += f"; with the suggested order: <b>{lint.reusable_share_suggested:.0%}</b>"
        parts.append(f"<p>{share}.</p>")
        if lint.suggested_template:
            parts.append(f"<p>Suggested template (per-request lines moved last):</p>"
                         f"<pre>{_e(_clip(lint.suggested_template))}</pre>")
        example = next(iter(inf.values), {})
        if example:
            parts.append('<p class="note">Values of one request: ' + ", ".join(
                f"<code>{{{_e(k)}}}</code> = “{_e(_clip(v, 80))}”" for k, v in example.items()) + "</p>")
    return "\n".join(parts)


def cost_html(report: ReplayReport) -> str:
    c, r = report.cost, report.pricing
    if not c.requests:
        return "<p>No request was replayed.</p>"
    note = ""
    if c.billed_cached_tokens == 0:
        note = (f'<p class="note">No cached prefix reached the {r.min_cacheable_tokens:,}-token minimum, so '
                "nothing would be billed at the cached price.</p>")
    return (f'<p class="note"><b>An estimate, not a bill</b>: input at ${r.input_usd_per_mtok:,.2f} per million '
            f"tokens; cached input at {r.cached_fraction:.0%} of that once a cached prefix reaches "
            f"{r.min_cacheable_tokens:,} tokens, counted in {r.increment_tokens:,}-token steps (OpenAI's documented "
            "rules; check your provider's current pricing). Output tokens not included.</p>"
            "<table><tr><th>requests</th><th>prompt tokens</th><th>billed as cached</th><th>without caching</th>"
            f"<th>with caching</th><th>saving</th></tr><tr><td>{c.requests:,}</td><td>{c.prompt_tokens:,}</td>"
            f"<td>{c.billed_cached_tokens:,} ({c.billed_cached_tokens / max(1, c.prompt_tokens):.0%})</td>"
            f"<td>${c.usd_without_caching:,.4f}</td><td>${c.usd_with_caching:,.4f}</td>"
            f"<td>{percent(c.saving_share)}</td></tr></table>{note}")


def granularity_html(report: ReplayReport) -> str:
    g, p = report.granularity, max(1, report.prompt_tokens)
    cells = "".join(f"<td>{g[b]:,} ({g[b] / p:.0%})</td>" for b in sorted(g))
    heads = "".join(f"<th>{'per token' if b == 1 else f'{b}-token blocks'}</th>" for b in sorted(g))
    return (f"<table><tr>{heads}</tr><tr>{cells}</tr></table><p class=\"note\">Paged engines (vLLM) cache and "
            "match whole blocks only: a request reuses its cached prefix rounded down to a block. Exact when nothing "
            "was evicted; an estimate otherwise.</p>")


def skipped_html(report: ReplayReport) -> str:
    if not report.skipped_count:
        return "<p>No line was skipped.</p>"
    rows = "".join(f"<tr><td>{s.line:,}</td><td>{_e(s.reason)}</td></tr>" for s in report.skipped)
    more = (f"<p class=\"note\">… and {report.skipped_count - len(report.skipped):,} more.</p>"
            if report.skipped_count > len(report.skipped) else "")
    return f"<p>{report.skipped_count:,} lines skipped:</p><table><tr><th>line</th><th>why</th></tr>{rows}</table>{more}"


def headline_html(report: ReplayReport) -> str:
    label = ("SIMULATION: tokenizer and radix tree, no model; hits, tokens and cost, no timings"
             if report.mode == "simulation" else "MEASURED on the real model")
    cards = [(f"{report.hit_rate:.0%}", "prompt tokens from cache"),
             (f"{report.requests:,}", "requests replayed"),
             (f"{report.computed_tokens:,}", "prompt tokens computed"),
             (f"{report.evicted_tokens + report.expired_tokens:,}", "tokens evicted or expired")]
    if report.has_tier:
        cards.insert(1, (f"{report.tier_tokens:,}", f"of them from the {report.tier_budget_bytes / 2**20:,.0f} MiB "
                                                    "second tier"))
    if report.cost.usd_without_caching:
        cards.append((percent(report.cost.saving_share), "hosted-API input saving (estimate)"))
    grid = "".join(f'<div class="card"><div class="val">{v}</div><div class="lab">{_e(t)}</div></div>'
                   for v, t in cards)
    notes = "".join(f"<li>{_e(n)}</li>" for n in report.notes)
    return (f'<div class="badge {report.mode}">{_e(label)}</div><p class="summary">{_e(summary_text(report))}</p>'
            f'<div class="cards">{grid}</div><ul class="notes">{notes}</ul>')


def _clip(text: str, limit: int = 3000) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


# ------------------------------------------------------------------ the page
PAGE_CSS = """
body {font-family: system-ui, -apple-system, Segoe UI, sans-serif; max-width: 1200px; margin: 24px auto;
      padding: 0 16px; color: #0f172a}
h1 {font-size: 1.6rem; margin-bottom: 4px} h2 {margin-top: 32px; border-bottom: 1px solid #e2e8f0}
"""
# The pieces' look, scoped to ``.replay-report`` so that the tab can inline it without touching the page.
PIECE_CSS = """
.replay-report .summary {font-size: 1.15rem; line-height: 1.5}
.replay-report .badge {display: inline-block; padding: 3px 10px; border-radius: 6px; font-weight: 600;
  font-size: .85rem}
.replay-report .badge.simulation {background: #eff6ff; color: #1d4ed8}
.replay-report .badge.measured {background: #f0fdf4; color: #15803d}
.replay-report .cards {display: grid; grid-template-columns: repeat(auto-fit, minmax(170px, 1fr)); gap: 10px;
  margin: 12px 0}
.replay-report .card {border: 1px solid #e2e8f0; border-radius: 10px; padding: 8px 12px; background: #f8fafc}
.replay-report .card .val {font-size: 1.6rem; font-weight: 700} .replay-report .card .lab {font-size: .8rem;
  color: #475569}
.replay-report .notes, .replay-report .note {color: #475569; font-size: .9rem}
.replay-report table {border-collapse: collapse; margin: 8px 0}
.replay-report td, .replay-report th {border: 1px solid #e2e8f0; padding: 4px 8px; text-align: left;
  font-size: .9rem; vertical-align: top}
.replay-report pre {background: #f8fafc; border: 1px solid #e2e8f0; padding: 8px; white-space: pre-wrap;
  max-height: 260px; overflow: auto; font-size: .82rem}
.replay-report .example {border: 1px solid #e2e8f0; border-radius: 8px; padding: 8px; margin: 8px 0}
.replay-report .ehead {font-weight: 600}
.replay-report .reason {color: #334155; margin: 4px 0 6px; font-size: .9rem}
.replay-report .row {display: flex; gap: 8px; margin: 3px 0}
.replay-report .row .lab {flex: 0 0 150px; color: #64748b; font-size: .8rem}
.replay-report .toks {font-family: ui-monospace, monospace; font-size: .8rem; white-space: pre-wrap;
  line-height: 1.9}
.replay-report .tok {border: 1px solid #cbd5e1; border-radius: 3px; margin-right: 1px; padding: 0 1px}
.replay-report .tok.cached {background: #dcfce7; border-color: #86efac}
.replay-report .tok.computed {background: #ffedd5; border-color: #fdba74}
.replay-report .tok.held {background: #f1f5f9}
"""


def scoped(piece_html: str) -> str:
    """An HTML piece with its look, for a page that does not carry the report's CSS (the tab)."""
    return f'<div class="replay-report"><style>{PIECE_CSS}</style>{piece_html}</div>'



def report_html(report: ReplayReport) -> str:
    """One self-contained page: plotly.js inlined once, so it opens offline."""
    figs = report_figures(report)
    first = True

    def fig_html(key: str) -> str:
        nonlocal first
        if key not in figs:
            return ""
        out = figs[key].to_html(full_html=False, include_plotlyjs=first, config={"displaylogo": False})
        first = False
        return out

    title = f"Prefix-caching report: {report.log_name or 'log'}"
    body = [f"<h1>{_e(title)}</h1>", headline_html(report),
            "<h2>Hit rate over the log</h2>", fig_html("hit_rate"), fig_html("tokens"), fig_html("prefill"),
            "<h2>Why tokens were computed</h2>", fig_html("causes"), causes_html(report),
            "<h2>Template suggestions</h2>", templates_html(report),
            "<h2>The tree the log leaves behind</h2>",
            '<p class="note">Icicle view of the cache at the end of the log: x is the prefix length in tokens, '
            "each bar a node, colour by hits.</p>", fig_html("tree"),
            "<h2>Block granularity</h2>", fig_html("granularity"), granularity_html(report),
            "<h2>Hosted-API cost</h2>", cost_html(report),
            "<h2>Skipped lines</h2>", skipped_html(report)]
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f"<style>{PAGE_CSS}{PIECE_CSS}</style></head><body><div class=\"replay-report\">{''.join(body)}"
            "</div></body></html>")


def write_html(report: ReplayReport, path: Path) -> None:
    Path(path).write_text(report_html(report), encoding="utf-8")
