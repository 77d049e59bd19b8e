"""The prompt-ordering lab's event handlers: what each button and field does, apart from the layout.

Owns: the custom run's variants, the linter and its suggestion, the miss explainer, the streamed
runs (a preset, your template, the request-order demo), the cost view and the preset pickers. Each
calls ``analysis.lab`` and turns its errors into ``gr.Warning``; ``tab.py`` lays out the tab and
wires these (and re-exports the ones tests call).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial

import gradio as gr

from analysis.lab.cost_estimate import PricingRules, estimate_cost
from analysis.lab.granularity import DEFAULT_BLOCK_SIZES, compare_granularity
from analysis.lab.miss_explainer import explain_miss
from analysis.lab.ordering_runs import LabPrompt, Variant, VariantResult, run_lab
from analysis.lab.request_order_demo import request_order_demo_for
from analysis.lab.template_lint import (
    check_render_size,
    lint_template,
    parse_values,
    render,
    suggest_order,
)
from components.lab_presets import (
    PRESETS,
    scheduling_queue,
)
from components.panels.common import warn
from components.session import sub_namespace
from components.views.chart_style import TOKEN_COLORS
from components.views.format import clamp_int
from components.views.lab import figures as figs
from components.views.lab import markdown as views
from engine.api import EngineAPI, TextAPI
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


def lint(engine: TextAPI, a, b, values_text) -> str:
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


def fill_suggestion(engine: TextAPI, a, values_text):
    try:
        report = lint_template(a or "", parse_values(values_text or ""), views.count_tokens_with(engine.encode))
    except EngineError as exc:
        warn(exc)
        return gr.skip()
    if report.suggested_template is None:
        gr.Info("Nothing to move: no per-request variable comes before static text.")
        return gr.skip()
    return report.suggested_template


def explain(engine: TextAPI, results, choice):
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
