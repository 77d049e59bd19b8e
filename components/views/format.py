"""The one home for turning numbers into words: times, bytes, shares, counts, speed
comparisons, and clamping a control's value into range.

Every panel, figure and lab view formats through these, so one number reads the
same everywhere. Pure functions; no Gradio, no engine.
"""

from __future__ import annotations

# Below this share of the prompt served from the cache, a prefill "speedup" is timing
# noise: both runs computed (almost) every token.
NOISE_SHARE = 0.10
# Ratios this close to 1 read as "about the same" rather than faster or slower.
SAME_SPEED = 0.1


def fmt_ms(ms: float | None) -> str:
    """"475 ms" under a second, "1.6 s" from there on, "–" when not measured."""
    if ms is None:
        return "–"
    if ms < 1000:
        return f"{ms:,.0f} ms"
    return f"{ms / 1000:,.1f} s" if ms < 100_000 else f"{ms / 1000:,.0f} s"


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def fmt_pct(share: float) -> str:
    """A share in [0, 1] as a whole percentage; never "100%" unless it is all."""
    if 0.995 <= share < 1:
        return "99%"
    return f"{share:.0%}"


def fmt_ago(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s ago"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """"1 request", "2 requests", "1,024 tokens"."""
    return f"{count:,} {noun if count == 1 else (nouns or noun + 's')}"


def ratio_words(reference_ms: float, measured_ms: float) -> str:
    """How ``measured_ms`` compares with ``reference_ms``, the right way round: "3.1× faster",
    "1.4× slower" (never "0.7× faster"), or "about the same speed"."""
    if measured_ms <= 0 or reference_ms <= 0:
        return "–"
    ratio = reference_ms / measured_ms
    if abs(ratio - 1) < SAME_SPEED:
        return "about the same speed"
    return f"{ratio:.1f}× faster" if ratio > 1 else f"{1 / ratio:.1f}× slower"


def reuse_is_noise(cached_tokens: int, prompt_tokens: int) -> bool:
    """True when too little was reused for a with/without timing to mean anything."""
    return cached_tokens == 0 or not prompt_tokens or cached_tokens / prompt_tokens < NOISE_SHARE


def reuse_words(cached_tokens: int, prompt_tokens: int, baseline_ms: float | None, reuse_ms: float) -> str:
    """A with/without-reuse comparison in honest words: "3.1× faster", "1.2× slower",
    "nothing reused" (a ratio there is timing noise), or "–" when not measured."""
    if baseline_ms is None:
        return "–"
    if reuse_is_noise(cached_tokens, prompt_tokens):
        return "nothing reused" if cached_tokens == 0 else "too little reused"
    return ratio_words(baseline_ms, reuse_ms)


def clamp_int(value, default: int, low: int, high: int) -> int:
    """A control's value as an int in [low, high]; junk from an API client (text, NaN,
    infinity, None) becomes ``default``."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return default
    if number != number:  # NaN
        return default
    return int(max(low, min(high, number)))


def fmt_tokens(num_tokens: int, exact: bool = True, bucket: int = 256) -> str:
    """A token count; ``exact=False`` (a figure that includes another visitor's tokens) shows
    only the whole ``bucket`` it fits in, rounded up: "≤512"."""
    if exact or num_tokens <= 0:
        return f"{num_tokens:,}"
    return f"≤{-(-num_tokens // bucket) * bucket:,}"


def cached_line(m) -> str:
    """How much of a request's prompt came from the cache, and from which tier (a ``RequestMetrics``)."""
    share = m.cached_tokens / m.prompt_tokens if m.prompt_tokens else 0
    tier = getattr(m, "tier_tokens", 0)
    where = (f": {m.cached_tokens - tier:,} from memory, {tier:,} loaded back from the second tier in "
             f"{fmt_ms(m.tier_load_ms)} instead of recomputed") if tier else ""
    return (f"**{m.cached_tokens:,} of {m.prompt_tokens:,} prompt tokens served from the cache** "
            f"({fmt_pct(share)}){where}; {m.computed_tokens:,} computed.")


def card_head(m) -> list[str]:
    """The first lines of a request's numbers card: stopped early (if so), then ``cached_line``."""
    lines = []
    if m.finish_reason == "cancelled":
        lines += [f"**Stopped** after {plural(m.output_tokens, 'token')}: the numbers cover the partial request.", ""]
    return lines + [cached_line(m), ""]


def first_token_cell(m) -> str:
    """The time the visitor waited for the first token (from arrival), split into queue and engine."""
    if m.ttft_ms is None:
        return "– (stopped before the first token)"
    return f"{fmt_ms(m.ttft_ms)} (queue {fmt_ms(m.queue_ms)} + engine {fmt_ms(max(0.0, m.ttft_ms - m.queue_ms))})"



WITHHELD = "not shown on a public page"


def fmt_figure(figure, audience) -> str:
    """A declared figure (``engine.visibility.Figure``) as ``audience`` may see it: exact, coarse
    ("≤512" tokens or bytes, "≤4" requests, "40 or more" tokens/s), or withheld. A plain number
    is refused (``TypeError``): every figure a view shows says whose it is."""
    from engine.visibility import Unit

    shown = audience.show(figure)
    if shown.withheld:
        return WITHHELD
    v = shown.value
    if v is None:
        return "–"
    unit = figure.unit
    if unit is Unit.BYTES:
        text = fmt_bytes(int(v))
    elif unit is Unit.RATE:
        text = f"{v:,.0f}" if not shown.exact else f"{v:,.1f}"
    elif isinstance(v, float) and unit is Unit.OTHER:
        text = f"{v:,.2f}"
    else:
        text = f"{int(v):,}"
    if shown.exact:
        return text
    return f"{text} or more" if unit is Unit.RATE else f"≤{text}"
