"""Small helpers shared by the panels: number formatting, the token colouring, errors."""

from __future__ import annotations

import gradio as gr

from engine.types import EngineError, RequestMetrics

CACHED, COMPUTED = "cached", "computed"
TOKEN_COLORS = {CACHED: "#22c55e", COMPUTED: "#f97316"}


def fmt_ms(ms: float | None) -> str:
    if ms is None:
        return "–"
    return f"{ms / 1000:.2f} s" if ms >= 10_000 else f"{ms:,.0f} ms"


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


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


def metrics_markdown(m: RequestMetrics) -> str:
    share = m.cached_tokens / m.prompt_tokens if m.prompt_tokens else 0
    lines = [
        f"**{m.cached_tokens:,} of {m.prompt_tokens:,} prompt tokens served from the cache** "
        f"({share:.0%}); {m.computed_tokens:,} computed.",
        "",
        "| prefill with reuse | prefill without reuse | speedup | time to first token | decode |",
        "|---|---|---|---|---|",
        f"| {fmt_ms(m.prefill_ms)} | {fmt_ms(m.baseline_prefill_ms)} | "
        f"{f'{m.speedup:.1f}×' if m.speedup else '–'} | {fmt_ms(m.ttft_ms)} | "
        f"{f'{m.decode_tokens_per_s:.1f} tok/s' if m.decode_tokens_per_s else '–'} |",
    ]
    if m.baseline_prefill_ms is None:
        lines.append("\n*No-reuse measurement off: tick “Measure prefill without reuse” to compare.*")
    if getattr(m, "cached_tokens_reported", None) is not None:  # remote mode (server.remote_engine)
        lines.append("\n*Remote server: prefill times are times to first token measured here; without reuse = the "
                     "same prompt under a fresh cache salt.*")
        if not m.cached_tokens_reported:
            lines.append("\n**Cached tokens unknown:** the server did not report them (start vLLM with "
                         "`--enable-prompt-tokens-details`, SGLang with `--enable-cache-report`).")
    return "\n".join(lines)


def warn(exc: Exception) -> None:
    """Show an engine error to the visitor as a toast, never a traceback."""
    msg = str(exc) if isinstance(exc, EngineError) else f"Something went wrong: {type(exc).__name__}"
    gr.Warning(msg)
