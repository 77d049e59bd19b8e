"""The "Your traffic" tab: paste a JSONL prompt log, get the simulated replay report inline.

Owns the tab's layout, its size limits and its one handler. The work is the
command line's ``--simulate`` (``analysis.replay.simulate.simulate_lines``) on the
app's tokenizer, with a radix tree built for this one call: a visitor's log
touches no shared cache, is kept nowhere after the reply, and no file is
uploaded (the text box is the only input). The figures and HTML pieces are the
HTML report's (``components.views.replay_report``).
"""

from __future__ import annotations

import json

import gradio as gr

from analysis.replay.log_formats import LogLineError, parse_ttl
from analysis.replay.replay_stats import ReplayReport
from analysis.replay.simulate import ModelGeometry, simulate_lines
from analysis.replay.synthetic_log import generate
from components.panels.common import warn
from components.views.replay_report import (
    causes_html,
    cost_html,
    granularity_html,
    headline_html,
    report_figures,
    scoped,
    skipped_html,
    templates_html,
)
from engine.api import EngineAPI, FiguresAPI
from engine.types import EngineError

MAX_CHARS = 200_000
MAX_LINES = 500
TTL_CHOICES = ["none", "5m", "1h"]
FIGURES = ("hit_rate", "tokens", "causes", "tree", "granularity")
INTRO = (
    "Paste your own prompt log, one JSON object per line: `{\"messages\": [...]}`, `{\"prompt\": \"...\"}`, OpenAI "
    "Batch API lines or ShareGPT `{\"conversations\": [...]}`, with an optional `timestamp`. The log is **simulated** "
    "here with this model's tokenizer and a radix tree built for you alone (no model runs, so no timings), and "
    f"is kept nowhere. Up to {MAX_LINES} lines and {MAX_CHARS // 1000} KB; for more, run "
    "`python -m tools.replay LOG --simulate --report report.html` on your machine."
)


def example_log(requests: int = 24) -> str:
    """A small generated log (labelled as such) to try the tab with."""
    return "\n".join(json.dumps(item) for item in generate(requests, seed=7))


def check_pasted(text: object) -> str:
    if not isinstance(text, str) or not text.strip():
        raise EngineError("Paste a log first: one JSON object per line.")
    if len(text) > MAX_CHARS:
        raise EngineError(f"The log is {len(text):,} characters long; the limit here is {MAX_CHARS:,}. Run the "
                          "command line on your machine for bigger logs.")
    lines = text.count("\n") + 1
    if lines > MAX_LINES:
        raise EngineError(f"The log has {lines:,} lines; the limit here is {MAX_LINES:,}.")
    return text


def _default_budget_mib(engine: FiguresAPI) -> float:
    """The app's own cache budget (a remote server's is unknown: 1 GiB then)."""
    return (engine.stats().budget_bytes or 2**30) / 2**20


def simulate_pasted(engine: EngineAPI, text: object, ttl: object, budget_mb: object) -> ReplayReport:
    """The simulated report of a pasted log, on a cache of its own. Raises EngineError."""
    text = check_pasted(text)
    ttl_s = None if str(ttl) in ("", "none", "None") else parse_ttl(str(ttl)) if str(ttl) in TTL_CHOICES else None
    info = engine.info()
    try:
        mb = float(budget_mb)
    except (TypeError, ValueError):
        mb = _default_budget_mib(engine)
    mb = min(max(mb, 1.0), 4096.0) if mb == mb else 64.0  # NaN -> a small default
    geometry = ModelGeometry(info.model_name, info.kv_bytes_per_token, info.max_context, info.dtype)
    # A remote server's KV size is unknown here: then the simulated cache has no budget (said in the report).
    budget_tokens = int(mb * 2**20) // info.kv_bytes_per_token if info.kv_bytes_per_token else None
    try:
        return simulate_lines(text.splitlines(), engine.tokenizer, geometry, budget_tokens, ttl_s,
                              log_name="pasted log")
    except LogLineError as exc:
        raise EngineError(str(exc)) from None


def build_replay_panel(engine: EngineAPI) -> None:
    gr.Markdown(INTRO)
    with gr.Row():
        with gr.Column(scale=3):
            log = gr.Textbox(label="JSONL log", lines=10, max_lines=18, max_length=MAX_CHARS,
                             placeholder='{"messages": [{"role": "system", "content": "..."}, '
                                         '{"role": "user", "content": "..."}], "timestamp": "2026-01-01T10:00:00Z"}')
        with gr.Column(scale=1):
            ttl = gr.Dropdown(TTL_CHOICES, value="none", label="time-to-live (needs timestamps)")
            budget = gr.Number(value=round(_default_budget_mib(engine)), label="cache budget (MiB)",
                               minimum=1, maximum=4096)
            run = gr.Button("Simulate my log", variant="primary")
            example = gr.Button("Fill in a generated example")
    waiting = gr.Markdown("*The report appears here after a simulation: paste a log, or fill in the generated "
                          "example, then press **Simulate my log**.*")
    with gr.Column(visible=False) as results:  # no empty frames before the first run
        headline = gr.HTML()
        plots = {key: gr.Plot(show_label=False) for key in FIGURES[:2]}
        gr.Markdown("### Why tokens were computed")
        plots["causes"] = gr.Plot(show_label=False)
        causes = gr.HTML()
        gr.Markdown("### Template suggestions")
        templates = gr.HTML()
        gr.Markdown("### The tree the log leaves behind, block granularity, hosted-API cost")
        plots["tree"] = gr.Plot(show_label=False)
        plots["granularity"] = gr.Plot(show_label=False)
        extra = gr.HTML()
    outputs = [headline, *plots.values(), causes, templates, extra, results, waiting]

    def on_run(text, ttl_value, budget_value):
        try:
            report = simulate_pasted(engine, text, ttl_value, budget_value)
        except EngineError as exc:
            warn(exc)
            return (gr.skip(),) * len(outputs)
        figs = report_figures(report)
        return (scoped(headline_html(report)), *(figs[k] for k in plots), scoped(causes_html(report)),
                scoped(templates_html(report)),
                scoped(granularity_html(report) + cost_html(report) + "<h3>Skipped lines</h3>" + skipped_html(report)),
                gr.update(visible=True), gr.update(visible=False))

    run.click(on_run, [log, ttl, budget], outputs, api_visibility="private", show_progress="minimal",
              concurrency_limit=1)  # one simulation at a time: the tokenizer is shared with the engine
    example.click(example_log, None, log, api_visibility="private")
