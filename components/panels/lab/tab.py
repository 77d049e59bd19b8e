"""The prompt-ordering lab tab: one click runs the same requests in a good and a bad
ordering on the real engine and shows, side by side, what the order did to reuse
and prefill time.

Lays out and wires: preset buttons (and a custom template with its linter), the
side-by-side results (figures from ``components.views.lab.figures``, words from
``components.views.lab.markdown``), the miss explainer, the request-order demo
(FCFS vs longest-prefix-match on a small cache), the block-granularity
simulation and the hosted-API cost estimate. Engine work lives in
``analysis.lab.ordering_runs``, ``analysis.lab.request_order_demo`` and friends; this file only calls
them and turns their errors into ``gr.Warning``. What each button does is in ``handlers.py``; this
file lays out the sections and wires them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import gradio as gr

from analysis.lab.template_lint import (
    MAX_TEMPLATE_CHARS,
    MAX_VALUES_CHARS,
)
from components.lab_presets import (
    CUSTOM_TEMPLATE,
    CUSTOM_VALUES,
    DEFAULT_PRESET,
    PRESETS,
)
from components.panels.lab.handlers import (  # noqa: F401 (custom_variants, granularity_rows: re-exported)
    DEFAULT_REQUESTS,
    EXPLAIN_COLORS,
    INTRO,
    MAX_REQUESTS,
    _bind,
    cost_view,
    custom_variants,
    explain,
    fill_suggestion,
    granularity_rows,
    lint,
    pick_custom,
    pick_preset,
    run_custom,
    run_preset,
    run_schedule,
)
from components.views.lab import figures as figs
from components.views.lab import markdown as views
from engine.api import EngineAPI


# ---------------------------------------------------------------------- sections
@dataclass
class LabResults:
    """The views a run fills, in the order the handlers return them."""

    headline: gr.Markdown
    summary_plot: gr.Plot
    per_request_plot: gr.Plot
    trees_plot: gr.Plot
    table: gr.Dataframe
    state: gr.State
    raw: gr.JSON
    explain_pick: gr.Dropdown
    explain_tokens: gr.HighlightedText
    explain_text: gr.Markdown
    gran_plot: gr.Plot
    gran_text: gr.Markdown
    empty: gr.Markdown  # the empty state, shown until the first run (not a handler output)

    @property
    def outputs(self) -> list:
        return [self.headline, self.summary_plot, self.per_request_plot, self.trees_plot, self.table, self.state,
                self.raw, self.explain_pick, self.explain_tokens, self.explain_text, self.gran_plot, self.gran_text]


@dataclass
class RunControls:
    preset: gr.Dropdown
    buttons: list[gr.Button]
    n_requests: gr.Slider
    max_new: gr.Slider
    measure: gr.Checkbox
    run: gr.Button
    stop: gr.Button
    what: gr.Markdown


def _build_run_controls() -> RunControls:
    with gr.Row():
        buttons = [gr.Button(title, size="sm", variant="primary" if title == DEFAULT_PRESET else "secondary")
                   for title in PRESETS]
    with gr.Row():
        preset = gr.Dropdown(list(PRESETS), value=DEFAULT_PRESET, label="Preset", scale=3, min_width=200)
        n_requests = gr.Slider(2, MAX_REQUESTS, value=DEFAULT_REQUESTS, step=1, label="Requests per ordering",
                               scale=2, min_width=160)
        max_new = gr.Slider(1, 4, value=1, step=1, label="New tokens per request (only prefill matters here)",
                            scale=2, min_width=160)
        measure = gr.Checkbox(value=True, label="Also time each prompt with no reuse (for the speedup column)",
                              scale=2, min_width=160)
    with gr.Row():
        run = gr.Button("Run both orderings", variant="primary", scale=3)
        stop = gr.Button("Stop", variant="stop", scale=1)
    return RunControls(preset, buttons, n_requests, max_new, measure, run, stop,
                       gr.Markdown(f"*{PRESETS[DEFAULT_PRESET].what}*"))


def _build_custom(engine: EngineAPI) -> tuple[list, gr.Button]:
    """The template editor with its live linter; returns its inputs and its run button."""
    with gr.Accordion("Write your own template", open=False, elem_id="lab-custom"):
        gr.Markdown("A template with `{variables}` (write `{{` and `}}` for literal braces) and one JSON object of "
                    "values per request. Prompts are sent as raw text. Leave *second ordering* empty to compare "
                    "with the linter's suggested order. The results appear right below this box.")
        with gr.Row():
            template_a = gr.Textbox(CUSTOM_TEMPLATE, label="Your template", lines=8, max_length=MAX_TEMPLATE_CHARS)
            template_b = gr.Textbox("", label="Second ordering (optional)", lines=8, max_length=MAX_TEMPLATE_CHARS)
        values = gr.Textbox(CUSTOM_VALUES, label="Values, one JSON object per request", lines=6,
                            max_length=MAX_VALUES_CHARS)
        lint_out = gr.Markdown(lint(engine, CUSTOM_TEMPLATE, "", CUSTOM_VALUES))
        with gr.Row():
            suggest_btn = gr.Button("Put the suggested order in the second box", size="sm")
            run = gr.Button("Run both orderings", variant="primary", size="sm")
    for comp in (template_a, template_b, values):
        comp.change(_bind(lint, engine), [template_a, template_b, values], lint_out, api_visibility="private",
                    show_progress="hidden", trigger_mode="always_last")
    suggest_btn.click(_bind(fill_suggestion, engine), [template_a, values], template_b, api_visibility="private")
    return [template_a, template_b, values], run


def _build_results(engine: EngineAPI) -> LabResults:
    with gr.Group(elem_id="lab-results"):
        headline = gr.Markdown(views.headline_markdown([]))
        # Before the first run: one short card instead of three empty charts and an empty table.
        empty = gr.Markdown(EMPTY_RESULTS, elem_id="lab-empty")
        summary_plot = gr.Plot(figs.prefill_summary_figure([]), show_label=False, visible=False)
        per_request_plot = gr.Plot(figs.per_request_figure([]), show_label=False, visible=False)
        trees_plot = gr.Plot(figs.trees_figure([]), show_label=False, visible=False)
        table = gr.Dataframe(headers=views.TABLE_HEADERS, label="Per request (measured)", interactive=False,
                             wrap=True, max_height=320, visible=False)
    state = gr.State(None)
    with gr.Accordion("Why did a request miss? (miss explainer)", open=True):
        explain_pick = gr.Dropdown([], label="Request", interactive=True)
        explain_tokens = gr.HighlightedText(show_label=False, color_map=EXPLAIN_COLORS, combine_adjacent=True,
                                            show_legend=True)
        explain_text = gr.Markdown("Run a preset, then pick a request to see where it left the cached path.")
    explain_pick.input(_bind(explain, engine), [state, explain_pick], [explain_tokens, explain_text],
                       api_visibility="private")
    with gr.Accordion("Block granularity (simulation)", open=False):
        gran_plot = gr.Plot(figs.granularity_figure([]), show_label=False)
        gran_text = gr.Markdown()
    return LabResults(headline, summary_plot, per_request_plot, trees_plot, table, state, gr.JSON(render=False),
                      explain_pick, explain_tokens, explain_text, gran_plot, gran_text, empty)


EMPTY_RESULTS = (
    "**Nothing run yet.** After a run, this space shows both orderings side by side: prefill time and hit rate, "
    "the cached and computed tokens of every request, and the tree each ordering leaves behind.")


def reveal_results():
    """A run starts: the charts and the table take the empty state's place (for good)."""
    return gr.update(visible=False), *(gr.update(visible=True) for _ in range(4))


def _build_schedule(engine: EngineAPI) -> None:
    with gr.Accordion("Request order under a small cache: first-come-first-served vs longest-prefix-match first",
                      open=False):
        gr.Markdown("A burst of requests from several workloads arrives interleaved (A1 B1 C1 A2 …). The cache "
                    "holds only about one workload's prefix. FCFS runs them as they came, so each prefix is evicted "
                    "before its next request; SGLang's longest-prefix-match scheduler picks the waiting request with "
                    "the longest cached prefix first. Both run for real on a dedicated small-budget engine.")
        with gr.Row():
            groups = gr.Slider(2, 4, value=3, step=1, label="Workloads")
            per = gr.Slider(2, 4, value=3, step=1, label="Requests per workload")
            budget = gr.Slider(100, 3000, value=520, step=20, label="Cache budget (tokens)")
        with gr.Row():
            run = gr.Button("Run both orders", variant="primary")
            stop = gr.Button("Stop", variant="stop")
        text = gr.Markdown()
        plot = gr.Plot(figs.schedule_figure([]), show_label=False)
    event = run.click(_bind(run_schedule, engine), [groups, per, budget], [text, plot], api_name="ordering_schedule",
                      show_progress="minimal", concurrency_limit=2)
    stop.click(lambda: "**Stopped.**", None, text, cancels=[event], api_visibility="private")


def _build_cost(state: gr.State, runs: list) -> None:
    with gr.Accordion("Hosted-API cost estimate", open=False):
        gr.Markdown("Hosted APIs bill cached input tokens at a discount under rules like these (defaults: OpenAI's "
                    "documented 1,024-token minimum and 128-token increments; the discount differs by model and "
                    "provider). Every parameter is editable; the result is an **estimate**.")
        with gr.Row(elem_classes=["cost-row"]):
            # Short labels, one line each, so the five fields line up.
            price = gr.Number(2.50, label="$ per M input tokens", minimum=0, min_width=150,
                              info="input price")
            fraction = gr.Number(0.5, label="Cached share of price", minimum=0, maximum=1, min_width=150,
                                 info="cached tokens billed at")
            minimum = gr.Number(1024, label="Min cached prefix", minimum=0, precision=0, min_width=150,
                                info="tokens")
            increment = gr.Number(128, label="Increment", minimum=1, precision=0, min_width=150, info="tokens")
            scale = gr.Number(4, label="Length factor", minimum=0.01, min_width=150,
                              info="demo prompts are short")
        out = gr.Markdown(cost_view(None, 0, 0, 0, 1, 1))
    inputs = [state, price, fraction, minimum, increment, scale]
    for ev in runs:
        ev.then(cost_view, inputs, out, api_visibility="private")
    for comp in inputs[1:]:
        comp.change(cost_view, inputs, out, api_visibility="private")


def build_ordering_lab(engine: EngineAPI) -> None:
    gr.Markdown(INTRO)
    ctl = _build_run_controls()
    custom_inputs, custom_run = _build_custom(engine)
    res = _build_results(engine)
    lab_inputs = [ctl.preset, ctl.n_requests, ctl.max_new, ctl.measure]
    preset_run = _bind(run_preset, engine)
    runs = [ctl.run.click(preset_run, lab_inputs, res.outputs, api_name="ordering_lab", show_progress="minimal",
                          concurrency_limit=4)]
    for btn, title in zip(ctl.buttons, PRESETS, strict=True):
        runs.append(btn.click(partial(pick_preset, title), None, [ctl.preset, ctl.what, *ctl.buttons],
                              api_visibility="private").then(
            preset_run, lab_inputs, res.outputs, api_visibility="private", show_progress="minimal",
            concurrency_limit=4))
    runs.append(custom_run.click(pick_custom, None, [ctl.what, *ctl.buttons], api_visibility="private").then(
        _bind(run_custom, engine), [*custom_inputs, ctl.max_new, ctl.measure], res.outputs,
        api_visibility="private", show_progress="minimal", concurrency_limit=4))
    shown = [res.empty, res.summary_plot, res.per_request_plot, res.trees_plot, res.table]
    for trigger in (ctl.run, *ctl.buttons, custom_run):
        trigger.click(reveal_results, None, shown, api_visibility="private", queue=False)
    ctl.preset.input(lambda t: pick_preset(str(t)) if str(t) in PRESETS else gr.skip(), ctl.preset,
                     [ctl.preset, ctl.what, *ctl.buttons], api_visibility="private")
    ctl.stop.click(lambda: "**Stopped.** The results cover the requests that finished.", None, res.headline,
                   cancels=runs, api_visibility="private")
    _build_schedule(engine)
    _build_cost(res.state, runs)
    with gr.Accordion("Raw numbers (JSON)", open=False):
        res.raw.render()
