"""The paired prefill timing in words: the chat's numbers card and the side card's figure.

Owns how a ``analysis.prefill_timing.PrefillTiming`` reads on the page: which two numbers
the card compares (the median pair, timed back to back after the answer), how they were
measured (pairs, blocks, the memo's time for a long shipped prefix), and the live figure
from inside the batch, labelled as such. Pure: plain data in, Markdown out.
"""

from __future__ import annotations

import time

from analysis.prefill_timing import PrefillTiming
from components.views.format import card_head, first_token_cell, fmt_ms, plural, reuse_is_noise, reuse_words
from engine.types import RequestMetrics
from engine.visibility import everyone

TIMING_STATUS = ("*Answer done. Now timing prefill with and without reuse, back to back on the model's thread "
                 "(the same prompt, up to three pairs)…*")


def timing_for(m: RequestMetrics | None, stored) -> PrefillTiming | None:
    """The visitor's stored ``(request_id, timing)`` if it belongs to ``m``, else None."""
    if m is None or not stored:
        return None
    request_id, timing = stored
    return timing if request_id == m.request_id and isinstance(timing, PrefillTiming) else None


PENDING = "pending"  # the stored timing while it runs: ``(request_id, PENDING)``


def timing_pending(m: RequestMetrics | None, stored) -> bool:
    """The paired timing of ``m`` is under way (the chat stored ``(request_id, PENDING)``)."""
    return m is not None and bool(stored) and stored[0] == m.request_id and stored[1] == PENDING


def wants_timing(m: RequestMetrics) -> bool:
    """Worth a paired timing: the answer finished and a real share of the prompt was reused."""
    return m.finish_reason != "cancelled" and not reuse_is_noise(m.cached_tokens, m.prompt_tokens)


def _clock(ts: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(ts))


def how_measured(t: PrefillTiming) -> str:
    """One or two sentences: what the two compared numbers are and when they were taken."""
    if t.full_ms is None or t.reuse_ms is None:
        return f"No paired timing: {t.skipped}." if t.skipped else ""
    ratios = ", ".join(f"{p.ratio:.0f}×" if p.ratio >= 10 else f"{p.ratio:.1f}×" for p in t.pairs)
    blocks = f", {t.block_tokens:,} tokens per call" if t.block_tokens and t.block_tokens < t.prompt_tokens else ""
    if t.full_from_memo:
        return (f"With reuse: timed after the answer on the model's thread ({t.cached_tokens:,} tokens copied from "
                f"the cache, {t.prompt_tokens - t.cached_tokens:,} computed), median of "
                f"{plural(len(t.pairs), 'run')}. Without reuse: measured at {_clock(t.full_measured_at)} for this "
                f"shipped prompt and a {t.prompt_tokens:,}-token prompt (every token computed{blocks}, median of "
                f"{plural(t.full_runs, 'run')}) and reused since, so that a public page does not prefill it again "
                "for every visitor.")
    runs = f"; each pair's with-reuse figure is the median of {t.reuse_runs} runs" if t.reuse_runs > 1 else ""
    return (f"Both timed after the answer, back to back on the model's thread, on the same {t.prompt_tokens:,} "
            f"tokens: {t.cached_tokens:,} copied from the cache then the rest computed, against every token "
            f"computed{blocks}. Median of {plural(len(t.pairs), 'pair')} ({ratios}){runs}.")


def logits_sentence(t: PrefillTiming) -> str:
    """Did reuse change what the model computed for this prompt? Both sides' last-token logits,
    compared bit for bit when the timing ran both (``PrefillTiming.logits``); "" otherwise."""
    c = t.logits
    if c is None:
        return ""
    if c.identical:
        return (f"**Bit for bit:** the prompt's last-token logits with reuse and without are identical (digest "
                f"`{c.full_digest}` on both sides): reuse changed nothing the model computed here.")
    pick = ("the first new token is the same" if c.same_next_token else
            "**and the first new token differs** (a near tie between two tokens)")
    return (f"**Not bit for bit:** the prompt's last-token logits with reuse and without differ by at most "
            f"{c.max_abs_diff:.1e} (digests `{c.reuse_digest}` and `{c.full_digest}`); {pick}. The two sides run the "
            "model over different numbers of tokens per forward, and PyTorch's kernels then add the same numbers in "
            "another order (this app's own, the default on a CPU, do not).")


def turn_markdown(m: RequestMetrics, t: PrefillTiming | None, running: bool = False) -> str:
    """The chat's numbers card with the paired timing (``running``: it is being measured now)."""
    paired = t is not None and t.full_ms is not None
    reuse_ms = t.reuse_ms if paired else None
    full_ms = t.full_ms if paired else None
    if reuse_is_noise(m.cached_tokens, m.prompt_tokens):
        compared = "nothing reused" if m.cached_tokens == 0 else "too little reused"
    else:
        compared = reuse_words(m.cached_tokens, m.prompt_tokens, full_ms, reuse_ms or 0) if paired else "–"
    decode = f"{m.decode_tokens_per_s:.1f} tok/s" if m.decode_tokens_per_s else "–"
    lines = card_head(m) + [
        "| prefill with reuse | without reuse | compared | live, in the batch | first text after | decode |",
        "|---|---|---|---|---|---|",
        f"| {fmt_ms(reuse_ms)} | {fmt_ms(full_ms)} | {compared} | {fmt_ms(m.prefill_ms)} | "
        f"{first_token_cell(m)} | {decode} |",
    ]
    notes = []
    if running:
        notes.append(TIMING_STATUS.strip("*"))
    elif t is not None:
        notes.append(how_measured(t))
        notes.append(logits_sentence(t))
    elif reuse_is_noise(m.cached_tokens, m.prompt_tokens) and m.finish_reason != "cancelled":
        what = "Nothing was reused" if m.cached_tokens == 0 else f"Only {m.cached_tokens:,} tokens were reused"
        notes.append(f"{what}, so there is no with/without comparison to make: both would compute (almost) "
                     "every token.")
    live = "Live = this request's own prefill inside the engine's batched step"
    if m.prefill_shared_step or (everyone(m.batch_size_max).value or 1) > 1:  # how many others: not said
        live += ", shared with other requests' work, so it reads high"
    notes.append(live + ".")
    return "\n".join(lines + ["", " ".join(f"*{n}*" for n in notes if n)])


def speed_card(m: RequestMetrics, t: PrefillTiming) -> tuple[str, str] | None:
    """(value, label) for the side card from a paired timing; None when it has no no-reuse side."""
    if t.full_ms is None or t.reuse_ms is None:
        return None
    words = reuse_words(m.cached_tokens, m.prompt_tokens, t.full_ms, t.reuse_ms)
    times = f"{fmt_ms(t.reuse_ms)} with reuse vs {fmt_ms(t.full_ms)} without"
    how = ("without-reuse figure measured earlier for this prompt length" if t.full_from_memo
           else f"back to back, median of {plural(len(t.pairs), 'pair')}")
    if words.startswith("about"):
        return "≈ 1×", f"prefill at about the same speed: {times} ({how})"
    value, _, rest = words.partition(" ")
    return value, f"{rest} prefill: {times} ({how})"
