"""The prompt-ordering lab tab: one click runs the same requests in a good and a bad
ordering on the real engine and shows, side by side, what the order did to reuse
and prefill time.

Lays out and wires: preset buttons (and a custom template with its linter), the
side-by-side results (figures from ``components.views.lab.figures``, words from
``components.views.lab.markdown``), the miss explainer, the request-order demo
(FCFS vs longest-prefix-match on a small cache), the block-granularity
simulation and the hosted-API cost estimate. Engine work lives in
``analysis.lab.ordering_runs``, ``analysis.lab.request_order_demo`` and friends; this file only calls
them and turns their errors into ``gr.Warning``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import gradio as gr

from analysis.lab.cost_estimate import PricingRules, estimate_cost
from analysis.lab.granularity import DEFAULT_BLOCK_SIZES, compare_granularity
from analysis.lab.miss_explainer import explain_miss
from analysis.lab.ordering_runs import LabPrompt, Variant, VariantResult, run_lab
from analysis.lab.request_order_demo import request_order_demo_for
from analysis.lab.template_lint import (
    MAX_TEMPLATE_CHARS,
    MAX_VALUES_CHARS,
    check_render_size,
    lint_template,
    parse_values,
    render,
    suggest_order,
)
from components.lab_presets import (
    CUSTOM_TEMPLATE,
    CUSTOM_VALUES,
    DEFAULT_PRESET,
    PRESETS,
    scheduling_queue,
)
from components.panels.common import warn
from components.session import sub_namespace
from components.views.chart_style import TOKEN_COLORS
from components.views.format import clamp_int
from components.views.lab import figures as figs
from components.views.lab import markdown as views
from engine.api import EngineAPI
from engine.types import EngineError

DEFAULT_REQUESTS = 6
YOUR_TEMPLATE = "Your template"
CUSTOM_TITLE = "Your template, against a second ordering"
MAX_REQUESTS = 8
EXPLAIN_COLORS = {"cached": TOKEN_COLORS["cached"], "computed": TOKEN_COLORS["computed"]}
INTRO = (
    "Same content, different order. Each preset builds the same requests twice: **static content first** and "
    "per-request content last (good), or the same pieces in an order that breaks reuse (bad). Each ordering runs "
    "on the real model from an **empty cache** of its own, and every number below is measured."
)


def custom_variants(template_a: str, template_b: str, values_text: str) -> list[Variant]:
    """Your template, and a second ordering: template B, or the linter's suggestion."""
    rows = parse_values(values_text)  # the linter's own size limits apply to values and templates
    if len(rows) < 2:
        raise EngineError("Give values for at least two requests (one JSON object per line).")
    if len(rows) > MAX_REQUESTS * 2:
        raise EngineError(f"At most {MAX_REQUESTS * 2} requests, please: this runs on a small CPU.")
    second = (template_b or "").strip()
    if not second:
        report = lint_template(template_a, rows)
        second = suggest_order(template_a, report.per_request) or ""
    for template in (template_a, second):  # before rendering anything: occurrences x value lengths
        if template:
            check_render_size(template, rows)
    variants = [Variant(YOUR_TEMPLATE, tuple(LabPrompt(f"request {i + 1}", prompt=render(template_a, row))
                                                for i, row in enumerate(rows)))]
    if second and second != template_a:
        variants.append(Variant("Other order" if (template_b or "").strip() else "Suggested order",
                                tuple(LabPrompt(f"request {i + 1}", prompt=render(second, row))
                                      for i, row in enumerate(rows))))
    return variants


def granularity_rows(results: Sequence[VariantResult]):
    return [(r.name, compare_granularity([q.prompt_ids for q in r.requests], DEFAULT_BLOCK_SIZES,
                                         inserted=[q.cached_ids for q in r.requests])) for r in results if r.requests]


def cost_view(results: Sequence[VariantResult] | None, price, fraction, minimum, increment, scale) -> str:
    if not results:
        return views.cost_markdown([], 1, 0, 0, 1)
    try:
        rules = PricingRules(float(price), float(fraction), int(minimum), int(increment))
        rows = [(r.name, estimate_cost([(q.prompt_tokens, q.cached_tokens) for q in r.requests], rules,
                                       float(scale))) for r in results if r.requests]
    except (EngineError, TypeError, ValueError, OverflowError) as exc:
        return f"⚠️ {exc if isinstance(exc, EngineError) else 'Enter numbers in every pricing field.'}"
    return views.cost_markdown(rows, float(scale), rules.cached_fraction, rules.min_cacheable_tokens,
                               rules.increment_tokens)


# ---------------------------------------------------------------------- handlers
# Module-level functions of the engine (bound with ``_bind``), testable without the Blocks.
def _bind(fn: Callable, engine: EngineAPI) -> Callable:
    bound = partial(fn, engine)
    bound.__name__ = fn.__name__  # Gradio names events after their function
    return bound


def lint(engine: EngineAPI, a, b, values_text) -> str:
    """The linter's verdict on template A (and B), as Markdown."""
    count_tokens = views.count_tokens_with(engine.encode)
    try:
        rows = parse_values(values_text or "")
        report = lint_template(a or "", rows, count_tokens)
        text = views.lint_markdown(report, counted_with_tokenizer=True)
        if (b or "").strip():
            other = lint_template(b, rows, count_tokens)
            text += f"\n\n**Second ordering:** estimated reusable share **{other.reusable_share:.0%}**."
        return text
    except EngineError as exc:
        return f"⚠️ {exc}"


def fill_suggestion(engine: EngineAPI, a, values_text):
    try:
        report = lint_template(a or "", parse_values(values_text or ""), views.count_tokens_with(engine.encode))
    except EngineError as exc:
        warn(exc)
        return gr.skip()
    if report.suggested_template is None:
        gr.Info("Nothing to move: no per-request variable comes before static text.")
        return gr.skip()
    return report.suggested_template


def explain(engine: EngineAPI, results, choice):
    if not results or not choice:
        return [], "Run a preset, then pick a request to see where it left the cached path."
    try:
        vi, qi = (int(x) for x in str(choice).split(":"))
        variant = results[vi]
        q = variant.requests[qi]
    except (ValueError, IndexError):
        return [], "Pick a request from the list."
    ex = explain_miss(q.prompt_ids, [p.cached_ids for p in variant.requests[:qi]], engine.decode,
                      cached_tokens=q.cached_tokens, special_ids=set(engine.special_token_ids))
    return views.explanation_spans(ex), views.explanation_markdown(ex, f"{variant.name} · {q.label}")


def final_outputs(engine: EngineAPI, results: list[VariantResult], title: str, stopped: bool) -> tuple:
    """Every results view (in ``LabResults.outputs`` order) once a run ends."""
    choice = views.default_explainer_choice(results)
    spans, text = explain(engine, results, choice)
    rows = granularity_rows(results)
    return (views.headline_markdown(results, stopped, title), figs.prefill_summary_figure(results),
            figs.per_request_figure(results), figs.trees_figure(results), views.results_table(results),
            results, views.results_json(results, title, stopped),
            gr.update(choices=views.explainer_choices(results), value=choice), spans, text,
            figs.granularity_figure(rows),
            views.granularity_markdown(rows, [[q.cached_tokens for q in r.requests] for r in results if r.requests]))


N_RESULT_OUTPUTS = 12


def stream(engine: EngineAPI, variants: list[Variant], title: str, max_new_tokens, measure_baseline,
           request: gr.Request | None, progress) -> Iterator[tuple]:
    """Run both orderings; stream progress, then every view."""
    skip = (gr.skip(),) * (N_RESULT_OUTPUTS - 6)
    events = run_lab(engine, variants, max_new_tokens=clamp_int(max_new_tokens, 1, 1, 4),
                     measure_baseline=bool(measure_baseline),
                     namespace_of=lambda name: sub_namespace(request, engine, name))
    try:
        total = sum(len(v.prompts) for v in variants)
        progress((0, total), desc="Starting", unit="requests")
        yield (views.progress_markdown(0, total, "tokenizing"), figs.empty_figure("Running…"), gr.skip(),
               gr.skip(), [], None, *skip)
        for ev in events:
            if ev.finished:
                yield final_outputs(engine, list(ev.results), title, ev.stopped)
                break
            progress((ev.done, ev.total), desc=ev.message, unit="requests")
            yield (views.progress_markdown(ev.done, ev.total, ev.message), gr.skip(),
                   figs.per_request_figure(ev.results), gr.skip(), views.results_table(ev.results),
                   list(ev.results), *skip)
    except EngineError as exc:
        warn(exc)
        yield (views.headline_markdown([]),) + (gr.skip(),) * (N_RESULT_OUTPUTS - 1)
    finally:
        events.close()  # a stopped run clears its namespaces now, not at garbage collection


def run_preset(engine: EngineAPI, title, n, max_new_tokens, measure_baseline, request: gr.Request = None,
               progress=gr.Progress()):
    """Run a preset's good and bad orderings; stream progress, then every view."""
    chosen = PRESETS.get(str(title))
    if chosen is None:
        warn(EngineError(f"Unknown preset; pick one of: {', '.join(PRESETS)}."))
        yield (gr.skip(),) * N_RESULT_OUTPUTS
        return
    n = clamp_int(n, DEFAULT_REQUESTS, 2, min(MAX_REQUESTS, chosen.max_requests))
    yield from stream(engine, chosen.variants(n), chosen.title, max_new_tokens, measure_baseline, request, progress)


def run_custom(engine: EngineAPI, a, b, values_text, max_new_tokens, measure_baseline, request: gr.Request = None,
               progress=gr.Progress()):
    """Run the visitor's template against a second ordering (theirs, or the suggested one)."""
    try:
        variants = custom_variants(a or "", b or "", values_text or "")
    except EngineError as exc:
        warn(exc)
        yield (gr.skip(),) * N_RESULT_OUTPUTS
        return
    title = f"{YOUR_TEMPLATE} against {'your second ordering' if (b or '').strip() else 'the suggested order'}"
    yield from stream(engine, variants, title, max_new_tokens, measure_baseline, request, progress)


def run_schedule(engine: EngineAPI, groups, per_group, budget, progress=gr.Progress()):
    queue = scheduling_queue(clamp_int(per_group, 3, 2, 4), clamp_int(groups, 3, 2, 4))
    budget = clamp_int(budget, 520, 16, 20_000)
    events = None
    try:
        events = request_order_demo_for(engine).compare(queue, budget)
        for ev in events:
            progress((ev.done, ev.total), desc=ev.message, unit="requests")
            text = (views.schedule_markdown(ev.results, budget, engine.info().kv_bytes_per_token, ev.stopped)
                    if ev.finished else views.progress_markdown(ev.done, ev.total, ev.message))
            yield text, figs.schedule_figure(ev.results)
    except EngineError as exc:
        warn(exc)
        yield gr.skip(), gr.skip()
    finally:
        if events is not None:
            events.close()  # releases the small engine for the next visitor


def pick_preset(title: str) -> tuple:
    """A preset button: select it, describe it, and light only its button."""
    return (title, f"*{PRESETS[title].what}*", *(gr.update(variant="primary" if t == title else "secondary")
                                                 for t in PRESETS))


def pick_custom() -> tuple:
    """The custom run: describe it, and light no preset button."""
    return (f"*{CUSTOM_TITLE}: the results below are your template's.*",
            *(gr.update(variant="secondary") for _ in PRESETS))


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
