"""Shipped prefixes in the cache before the first visitor, and the growth curve's filler.

Owns which shipped blocks are warmed (every system preset and few-shot set, as the chat
and few-shot panels will send them, keyed by the engine for any page visitor, as those requests are), the
page's sentence about it, which document the chat opens on for this engine's device,
and the text the growth curve measures on. The timing itself is
``analysis.prefill_timing``; this module only hands it keys and ids.
"""

from __future__ import annotations

import logging
import threading
import time

from analysis.prefill_timing import timer_for
from components.chat_presets import FEW_SHOT_PRESETS, SYSTEM_PRESETS, chat_messages, default_scenario, few_shot_prompt
from components.session import page_keyed
from components.views.format import fmt_ms, plural
from engine.cache_keys import shipped_part
from engine.types import CacheKey, EngineError, GenerationRequest

log = logging.getLogger(__name__)

GROWTH_PAIRS = {"cpu": 1}  # pairs per length: one on a CPU (the curve costs ~25 s there), else 3


def _public_key(engine, messages: list[dict]) -> CacheKey | None:
    """The shipped part of the request ``messages`` would make, keyed as that request keys it
    (any visitor's: the shipped part is everyone's)."""
    return shipped_part(page_keyed(engine, GenerationRequest(messages=tuple(messages)), None).key)


def shipped_prefixes(engine) -> list[tuple[str, CacheKey]]:
    """(label, key) of every shipped block, the chat's default document first. A block too long
    for the engine's prompt cap is left out (its requests would be refused anyway)."""
    first = chat_default(engine)
    names = [first] + [n for n in SYSTEM_PRESETS if n != first]
    out = []
    for name in names:
        msgs = chat_messages(SYSTEM_PRESETS[name], [], "?")
        out.append((f"system prompt “{name}”", msgs))
    for name, preset in FEW_SHOT_PRESETS.items():
        msgs = [{"role": "user", "content": few_shot_prompt(preset["instruction"], preset["examples"], "?")}]
        out.append((f"few-shot set “{name}”", msgs))
    keys = []
    for label, msgs in out:
        try:
            key = _public_key(engine, msgs)
        except EngineError:  # longer than this engine's prompt cap
            continue
        if key is not None:
            keys.append((label, key))
    return keys


def warm_start(engine) -> tuple:
    """Prefill every shipped block into the cache now (before the page is served); returns the
    ``WarmPrefix`` results, which the page reads back through ``timer_for(engine).warmed``."""
    timer = timer_for(engine)
    if timer is None:  # remote mode: the backend owns its cache
        return ()
    t0 = time.perf_counter()
    warmed = timer.warm(shipped_prefixes(engine))
    done = [w for w in warmed if not w.skipped]
    log.info("Warm start: %s (%s tokens) in the cache in %.1f s", plural(len(done), "shipped prefix", "shipped prefixes"),
             f"{sum(w.num_tokens for w in done):,}", time.perf_counter() - t0)
    return warmed


def warm_note(engine) -> str:
    """The page's sentence about the warm start ("" when nothing was warmed)."""
    timer = timer_for(engine)
    warmed = [w for w in (timer.warmed if timer else ()) if not w.skipped]
    if not warmed:
        return ""
    first = warmed[0]
    spent = sum(w.prefill_ms for w in warmed)
    cost = (f"; computing the first, {first.num_tokens:,} tokens, took {fmt_ms(first.prefill_ms)}"
            if first.computed_tokens else "")
    return (f"**Warm start:** the app put its shipped prompts in the cache when it started "
            f"({plural(len(warmed), 'prefix', 'prefixes')}, {sum(w.num_tokens for w in warmed):,} tokens, "
            f"{fmt_ms(spent)} in all{cost}), so your first question under them is already a cache hit.")


def system_tokens(engine, text: str) -> int:
    """Tokens of ``text`` as a system block in this model's chat template."""
    return len(engine.encode(engine.render_chat([{"role": "system", "content": text}], add_generation_prompt=False)))


def chat_default(engine) -> str:
    """The preset the chat opens on for this engine (``chat_presets.default_scenario``)."""
    device = str(engine.info().device).split(":")[0]
    return default_scenario(device, lambda text: system_tokens(engine, text), engine.max_prompt_tokens)


def growth_filler(engine, num_tokens: int) -> list[int]:
    """Token ids to cache for the growth curve: the shipped handbook and catalogue, repeated."""
    from components.chat_presets import NORTHWIND_CATALOGUE, NORTHWIND_HANDBOOK

    piece = engine.encode(NORTHWIND_HANDBOOK + "\n\n" + NORTHWIND_CATALOGUE + "\n\n")
    return (piece * (num_tokens // len(piece) + 1))[:num_tokens]


def start_growth_curve(engine) -> threading.Thread | None:
    """Measure the growth curve in a background thread (kept by the engine's timer); None in
    remote mode or while one is already running."""
    from analysis.prefill_timing import GROWTH_LENGTHS, GROWTH_SUFFIX_TOKENS

    timer = timer_for(engine)
    if timer is None or timer.curve.state == "running":
        return None
    device = str(engine.info().device).split(":")[0]
    filler = growth_filler(engine, max(GROWTH_LENGTHS) + GROWTH_SUFFIX_TOKENS)

    def measure():
        curve = timer.growth_curve(filler, pairs=GROWTH_PAIRS.get(device, 3))
        if curve.state != "done" and timer.stopping():
            return  # the app is shutting down: nothing to report
        log.info("Growth curve: %s", "; ".join(f"{p.cached_tokens:,} cached: {p.reuse_ms:.0f} vs {p.full_ms:.0f} ms"
                                                for p in curve.points) or curve.error)

    thread = threading.Thread(target=measure, name="growth-curve", daemon=True)
    thread.start()
    return thread
