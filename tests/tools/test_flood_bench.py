"""The flood bench runs end to end at toy scale on the tiny model (a smoke test: figures in
seconds are printed, never asserted; what is asserted does not depend on speed)."""

from __future__ import annotations

from components.chat_presets import DEFAULT_SYSTEM, HANDBOOK_SYSTEM
from tools.flood_bench import SCENARIOS, Scale, format_results, run_bench


def test_flood_bench_smoke_on_tiny_model(tiny_runner):
    scale = Scale(flood=8, flood_tokens=300, questions=2, long_tokens=400, max_new_tokens=4, tabs=3,
                  class_new_tokens=4, class_preset=DEFAULT_SYSTEM)  # the handbook is past the tiny context
    results = run_bench(tiny_runner, SCENARIOS, scale, log=lambda s: None)
    assert [r.name for r in results] == list(SCENARIOS)
    assert Scale().class_preset == HANDBOOK_SYSTEM
    for r in results:
        assert not r.refused, r.refused  # the asking visitor is never refused
        assert 503 not in r.flood_status  # one client never fills the inbox
        assert r.rss_growth <= r.rss_limit, (r.rss_growth, r.rss_limit)  # memory within budget + stated overhead
        assert r.ok
    flood, salted, long, start, classroom = results
    for r in (flood, salted):
        assert len(r.first_text_s) == 2
        # The per-client cap (4 with --isolate's inbox of 32): the rest of each flood is refused with 429.
        assert r.flood_status == {200: 2 * 4, 429: 2 * (8 - 4)}, r.flood_status
    assert len(long.first_text_s) == 2 and long.flood_status == {200: 4}
    assert len(start.first_text_s) == 1 and len(start.idle_first_text_s) == 1
    assert len(classroom.first_text_s) == 3  # every tab behind the one address got its answer
    table = format_results(results)
    assert all(name in table for name in SCENARIOS) and "p50" in table
