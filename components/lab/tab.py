"""The prompt-ordering lab tab: one click runs the same requests in a good and a bad
ordering on the real engine and shows, side by side, what the order did to reuse
and prefill time.

Lays out and wires: preset buttons (and a custom template with its linter), the
side-by-side results (figures from ``components.lab.figures``, words from
``components.lab.markdown``), the miss explainer, the request-order demo
(FCFS vs longest-prefix-match on a small cache), the block-granularity
simulation and the hosted-API cost estimate. Engine work lives in
``engine.lab.ordering_runs``, ``engine.lab.request_order_demo`` and friends; this file only calls
them and turns their errors into ``gr.Warning``.
"""

from __future__ import annotations

from collections.abc import Sequence

import gradio as gr

from components.common import TOKEN_COLORS, warn
from components.lab import figures as figs
from components.lab import markdown as views
from components.lab.presets import (
    CUSTOM_TEMPLATE,
    CUSTOM_VALUES,
    DEFAULT_PRESET,
    PRESETS,
    scheduling_queue,
)
from components.session import sub_namespace
from engine.engine import Engine
from engine.lab.cost_estimate import PricingRules, estimate_cost
from engine.lab.granularity import DEFAULT_BLOCK_SIZES, compare_granularity
from engine.lab.miss_explainer import explain_miss
from engine.lab.ordering_runs import LabPrompt, Variant, VariantResult, run_lab
from engine.lab.request_order_demo import request_order_demo_for
from engine.lab.template_lint import check_render_size, lint_template, parse_values, render, suggest_order
from engine.types import EngineError

DEFAULT_REQUESTS = 6
MAX_REQUESTS = 8
MAX_TEMPLATE_CHARS = 20_000
EXPLAIN_COLORS = {"cached": TOKEN_COLORS["cached"], "computed": TOKEN_COLORS["computed"]}
INTRO = (
    "Same content, different order. Each preset builds the same requests twice: **static content first** and "
    "per-request content last (good), or the same pieces in an order that breaks reuse (bad). Each ordering runs "
    "on the real model from an **empty cache** of its own, and every number below is measured."
)


def _clamp(value, lo: int, hi: int, default: int) -> int:
    try:
        return max(lo, min(hi, int(value)))
    except (TypeError, ValueError, OverflowError):  # junk, NaN, infinity
        return default


def check_sizes(*texts: str | None) -> None:
    """Refuse texts too long for the lab before tokenizing them: the linter runs on every
    edit, and a pasted megabyte would tie up a worker for many seconds each time."""
    if any(len(t or "") > MAX_TEMPLATE_CHARS for t in texts):
        raise EngineError(f"Templates and values are limited to {MAX_TEMPLATE_CHARS:,} characters each here.")


def custom_variants(template_a: str, template_b: str, values_text: str) -> list[Variant]:
    """Your template, and a second ordering: template B, or the linter's suggestion."""
    check_sizes(template_a, template_b, values_text)
    rows = parse_values(values_text)
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
    variants = [Variant("Your template", tuple(LabPrompt(f"request {i + 1}", prompt=render(template_a, row))
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


def build_ordering_lab(engine: Engine) -> None:
    count_tokens = views.count_tokens_with(engine.encode)
    special_ids = set(engine.special_token_ids)

    def lint(a, b, values_text):
        """The linter's verdict on template A (and B), as Markdown."""
        try:
            check_sizes(a, b, values_text)
            rows = parse_values(values_text or "")
            report = lint_template(a or "", rows, count_tokens)
            text = views.lint_markdown(report, counted_with_tokenizer=True)
            if (b or "").strip():
                other = lint_template(b, rows, count_tokens)
                text += f"\n\n**Second ordering:** estimated reusable share **{other.reusable_share:.0%}**."
            return text
        except EngineError as exc:
            return f"⚠️ {exc}"

    gr.Markdown(INTRO)
    with gr.Row():
        preset_buttons = [gr.Button(title, size="sm", variant="primary" if title == DEFAULT_PRESET else "secondary")
                          for title in PRESETS]
    with gr.Row():
        preset = gr.Dropdown(list(PRESETS), value=DEFAULT_PRESET, label="Preset", scale=3)
        n_requests = gr.Slider(2, MAX_REQUESTS, value=DEFAULT_REQUESTS, step=1, label="Requests per ordering",
                               scale=2)
        max_new = gr.Slider(1, 4, value=1, step=1, label="New tokens per request (only prefill matters here)",
                            scale=2)
        measure = gr.Checkbox(value=True, label="Also time each prompt with no reuse (for the speedup column)",
                              scale=2)
    with gr.Row():
        run_btn = gr.Button("Run both orderings", variant="primary", scale=3)
        stop_btn = gr.Button("Stop", variant="stop", scale=1)
    what = gr.Markdown(f"*{PRESETS[DEFAULT_PRESET].what}*")
    headline = gr.Markdown(views.headline_markdown([]))
    summary_plot = gr.Plot(figs.prefill_summary_figure([]), show_label=False)
    per_request_plot = gr.Plot(figs.per_request_figure([]), show_label=False)
    trees_plot = gr.Plot(figs.trees_figure([]), show_label=False)
    table = gr.Dataframe(headers=views.TABLE_HEADERS, label="Per request (measured)", interactive=False,
                         wrap=True, max_height=320)
    results_state = gr.State(None)

    with gr.Accordion("Why did a request miss? (miss explainer)", open=True):
        explain_pick = gr.Dropdown([], label="Request", interactive=True)
        explain_tokens = gr.HighlightedText(show_label=False, color_map=EXPLAIN_COLORS, combine_adjacent=True,
                                            show_legend=True)
        explain_text = gr.Markdown("Run a preset, then pick a request to see where it left the cached path.")

    with gr.Accordion("Write your own template", open=False):
        gr.Markdown("A template with `{variables}` (write `{{` and `}}` for literal braces) and one JSON object of "
                    "values per request. Prompts are sent as raw text. Leave *second ordering* empty to compare "
                    "with the linter's suggested order.")
        with gr.Row():
            template_a = gr.Textbox(CUSTOM_TEMPLATE, label="Your template", lines=8, max_length=20_000)
            template_b = gr.Textbox("", label="Second ordering (optional)", lines=8, max_length=20_000)
        values = gr.Textbox(CUSTOM_VALUES, label="Values, one JSON object per request", lines=6,
                            max_length=50_000)
        lint_out = gr.Markdown(lint(CUSTOM_TEMPLATE, "", CUSTOM_VALUES))
        with gr.Row():
            suggest_btn = gr.Button("Put the suggested order in the second box", size="sm")
            custom_btn = gr.Button("Run both orderings", variant="primary", size="sm")

    with gr.Accordion("Request order under a small cache: first-come-first-served vs longest-prefix-match first",
                      open=False):
        gr.Markdown("A burst of requests from several workloads arrives interleaved (A1 B1 C1 A2 …). The cache "
                    "holds only about one workload's prefix. FCFS runs them as they came, so each prefix is evicted "
                    "before its next request; SGLang's longest-prefix-match scheduler picks the waiting request with "
                    "the longest cached prefix first. Both run for real on a dedicated small-budget engine.")
        with gr.Row():
            sched_groups = gr.Slider(2, 4, value=3, step=1, label="Workloads")
            sched_per = gr.Slider(2, 4, value=3, step=1, label="Requests per workload")
            sched_budget = gr.Slider(100, 3000, value=520, step=20, label="Cache budget (tokens)")
        with gr.Row():
            sched_btn = gr.Button("Run both orders", variant="primary")
            sched_stop = gr.Button("Stop", variant="stop")
        sched_text = gr.Markdown()
        sched_plot = gr.Plot(figs.schedule_figure([]), show_label=False)

    with gr.Accordion("Block granularity (simulation)", open=False):
        gran_plot = gr.Plot(figs.granularity_figure([]), show_label=False)
        gran_text = gr.Markdown()

    with gr.Accordion("Hosted-API cost estimate", open=False):
        gr.Markdown("Hosted APIs bill cached input tokens at a discount under rules like these (defaults: OpenAI's "
                    "documented 1,024-token minimum and 128-token increments; the discount differs by model and "
                    "provider). Every parameter is editable; the result is an **estimate**.")
        with gr.Row():
            price = gr.Number(2.50, label="Input price, $ per million tokens", minimum=0)
            fraction = gr.Number(0.5, label="Cached input billed at (fraction of price)", minimum=0, maximum=1)
            minimum = gr.Number(1024, label="Minimum cacheable prefix (tokens)", minimum=0, precision=0)
            increment = gr.Number(128, label="Increment (tokens)", minimum=1, precision=0)
            scale = gr.Number(4, label="Prompt-length factor (demo prompts are short)", minimum=0.01)
        cost_out = gr.Markdown(cost_view(None, 0, 0, 0, 1, 1))

    with gr.Accordion("Raw numbers (JSON)", open=False):
        raw = gr.JSON()

    # ------------------------------------------------------------------ wiring
    lab_outputs = [headline, summary_plot, per_request_plot, trees_plot, table, results_state, raw, explain_pick,
                   explain_tokens, explain_text, gran_plot, gran_text]
    cost_inputs = [price, fraction, minimum, increment, scale]

    def explain(results, choice):
        if not results or not choice:
            return [], "Run a preset, then pick a request to see where it left the cached path."
        try:
            vi, qi = (int(x) for x in str(choice).split(":"))
            variant = results[vi]
            q = variant.requests[qi]
        except (ValueError, IndexError):
            return [], "Pick a request from the list."
        ex = explain_miss(q.prompt_ids, [p.cached_ids for p in variant.requests[:qi]], engine.decode,
                          cached_tokens=q.cached_tokens, special_ids=special_ids)
        return views.explanation_spans(ex), views.explanation_markdown(ex, f"{variant.name} · {q.label}")

    def final_outputs(results, title: str, stopped: bool):
        choice = views.default_explainer_choice(results)
        spans, text = explain(results, choice)
        rows = granularity_rows(results)
        return (views.headline_markdown(results, stopped), figs.prefill_summary_figure(results),
                figs.per_request_figure(results), figs.trees_figure(results), views.results_table(results),
                results, views.results_json(results, title, stopped),
                gr.update(choices=views.explainer_choices(results), value=choice), spans, text,
                figs.granularity_figure(rows),
                views.granularity_markdown(rows, [[q.cached_tokens for q in r.requests] for r in results
                                                  if r.requests]))

    def stream(variants: list[Variant], title: str, max_new_tokens, measure_baseline, request: gr.Request | None,
               progress: gr.Progress):
        skip = (gr.skip(),) * (len(lab_outputs) - 6)
        events = run_lab(engine, variants, max_new_tokens=_clamp(max_new_tokens, 1, 4, 1),
                         measure_baseline=bool(measure_baseline),
                         namespace_of=lambda name: sub_namespace(request, engine, name))
        try:
            total = sum(len(v.prompts) for v in variants)
            progress((0, total), desc="Starting", unit="requests")
            yield (views.progress_markdown(0, total, "tokenizing"), figs.empty_figure("Running…"), gr.skip(),
                   gr.skip(), [], None, *skip)
            for ev in events:
                if ev.finished:
                    yield final_outputs(list(ev.results), title, ev.stopped)
                    break
                progress((ev.done, ev.total), desc=ev.message, unit="requests")
                yield (views.progress_markdown(ev.done, ev.total, ev.message), gr.skip(),
                       figs.per_request_figure(ev.results), gr.skip(), views.results_table(ev.results),
                       list(ev.results), *skip)
        except EngineError as exc:
            warn(exc)
            yield (views.headline_markdown([]),) + (gr.skip(),) * (len(lab_outputs) - 1)
        finally:
            events.close()  # a stopped run clears its namespaces now, not at garbage collection

    def run_preset(title, n, max_new_tokens, measure_baseline, request: gr.Request, progress=gr.Progress()):
        """Run a preset's good and bad orderings; stream progress, then every view."""
        chosen = PRESETS.get(str(title))
        if chosen is None:
            warn(EngineError(f"Unknown preset; pick one of: {', '.join(PRESETS)}."))
            yield (gr.skip(),) * len(lab_outputs)
            return
        n = _clamp(n, 2, min(MAX_REQUESTS, chosen.max_requests), DEFAULT_REQUESTS)
        yield from stream(chosen.variants(n), chosen.title, max_new_tokens, measure_baseline, request, progress)

    def run_custom(a, b, values_text, max_new_tokens, measure_baseline, request: gr.Request,
                   progress=gr.Progress()):
        try:
            variants = custom_variants(a or "", b or "", values_text or "")
        except EngineError as exc:
            warn(exc)
            yield (gr.skip(),) * len(lab_outputs)
            return
        yield from stream(variants, "Custom template", max_new_tokens, measure_baseline, request, progress)

    lab_inputs = [preset, n_requests, max_new, measure]
    events = [run_btn.click(run_preset, lab_inputs, lab_outputs, api_name="ordering_lab",
                            show_progress="minimal", concurrency_limit=4)]
    for btn, title in zip(preset_buttons, PRESETS, strict=True):
        events.append(btn.click(lambda t=title: (t, f"*{PRESETS[t].what}*"), None, [preset, what],
                                api_visibility="private").then(
            run_preset, lab_inputs, lab_outputs, api_visibility="private", show_progress="minimal",
            concurrency_limit=4))
    events.append(custom_btn.click(run_custom, [template_a, template_b, values, max_new, measure], lab_outputs,
                                   api_visibility="private", show_progress="minimal", concurrency_limit=4))
    preset.change(lambda t: f"*{PRESETS[str(t)].what}*" if str(t) in PRESETS else "", preset, what,
                  api_visibility="private")
    stop_btn.click(lambda: "**Stopped.** The results cover the requests that finished.", None, headline,
                   cancels=events, api_visibility="private")
    explain_pick.input(explain, [results_state, explain_pick], [explain_tokens, explain_text],
                       api_visibility="private")
    for ev in events:
        ev.then(cost_view, [results_state, *cost_inputs], cost_out, api_visibility="private")
    for comp in cost_inputs:
        comp.change(cost_view, [results_state, *cost_inputs], cost_out, api_visibility="private")

    # ------------------------------------------------------------------ template linter
    def fill_suggestion(a, values_text):
        try:
            check_sizes(a, values_text)
            report = lint_template(a or "", parse_values(values_text or ""), count_tokens)
        except EngineError as exc:
            warn(exc)
            return gr.skip()
        if report.suggested_template is None:
            gr.Info("Nothing to move: no per-request variable comes before static text.")
            return gr.skip()
        return report.suggested_template

    for comp in (template_a, template_b, values):
        comp.change(lint, [template_a, template_b, values], lint_out, api_visibility="private",
                    show_progress="hidden", trigger_mode="always_last")
    suggest_btn.click(fill_suggestion, [template_a, values], template_b, api_visibility="private")

    # ------------------------------------------------------------------ request order
    def run_schedule(groups, per_group, budget, progress=gr.Progress()):
        queue = scheduling_queue(_clamp(per_group, 2, 4, 3), _clamp(groups, 2, 4, 3))
        budget = _clamp(budget, 16, 20_000, 520)
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

    sched_event = sched_btn.click(run_schedule, [sched_groups, sched_per, sched_budget], [sched_text, sched_plot],
                                  api_name="ordering_schedule", show_progress="minimal", concurrency_limit=2)
    sched_stop.click(lambda: "**Stopped.**", None, sched_text, cancels=[sched_event], api_visibility="private")
