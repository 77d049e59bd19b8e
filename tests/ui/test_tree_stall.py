"""A small run of the tree-stall script (tools/tree_stall.py) on the tiny random Llama: the tree
is filled by real prefills without eviction, each mode streams, the tab sessions tick and draw
through the tree panel's own refresh, the API sessions call the endpoint, and the report's
numbers are sane. No timing is asserted (the machine is noisy); the figures come from
``python tools/tree_stall.py`` on a quiet machine."""

from __future__ import annotations

import math

from tools.tree_stall import MODES, build_engine, format_report, measure


def test_a_small_stall_run_reports_sane_numbers(tiny_runner):
    engine = build_engine(tiny_runner, 60, 6, isolate=True)
    try:
        report = measure(engine, 60, sessions=2, new_tokens=6, rounds=1, log=lambda s: None)
    finally:
        engine.close()
    assert not report.errors, report.errors
    assert report.num_nodes >= 60 and report.evicted_tokens == 0
    assert report.tick_s > 0 and report.sessions == 2
    for mode in MODES:
        gaps = report.gaps_ms[mode]
        assert report.tokens[mode] == [len(gaps) + 1] and len(gaps) >= 1
        assert all(math.isfinite(g) and g >= 0 for g in gaps)
        assert report.p95(mode) >= report.median(mode) > 0
    assert report.calls[MODES[0]] == 0
    assert report.calls[MODES[1]] >= 2 and report.redraws >= 2  # every tab drew once before the stream
    assert report.calls[MODES[2]] >= 2
    text = format_report(report)
    assert "RESULT: " in text and all(m in text for m in MODES)
