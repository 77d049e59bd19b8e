"""Text views for the prompt-ordering lab: lab results in, Markdown, tables and JSON out.

Owns the words and tables of the lab tab: the headline, the per-request table,
the raw-numbers JSON, the miss explainer's text, the granularity note, the
template lint and the cost estimate. Pure functions of plain data (plus a
``decode`` / ``count_tokens`` callable where text is needed); no Gradio.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from analysis.lab.cost_estimate import CostEstimate
from analysis.lab.granularity import GranularityResult, tokens_lost_to_alignment
from analysis.lab.miss_explainer import MissExplanation
from analysis.lab.ordering_runs import VariantResult
from analysis.lab.request_order_demo import POLICY_NAMES, ScheduleResult
from analysis.lab.template_lint import LintReport
from components.views.format import fmt_ms, ratio_words
from engine.visibility import everyone

# Every figure here is the viewer's own (the lab's runs: the visitor's own prompts in their own namespaces, and the request-order demo's dedicated engine): engine.visibility.
FIGURES_WHOSE = "own"

TABLE_HEADERS = ["ordering", "request", "prompt tokens", "cached", "computed", "prefill ms", "no-reuse ms"]


class Comparison(NamedTuple):
    """The last ordering measured against the first: "Bad ordering (x)" against "Good ordering (y)",
    or "Suggested order" against "Your template", and how its total prefill compares."""

    subject: str
    reference: str
    words: str  # "3.1× slower", "1.7× faster", "about the same speed"
    subject_ms: float
    reference_ms: float


def ordering_name(name: str) -> str:
    """"Bad: time and id at the top" -> "Bad ordering (time and id at the top)"; other names as they are."""
    head, sep, rest = name.partition(": ")
    return f"{head} ordering ({rest})" if sep and head in ("Good", "Bad") else name


def short_name(name: str) -> str:
    """"Bad: x" -> "Bad ordering" (for narrow titles); other names as they are."""
    head, sep, _ = name.partition(": ")
    return f"{head} ordering" if sep and head in ("Good", "Bad") else name


def _reference(name: str) -> str:
    head, sep, _ = name.partition(": ")
    if sep and head in ("Good", "Bad"):
        return f"the {head.lower()} ordering"
    return "your template" if name == "Your template" else name


def comparison(results: Sequence[VariantResult]) -> Comparison | None:
    if len(results) < 2 or not results[-1].requests or results[0].total_prefill_ms <= 0:
        return None
    ref, other = results[0], results[-1]
    return Comparison(short_name(other.name), _reference(ref.name), ratio_words(ref.total_prefill_ms,
                      other.total_prefill_ms), other.total_prefill_ms, ref.total_prefill_ms)


def headline_markdown(results: Sequence[VariantResult], stopped: bool = False, title: str | None = None) -> str:
    """The one line a visitor reads: how the second ordering's prefill compares with the first's,
    the right way round ("1.7× faster", never "0.6× slower"); ``title`` names what ran."""
    if not results or not any(r.requests for r in results):
        return "Click a preset: the lab runs the same requests in both orderings on the real model."
    lines = [f"**{title}**"] if title else []
    found = comparison(results)
    if found:
        ref, other = results[0], results[-1]
        verb = (f"prefill at **{found.words}** as" if found.words.startswith("about") else
                f"prefill **{found.words}** than")
        lines.append(f"## {ordering_name(other.name)}: {verb} {found.reference} "
                     f"({fmt_ms(found.subject_ms)} vs {fmt_ms(found.reference_ms)}) · cache hit rate "
                     f"**{other.hit_rate:.0%}** vs **{ref.hit_rate:.0%}**")
    lines.append("")
    lines.append("| ordering | token hit rate | tokens computed | total prefill | mean prefill | no reuse | with reuse |")
    lines.append("|---|---|---|---|---|---|---|")
    for r in results:
        speed = ratio_words(r.baseline_total_ms, r.total_prefill_ms) if r.baseline_total_ms else "–"
        lines.append(f"| {r.name} | {r.hit_rate:.0%} | {r.computed_tokens:,} of {r.prompt_tokens:,} | "
                     f"{fmt_ms(r.total_prefill_ms)} | {fmt_ms(r.mean_prefill_ms)} | "
                     f"{fmt_ms(r.baseline_total_ms)} | {speed} |")
    notes = ["Each ordering ran from an empty cache (a namespace of its own); “no reuse” is the same prompts "
             "prefilled from scratch in the same process; “with reuse” compares the two."]
    if stopped:
        notes.append("**Stopped**: the numbers cover the requests that finished.")
    if any(everyone(r.evicted_tokens).value for r in results):  # the engine's evictions while it ran: anyone's
        notes.append("The cache evicted tokens during the run (budget too small or other visitors' requests): "
                     "see the Memory tab.")
    return "\n".join(lines) + "\n\n" + " ".join(f"*{n}*" for n in notes)


def progress_markdown(done: int, total: int, message: str) -> str:
    filled = round(20 * done / total) if total else 0
    return f"**Running on the real model…** `{'█' * filled}{'░' * (20 - filled)}` {done} of {total} requests · {message}"


def results_table(results: Sequence[VariantResult]) -> list[list]:
    return [[r.name, q.label, q.prompt_tokens, q.cached_tokens, q.computed_tokens, round(q.prefill_ms),
             round(q.baseline_prefill_ms) if q.baseline_prefill_ms is not None else None]
            for r in results for q in r.requests]


def results_json(results: Sequence[VariantResult], title: str, stopped: bool = False) -> dict:
    return {
        "preset": title, "stopped": stopped,
        "variants": [{
            "name": r.name, "requests": len(r.requests), "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens, "computed_tokens": r.computed_tokens,
            "hit_rate": round(r.hit_rate, 4), "total_prefill_ms": round(r.total_prefill_ms, 1),
            "mean_prefill_ms": round(r.mean_prefill_ms, 1),
            "baseline_total_ms": None if r.baseline_total_ms is None else round(r.baseline_total_ms, 1),
            "speedup": None if r.speedup is None else round(r.speedup, 2), "tree_nodes": len(r.tree),
            "per_request": [{"label": q.label, "prompt_tokens": q.prompt_tokens, "cached_tokens": q.cached_tokens,
                             "prefill_ms": round(q.prefill_ms, 1)} for q in r.requests],
        } for r in results],
    }


def explainer_choices(results: Sequence[VariantResult]) -> list[tuple[str, str]]:
    return [(f"{r.name} · {q.label}", f"{vi}:{qi}") for vi, r in enumerate(results) for qi, q in enumerate(r.requests)]


def default_explainer_choice(results: Sequence[VariantResult]) -> str | None:
    """In the last (bad) ordering, the request after the first that computed the most tokens."""
    for vi in range(len(results) - 1, -1, -1):
        reqs = results[vi].requests
        if len(reqs) >= 2:
            qi = max(range(1, len(reqs)), key=lambda i: (reqs[i].computed_tokens, -i))
            return f"{vi}:{qi}"
    return "0:0" if results and results[0].requests else None


def explanation_spans(ex: MissExplanation) -> list[tuple[str, str | None]]:
    spans: list[tuple[str, str | None]] = []
    if ex.before_text:
        spans.append(("…" + ex.before_text if ex.position > 24 else ex.before_text, "cached"))
    if ex.after_text:
        spans.append((ex.after_text + "…", "computed"))
    return spans


def explanation_markdown(ex: MissExplanation, request_name: str) -> str:
    lines = [f"**{request_name}**: {ex.cached_tokens:,} of {ex.prompt_tokens:,} prompt tokens came from the cache; "
             f"the first computed token is token {ex.position:,}.", "", f"**Why:** {ex.reason}"]
    if ex.cached_after_text and ex.kind not in ("cold", "full-hit"):
        shown = " ".join(ex.cached_after_text.split())[:160]
        lines += ["", f"At that point the cached path continued with: `{shown.replace('`', 'ˋ')}`"]
    return "\n".join(lines)


def granularity_markdown(rows: Sequence[tuple[str, Sequence[GranularityResult]]],
                         measured: Sequence[Sequence[int]]) -> str:
    if not rows:
        return ""
    lines = ["*A simulation, not a measurement:* the pure radix tree replays this run's real token ids, matching "
             "per token (this engine, SGLang) and in 16- and 64-token blocks (paged engines such as vLLM cache and "
             "match only full blocks).", "",
             "| ordering | per token | 16-token blocks | 64-token blocks | lost to alignment (16 / 64) |",
             "|---|---|---|---|---|"]
    agree = True
    for (name, gs), counts in zip(rows, measured, strict=True):
        by = {g.block_size: g for g in gs}
        lost = tokens_lost_to_alignment(gs)
        lines.append(f"| {name} | {by[1].cached_tokens:,} | {by[16].cached_tokens:,} | {by[64].cached_tokens:,} | "
                     f"{lost[16]:,} / {lost[64]:,} tokens |")
        agree = agree and list(by[1].cached_per_request) == list(counts)
    lines.append("")
    lines.append("The per-token simulation reproduces the engine's measured cached tokens exactly." if agree else
                 "The per-token simulation differs from the engine's measured counts (the engine evicted tokens "
                 "during the run, which the simulation, with no budget, does not).")
    return "\n".join(lines)


def cost_markdown(rows: Sequence[tuple[str, CostEstimate]], scale: float, fraction: float, minimum: int,
                  increment: int) -> str:
    if not rows:
        return "*Run a preset to estimate what its prompts would cost on a hosted API.*"
    lines = [f"**Estimate**, not a bill: prompt lengths ×{scale:g}; cached input billed at {fraction:.0%} of the "
             f"input price once a cached prefix reaches {minimum:,} tokens, counted in {increment:,}-token steps. "
             "Output tokens are not included.", "",
             "| ordering | prompt tokens / request | billed as cached | per 1,000 requests, no caching | "
             "per 1,000 requests, with caching | saving |", "|---|---|---|---|---|---|"]
    for name, c in rows:
        per_req = c.prompt_tokens / c.requests if c.requests else 0
        lines.append(f"| {name} | {per_req:,.0f} | {c.billed_cached_tokens / max(1, c.prompt_tokens):.0%} | "
                     f"${c.per_thousand_requests(c.usd_without_caching):,.2f} | "
                     f"${c.per_thousand_requests(c.usd_with_caching):,.2f} | {c.saving_share:.0%} |")
    if all(c.billed_cached_tokens == 0 for _, c in rows):
        lines += ["", f"*No request reached the {minimum:,}-token minimum, so nothing would be billed as cached: "
                      "raise the prompt-length factor to your production sizes.*"]
    return "\n".join(lines)


def lint_markdown(report: LintReport, counted_with_tokenizer: bool) -> str:
    unit = "tokens" if counted_with_tokenizer else "tokens (estimated from characters)"
    lines = []
    if report.per_request:
        lines.append("Per-request variables: " + ", ".join(f"`{{{v}}}`" for v in report.per_request) +
                     (" · same value in every request (static): " + ", ".join(f"`{{{v}}}`" for v in report.constant)
                      if report.constant else ""))
    else:
        lines.append("No per-request variables: every request would be the same prompt.")
    if report.warnings:
        lines += ["", *[f"⚠️ {w.message}" for w in report.warnings]]
    elif report.per_request:
        lines += ["", "✅ No per-request variable comes before static text."]
    est = (f"**Estimated reusable share** of each prompt: **{report.reusable_share:.0%}** "
           f"(of ~{report.mean_prompt_tokens:,.0f} {unit} per prompt)")
    if report.reusable_share_suggested is not None:
        est += f"; with the suggested order: **{report.reusable_share_suggested:.0%}**"
    lines += ["", est + "."]
    return "\n".join(lines)


def schedule_markdown(results: Sequence[ScheduleResult], budget_tokens: int, bytes_per_token: int,
                      stopped: bool = False) -> str:
    if not results:
        return ""
    lines = [f"Cache budget: **{budget_tokens:,} tokens** ({budget_tokens * bytes_per_token / 2**20:.1f} MiB), a "
             "dedicated small engine on the same model; each policy starts from an empty cache.", "",
             "| policy | token hit rate | total prefill | tokens evicted | run order |", "|---|---|---|---|---|"]
    for r in results:
        order = " ".join(q.label for q in r.requests)
        lines.append(f"| {POLICY_NAMES.get(r.policy, r.policy)} | {r.hit_rate:.0%} | {fmt_ms(r.total_prefill_ms)} | "
                     f"{r.evicted_tokens:,} | {order} |")
    if len(results) == 2 and results[1].total_prefill_ms > 0 and results[0].complete and results[1].complete:
        ratio = results[0].total_prefill_ms / results[1].total_prefill_ms
        lines += ["", f"Longest-prefix-match first: **{ratio:.1f}×** less prefill time than first-come-first-served "
                      "on the same queue. The price is fairness: a request whose prefix is not cached waits longer."]
    if stopped:
        lines += ["", "**Stopped**: the numbers cover the requests that finished."]
    return "\n".join(lines)


def count_tokens_with(encode: Callable[[str], Sequence[int]]) -> Callable[[str], int]:
    return lambda text: len(encode(text)) if text else 0
