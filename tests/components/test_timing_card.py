"""The headline demo without a browser (tiny random Llama): shipped prefixes are warmed with the
exact keys the chat and few-shot panels use, so the first starter click is a hit; the card
compares the paired timing and says how it was measured (memo included); the side card shows
the same pair; the default document is chosen per device by rule; the growth panel's words."""

from __future__ import annotations

import dataclasses

import pytest

from analysis.prefill_timing import GrowthCurve, GrowthPoint, PrefillPair, PrefillTiming
from components.chat_presets import (
    CATALOGUE_SYSTEM,
    HANDBOOK_SYSTEM,
    SHORT_SYSTEM,
    STARTERS_BY_PRESET,
    SYSTEM_PRESETS,
    default_scenario,
)
from components.panels.chat_panel import respond
from components.panels.growth_panel import curve_markdown
from components.panels.overview_panel import key_numbers_html
from components.views.timing_view import speed_card, turn_markdown
from components.warm_start import chat_default, shipped_prefixes, warm_note, warm_start
from engine.types import GenerationRequest


@pytest.fixture
def engine(make_engine):
    e = make_engine(max_new_tokens_cap=6)
    yield e


def chat(engine, question, history, preset):
    *_, last = respond(engine, question, history, preset, "", 4, True)
    return last


def test_documents_chosen_by_device_and_what_fits():
    def count(text: str) -> int:  # a rough token count
        return len(text.split()) * 3 // 2

    words = {name: count(text) for name, text in SYSTEM_PRESETS.items()}
    assert words[HANDBOOK_SYSTEM] > 2000 and words[CATALOGUE_SYSTEM] > words[HANDBOOK_SYSTEM] + 500
    assert default_scenario("cpu", count, 8192) == HANDBOOK_SYSTEM
    assert default_scenario("mps", count, 8192) == HANDBOOK_SYSTEM
    assert default_scenario("cuda", count, 8192) == CATALOGUE_SYSTEM
    assert default_scenario("cuda", count, words[CATALOGUE_SYSTEM] + 100) == HANDBOOK_SYSTEM  # no room to talk
    assert default_scenario("cpu", count, 1024) == SHORT_SYSTEM  # a small-context model
    assert STARTERS_BY_PRESET[HANDBOOK_SYSTEM][1] == "How much does express shipping cost?"
    # The starters' answers are in the text (the tiny model guesses less on those).
    handbook = SYSTEM_PRESETS[HANDBOOK_SYSTEM]
    assert "2-year warranty" in handbook and "costs $15" in handbook and "rents for $20 a day" in handbook


def test_warm_start_makes_the_first_starter_click_a_hit_and_the_card_compares_a_pair(engine):
    first = chat_default(engine)  # the tiny model's context is short: the short support prompt
    assert first == SHORT_SYSTEM
    labels = [label for label, _ in shipped_prefixes(engine)]
    assert labels[0] == f"system prompt “{first}”" and any("few-shot" in label for label in labels)
    warmed = warm_start(engine)
    assert warmed[0].computed_tokens == warmed[0].num_tokens  # later ones share the template's opening
    assert all(0 < w.computed_tokens <= w.num_tokens for w in warmed if not w.skipped)
    assert "Warm start" in warm_note(engine) and "already a cache hit" in warm_note(engine)
    key = dict(shipped_prefixes(engine))[f"system prompt “{first}”"]

    history, _, _, numbers, metrics, stored = chat(engine, STARTERS_BY_PRESET[first][0], [], first)
    assert metrics.cached_tokens == key.public_len == len(key.ids)  # the very first click hits
    request_id, timing = stored
    assert request_id == metrics.request_id and timing.full_ms and timing.reuse_ms
    assert len(timing.pairs) == 3 and "Median of 3 pairs" in numbers and "live, in the batch" in numbers
    assert metrics.baseline_prefill_ms is None  # the paired timing replaces the in-batch baseline
    check = timing.logits  # both sides ran: the card says what their logits were, bit for bit or not
    assert check is not None and (check.full_digest in numbers) and (check.reuse_digest in numbers)
    assert ("Bit for bit" in numbers) == check.identical and ("Not bit for bit" in numbers) != check.identical
    html = key_numbers_html(engine, metrics, "", timing)
    value, _ = speed_card(metrics, timing)
    assert value in html and "median of 3 pairs" in html


def test_card_says_when_the_no_reuse_figure_came_from_the_memo(engine):
    m = engine.run(GenerationRequest(prompt="hello there"))
    m = dataclasses.replace(m, prompt_tokens=2400, cached_tokens=2380, computed_tokens=20)
    t = PrefillTiming(prompt_tokens=2400, cached_tokens=2380, pairs=(PrefillPair(100, 3000),) * 3, reuse_ms=100,
                      full_ms=3000, full_measured_at=0.0, full_from_memo=True, full_runs=3, block_tokens=512)
    text = turn_markdown(m, t)
    assert "30.0× faster" in text and "measured at 00:00:00 UTC" in text and "reused since" in text
    assert "bit for bit" not in text.lower()  # the no-reuse side did not run now: no claim either way
    skipped = dataclasses.replace(t, full_ms=None, reuse_ms=None, pairs=(), skipped="one pair would run too much")
    assert "No paired timing: one pair would run too much." in turn_markdown(m, skipped)
    assert speed_card(m, skipped) is None


def test_card_states_what_the_logits_comparison_found(engine):
    from analysis.prefill_timing import LogitsCheck

    m = engine.run(GenerationRequest(prompt="hello there"))
    m = dataclasses.replace(m, prompt_tokens=400, cached_tokens=380, computed_tokens=20)
    base = PrefillTiming(prompt_tokens=400, cached_tokens=380, pairs=(PrefillPair(10, 90),), reuse_ms=10, full_ms=90,
                         full_measured_at=0.0, full_runs=1, block_tokens=512)
    same = LogitsCheck(True, 0.0, True, "a" * 16, "a" * 16)
    assert "**Bit for bit:**" in turn_markdown(m, dataclasses.replace(base, logits=same))
    close = LogitsCheck(False, 1.19e-7, True, "b" * 16, "c" * 16)
    text = turn_markdown(m, dataclasses.replace(base, logits=close))
    assert "**Not bit for bit:**" in text and "1.2e-07" in text and "the first new token is the same" in text
    flip = dataclasses.replace(close, same_next_token=False)
    assert "first new token differs" in turn_markdown(m, dataclasses.replace(base, logits=flip))


def test_growth_panel_words():
    assert "Not measured yet" in curve_markdown(GrowthCurve(), False)
    points = (GrowthPoint(256, 32, 120, 600, 1), GrowthPoint(4096, 32, 300, 12000, 1))
    done = GrowthCurve(state="done", points=points, device="cpu", dtype="float32", finished_at=0.0,
                       lengths=(256, 4096))
    text = curve_markdown(done, True)
    assert "On a CPU" in text and "On a GPU" in text and "1 pair per length" in text and "once for everyone" in text
    running = dataclasses.replace(done, state="running", points=points[:1])
    assert "1 of 2 lengths" in curve_markdown(running, False)


def test_the_history_panels_count_the_chats_paired_timing(engine):
    """The chat measures its no-reuse figure as a pair after the answer (not in the batch); the
    latency tab and the memory tab's "prefill time saved" read that pair back, not a blank."""
    from components.panels.common import playground_history
    from components.panels.latency_panel import latency_summary
    from components.panels.memory_panel import memory_markdown

    warm_start(engine)
    first = chat_default(engine)
    *_, metrics, (request_id, timing) = chat(engine, STARTERS_BY_PRESET[first][0], [], first)
    assert metrics.baseline_prefill_ms is None
    seen = {m.request_id: m for m in playground_history(engine)}[request_id]
    assert (seen.prefill_ms, seen.baseline_prefill_ms) == (timing.reuse_ms, timing.full_ms)
    assert "No request has measured" not in latency_summary(playground_history(engine))
    assert "over 1 request that measured prefill" in memory_markdown(engine, playground_history(engine), None)


def test_side_cards_show_the_answer_while_its_paired_timing_runs(engine):
    """The share card fills as soon as the answer ends; the speed card says the timing is under way
    (it used to stay blank for the whole timing, 25 s on a 2,300-token prompt on this CPU)."""
    from components.views.timing_view import PENDING, timing_pending

    first = chat_default(engine)
    warm_start(engine)
    steps = list(respond(engine, STARTERS_BY_PRESET[first][0], [], first, "", 4, True))
    during = [s for s in steps if isinstance(s[5], tuple) and s[5][1] == PENDING]
    assert during, "no step shows the answer before its timing"
    metrics, stored = during[0][4], during[0][5]
    assert metrics is not None and metrics.cached_tokens > 0 and timing_pending(metrics, stored)
    html = key_numbers_html(engine, metrics, "", None, pending=True)
    assert "timing…" in html and f"{metrics.cached_tokens:,} of {metrics.prompt_tokens:,} tokens" in html
    *_, last_metrics, last_stored = steps[-1]
    assert last_stored[0] == metrics.request_id and last_stored[1] != PENDING  # then the pair itself
    assert not timing_pending(last_metrics, last_stored)
