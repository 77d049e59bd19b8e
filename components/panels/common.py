"""What the chat and few-shot panels share: the prompt coloured token by token, the
numbers card of one request, the status line while a request runs, which requests
count as the playground's (lab runs do not), and errors as toasts.

Formatting lives in ``components.views.format`` and colours in ``components.views.chart_style``;
this module only puts them together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import gradio as gr

from analysis.no_reuse import no_reuse_for
from analysis.prefill_timing import timer_for
from components.views.chart_style import TOKEN_COLORS
from components.views.format import (
    SAME_SPEED,
    card_head,
    first_token_cell,
    fmt_ms,
    fmt_pct,
    plural,
    reuse_is_noise,
    reuse_words,
)
from engine.types import EngineError, GenerationEvent, RequestMetrics
from engine.visibility import Audience, everyone

CACHED, COMPUTED = "cached", "computed"
__all__ = ["TOKEN_COLORS", "highlighted_prompt", "metrics_markdown", "status_markdown", "playground_history",
           "is_lab_run", "warn", "MODEL_NOTE", "reuse_note"]

LAB_TAGS = ("ordering-lab", "scheduling-lab", "reuse-check")  # kept out of the playground's figures
MODEL_NOTE = ("The model is tiny (135M parameters): its answers are often wrong, even against the policy it was "
              "given. Reuse does not change its answers: on a CPU with this app's own kernels the numbers under "
              "them are the same bits with reuse and without, whatever else runs beside them; on PyTorch's kernels "
              "(a GPU) they agree to about 1e-5. Each timing card shows the comparison.")


def is_lab_run(m: RequestMetrics) -> bool:
    """A lab run: deliberately bad orderings, kept out of the playground's numbers."""
    return m.tag in LAB_TAGS or m.tag.startswith("lab")


def playground_history(engine, namespace: str | None = None, n: int | None = None) -> list[RequestMetrics]:
    """The playground's requests (chat, few-shot, API), oldest first: lab runs left out;
    only ``namespace``'s when given (a visitor's own in isolation mode)."""
    items = [m for m in engine.recent(namespace=namespace) if not is_lab_run(m)]
    items = items[-n:] if n else items
    no_reuse = no_reuse_for(engine)
    items = with_no_reuse_figures(items, no_reuse) if no_reuse is not None else items
    timer = timer_for(engine)
    return with_paired_timings(items, timer) if timer is not None else items


def with_no_reuse_figures(items: list[RequestMetrics], no_reuse) -> list[RequestMetrics]:
    """Requests' figures with the no-reuse prefill ``analysis.no_reuse`` measured after their
    answer (the engine's records leave it out), so the history's panels count them too."""
    figures = no_reuse.figures_of(m.request_id for m in items if m.baseline_prefill_ms is None)
    if not figures:
        return items
    return [dataclasses.replace(m, baseline_prefill_ms=ms) if (ms := figures.get(m.request_id)) is not None else m
            for m in items]


def with_paired_timings(items: list[RequestMetrics], timer) -> list[RequestMetrics]:
    """Chat requests' figures with the paired timing their card showed (with and without reuse,
    back to back: the chat measures that instead of a no-reuse figure after the answer), so the
    history's panels count them too; other requests as they are."""
    paired = timer.timings_of(m.request_id for m in items if m.baseline_prefill_ms is None)
    if not paired:
        return items
    return [dataclasses.replace(m, prefill_ms=t.reuse_ms, baseline_prefill_ms=t.full_ms)
            if (t := paired.get(m.request_id)) is not None else m for m in items]


LONG_PROMPT_TOKENS = 1024


def long_prompt_note(engine, prompt_tokens: int) -> str | None:
    """For a long prompt, what to expect: its size and an estimate of its prefill from this
    machine's recent speed (measured on earlier requests); None for a short prompt."""
    if prompt_tokens < LONG_PROMPT_TOKENS:
        return None
    recent = [m for m in engine.recent(50) if m.computed_tokens >= 64 and m.prefill_ms > 0]
    ms_per_token = (sum(m.prefill_ms for m in recent) / sum(m.computed_tokens for m in recent)) if recent else None
    estimate = f", about {fmt_ms(ms_per_token * prompt_tokens)} at this machine's recent speed" if ms_per_token else ""
    return f"Long prompt: {prompt_tokens:,} tokens to prefill{estimate} (less if part of it is cached)."


def history_refresh(engine, draw: Callable[[list[RequestMetrics], str | None], tuple], n_outputs: int) -> Callable:
    """A live panel's refresh: redraw (``draw`` over the visitor's playground history, lab runs
    left out, and the namespace the visitor's figures cover: ``None`` = everything) only when
    the engine changed since this visitor's last picture."""
    from components.panels.live import drawn, engine_signature, unchanged
    from components.session import own_namespace

    def refresh(seen_before, request: gr.Request):
        sig = engine_signature(engine)
        if unchanged(seen_before, sig):
            return (gr.skip(),) * n_outputs + (seen_before,)
        ns = own_namespace(request, engine)
        return (*draw(playground_history(engine, namespace=ns), ns), drawn(sig))

    return refresh


def highlighted_prompt(engine, m: RequestMetrics) -> list[tuple[str, str | None]]:
    """The prompt as (text, label) spans: cached tokens first, computed after."""
    pieces = engine.token_pieces(m.prompt_ids)
    spans: list[tuple[str, str | None]] = []
    for i, piece in enumerate(pieces):
        label = CACHED if i < m.cached_tokens else COMPUTED
        if spans and spans[-1][1] == label:
            spans[-1] = (spans[-1][0] + piece, label)
        else:
            spans.append((piece, label))
    return spans


def reuse_note(m: RequestMetrics) -> str | None:
    """Why a with/without comparison says nothing, or says "slower", in words; None when it is a real gain."""
    if m.baseline_prefill_ms is None:
        return None
    if reuse_is_noise(m.cached_tokens, m.prompt_tokens):
        what = "nothing was reused" if m.cached_tokens == 0 else f"only {m.cached_tokens:,} tokens were reused"
        return f"{what.capitalize()}: both runs computed (almost) every token, so the difference is timing noise."
    if (m.speedup or 0) < 1 + SAME_SPEED:
        return ("Reuse gained nothing measurable here: at this size, copying the cached part costs about as much "
                "as computing it, and the two timings differ by noise.")
    return None


def speed_cell(m: RequestMetrics) -> str:
    """The comparison column: honest words, never "0.7× faster"."""
    return reuse_words(m.cached_tokens, m.prompt_tokens, m.baseline_prefill_ms, m.prefill_ms)


def metrics_markdown(m: RequestMetrics, baseline_skipped: str | None = None) -> str:
    """One request's numbers: what the cache served, prefill with and without reuse, and
    the time the visitor actually waited for the first token (``ttft_ms``, from arrival: queue
    plus engine), split into its two parts. A request stopped before its first token has none."""
    first = first_token_cell(m)
    lines = card_head(m) + [
        "| prefill with reuse | without reuse | compared | first text after | decode |",
        "|---|---|---|---|---|",
        f"| {fmt_ms(m.prefill_ms)} | {fmt_ms(m.baseline_prefill_ms)} | {speed_cell(m)} | {first} | "
        f"{f'{m.decode_tokens_per_s:.1f} tok/s' if m.decode_tokens_per_s else '–'} |",
    ]
    notes = []
    note = reuse_note(m)
    if note:
        notes.append(note)
    if getattr(m, "prefill_shared_step", False):
        notes.append("Part of this prefill ran in the same steps as other requests' decoding, so it reads high.")
    if (everyone(getattr(m, "batch_size_max", 1)).value or 1) > 1:  # how many others: not said (everyone's)
        notes.append("It ran batched with other requests.")
    if baseline_skipped:
        notes.append(baseline_skipped)
    elif m.baseline_prefill_ms is None and m.finish_reason != "cancelled":
        notes.append("No-reuse measurement off: tick “Measure prefill without reuse” to compare.")
    if getattr(m, "cached_tokens_reported", None) is not None:  # remote mode (server.remote.engine)
        notes.append("Remote server: prefill times are times to first token measured here; without reuse = the "
                     "same prompt under a fresh cache salt.")
        if not m.cached_tokens_reported:
            notes.append("Cached tokens unknown: the server did not report them (start vLLM with "
                         "`--enable-prompt-tokens-details`, SGLang with `--enable-cache-report`).")
    if notes:
        lines += ["", " ".join(f"*{n}*" for n in notes)]
    return "\n".join(lines)


def status_markdown(event: GenerationEvent | None, waited_s: float = 0.0) -> str:
    """The phase a running request is in, in words: queued (behind how many), prefilling
    (how far), writing the answer, or measuring prefill without reuse."""
    if event is None:
        return f"*Waiting for the model… ({waited_s:.0f} s)*" if waited_s >= 1 else "*Waiting for the model…*"
    phase = getattr(event, "phase", "decode")
    if phase == "queued":
        ahead = getattr(event, "queue_ahead", 0)
        return (f"*Waiting for {plural(ahead, 'request')} ahead of you… ({waited_s:.0f} s)*" if ahead else
                f"*Waiting for the model… ({waited_s:.0f} s)*")
    if phase == "prefill":
        total, done, cached = event.prompt_tokens, event.prefilled_tokens, event.cached_tokens
        if total:
            return (f"*Prefilling the prompt: {done:,} of {total:,} tokens ({fmt_pct(done / total)}); "
                    f"{cached:,} of them from the cache…*")
        return "*Prefilling the prompt…*"
    if phase == "baseline":
        return "*Answer done. Now timing the same prompt without reuse (a second full prefill)… Stop skips it.*"
    if phase == "done":
        return "*Done.*"
    words = len(event.text.split())
    return f"*Writing the answer… ({plural(words, 'word')} so far)*"


def audience_of(engine) -> Audience:
    """Who reads this engine's page: a public deployment (isolation) or the operator's own
    (``engine.visibility``: everyone's figures are coarse or withheld on the first)."""
    return Audience(public=bool(engine.isolation), bytes_per_token=engine.info().kv_bytes_per_token)


def warn(exc: Exception) -> None:
    """Show an engine error to the visitor as a toast, never a traceback."""
    msg = str(exc) if isinstance(exc, EngineError) else f"Something went wrong: {type(exc).__name__}"
    gr.Warning(msg)


def totals(history: Sequence[RequestMetrics]) -> tuple[int, int]:
    """(cached, prompt) tokens over ``history``."""
    return sum(m.cached_tokens for m in history), sum(m.prompt_tokens for m in history)
