"""The routing lab's report (issue 45): what ``tools.routing_lab --json`` writes is read back by the
Fleet tab with every field checked; a damaged or foreign file gets one clear ``ValueError`` (fuzzed),
and the table says each policy's figures beside the simulator's."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from components.views.routing_lab_report import MAX_BYTES, lab_caption, lab_table, parse_report, to_json

ROW = {"policy": "round_robin", "answered": 24, "requests": 24, "hit_rate": 0.619, "ttft_p50_s": 0.457,
       "ttft_p95_s": 1.66, "output_tokens_per_s": 23.2, "per_replica": [8, 8, 8], "held_tokens": 4000,
       "duplicate_tokens": 1000}
REPORT = {"replicas": 3, "model": "tiny", "users": 8, "turns": 3, "concurrency": 4, "max_tokens": 16,
          "machine": "AMD EPYC, 2 cores", "date": "2026-12-06",
          "rows": [ROW, {**ROW, "policy": "cache_aware", "hit_rate": 0.87, "per_replica": [6, 9, 9]},
                   {k: v for k, v in ROW.items() if k not in ("held_tokens", "duplicate_tokens")} | {"policy": "random"}],
          "predicted": {"round_robin": {"hit_rate": 0.6, "per_replica": [8, 8, 8]},
                        "cache_aware": {"hit_rate": 0.85, "per_replica": [7, 9, 8]}}}


def test_a_report_reads_back_and_says_each_policy_beside_the_simulator():
    report = parse_report(to_json(REPORT))
    lines = lab_table(report).splitlines()
    assert lines[0].startswith("| policy | answered | cached share") and lines[0].endswith("simulated per replica |")
    assert lines[2] == ("| round_robin | 24/24 | 61.9% | 457 ms | 1660 ms | 23.2 | 8 / 8 / 8 | 1,000 (25%) | 60.0% "
                        "| 8 / 8 / 8 |")
    assert lines[3].startswith("| cache_aware | 24/24 | 87.0%") and lines[3].endswith("| 85.0% | 7 / 9 / 8 |")
    assert lines[4].endswith("| - | - | - |")  # no duplication measured, no prediction for random
    caption = lab_caption(report)
    assert "3 fresh replicas per policy" in caption and "8 users x 3 turns" in caption and "2026-12-06" in caption
    assert "simulated" not in lab_table({**report, "predicted": None})


@pytest.mark.parametrize("damage, words", [
    (lambda r: "{", "not JSON"),
    (lambda r: json.dumps([1, 2]), "JSON object"),
    (lambda r: json.dumps({**r, "rows": []}), "1 to 64 rows"),
    (lambda r: json.dumps({**r, "rows": [{**ROW, "hit_rate": 1.5}]}), "share from 0 to 1"),
    (lambda r: json.dumps({**r, "rows": [{**ROW, "answered": 30}]}), "answered more"),
    (lambda r: json.dumps({**r, "rows": [{**ROW, "ttft_p50_s": "fast"}]}), "finite number"),
    (lambda r: json.dumps({**r, "rows": [{**ROW, "per_replica": [1, -1]}]}), "whole number"),
    (lambda r: json.dumps({**r, "rows": [{**ROW, "policy": None}]}), "short text"),
    (lambda r: json.dumps({**r, "replicas": True}), "whole number"),
    (lambda r: json.dumps({**r, "predicted": {"x": 3}}), "must be an object"),
    (lambda r: json.dumps({**r, "predicted": {"x": {"hit_rate": 2}}}), "share from 0 to 1"),
    (lambda r: to_json(r)[: len(to_json(r)) // 2], "not JSON"),  # a file cut short
    (lambda r: b"\xff\xfe" + to_json(r).encode(), "not JSON"),
    (lambda r: " " * (MAX_BYTES + 1), "a few kB"),
])
def test_a_damaged_or_foreign_report_gets_one_clear_error(damage, words):
    with pytest.raises(ValueError, match=words):
        parse_report(damage(REPORT))


def test_nan_and_infinity_are_refused():
    for bad in ("NaN", "Infinity"):
        text = to_json(REPORT).replace("0.457", bad, 1)
        with pytest.raises(ValueError, match="finite number"):
            parse_report(text)


JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-10, 10**6) | st.floats(allow_nan=True)
                       | st.text(max_size=20), lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=5),
                       max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(field=st.sampled_from(sorted(ROW)), value=JSONISH, head=st.sampled_from(sorted(REPORT)), other=JSONISH)
def test_any_field_replaced_by_anything_reads_or_is_refused_cleanly(field, value, head, other):
    """Fuzz: any one row field and any one top-level field replaced by any JSON value: either a
    report whose table renders, or a ValueError; nothing else escapes."""
    for raw in ({**REPORT, "rows": [{**ROW, field: value}]}, {**REPORT, head: other}):
        try:
            text = json.dumps(raw)
        except ValueError:
            continue
        try:
            report = parse_report(text)
        except ValueError:
            continue
        assert lab_table(report).count("\n") == len(report["rows"]) + 1
        lab_caption(report)
