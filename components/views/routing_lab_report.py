"""The routing lab's report (issue 45): what ``python -m tools.routing_lab --json FILE`` writes and the
Fleet tab shows (``app.py --routing-lab FILE``), read and put into words in one place.

A report is JSON: the fleet and the trace it ran (``replicas``, ``model``, ``users``, ``turns``,
``concurrency``, ``max_tokens``, ``machine``, ``date``), one row per policy measured on fresh replicas
behind the real router (``rows``: ``policy``, ``answered``, ``requests``, ``hit_rate``,
``ttft_p50_s``, ``ttft_p95_s``, ``output_tokens_per_s``, ``per_replica``, and where the lab followed
the replicas' events ``duplicate_tokens`` and ``held_tokens``), and what the fleet simulator
predicted for the same trace (``predicted``: policy -> ``hit_rate`` and ``per_replica``, or null).
``parse_report`` checks every field (a file from elsewhere is input like any other: a clear
``ValueError``, nothing half-read); ``lab_table`` and ``lab_caption`` are the words. Pure: no file
I/O, no Gradio.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_BYTES = 1 << 20  # a report is a few kB; anything larger is not one
MAX_ROWS = 64
_ROW_NUMBERS = ("hit_rate", "ttft_p50_s", "ttft_p95_s", "output_tokens_per_s")
_ROW_COUNTS = ("answered", "requests")
_OPTIONAL_COUNTS = ("duplicate_tokens", "held_tokens")
_HEAD_TEXT = ("model", "machine", "date")
_HEAD_COUNTS = ("replicas", "users", "turns", "concurrency", "max_tokens")


def _count(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > 10**12:
        raise ValueError(f"{what} must be a whole number from 0, not {v!r:.40}")
    return v


def _number(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{what} must be a finite number from 0, not {v!r:.40}")
    return float(v)


def _per_replica(v: Any, what: str) -> list[int]:
    if not isinstance(v, list) or len(v) > 1024:
        raise ValueError(f"{what} must be a list of request counts")
    return [_count(x, what) for x in v]


def _text(v: Any, what: str) -> str:
    if not isinstance(v, str) or len(v) > 200:
        raise ValueError(f"{what} must be a short text")
    return v.replace("|", "/").replace("\n", " ")


def _row(r: Any, i: int) -> dict:
    if not isinstance(r, dict):
        raise ValueError(f"row {i} must be an object")
    out: dict[str, Any] = {"policy": _text(r.get("policy"), f"row {i}'s policy")}
    for k in _ROW_NUMBERS:
        out[k] = _number(r.get(k), f"row {i}'s {k}")
    if out["hit_rate"] > 1:
        raise ValueError(f"row {i}'s hit_rate must be a share from 0 to 1")
    for k in _ROW_COUNTS:
        out[k] = _count(r.get(k), f"row {i}'s {k}")
    if out["answered"] > out["requests"]:
        raise ValueError(f"row {i} answered more requests than it sent")
    out["per_replica"] = _per_replica(r.get("per_replica", []), f"row {i}'s per_replica")
    for k in _OPTIONAL_COUNTS:
        if r.get(k) is not None:
            out[k] = _count(r[k], f"row {i}'s {k}")
    return out


def parse_report(text: str | bytes) -> dict:
    """A report from its JSON text, every field checked; ``ValueError`` with the first thing wrong."""
    if len(text) > MAX_BYTES:
        raise ValueError(f"a routing-lab report is a few kB; this is {len(text):,} bytes")
    try:
        raw = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("a routing-lab report is a JSON object")
    rows = raw.get("rows")
    if not isinstance(rows, list) or not rows or len(rows) > MAX_ROWS:
        raise ValueError(f"a report has 1 to {MAX_ROWS} rows, one per policy")
    report: dict[str, Any] = {"rows": [_row(r, i) for i, r in enumerate(rows)]}
    for k in _HEAD_COUNTS:
        report[k] = _count(raw.get(k, 0), k)
    for k in _HEAD_TEXT:
        report[k] = _text(raw.get(k, ""), k)
    predicted = raw.get("predicted")
    if predicted is not None:
        if not isinstance(predicted, dict) or len(predicted) > MAX_ROWS:
            raise ValueError("predicted must map policies to the simulator's runs")
        report["predicted"] = {}
        for name, run in predicted.items():
            if not isinstance(run, dict):
                raise ValueError(f"the prediction for {name!r:.40} must be an object")
            share = _number(run.get("hit_rate"), f"the predicted hit_rate of {name!r:.40}")
            if share > 1:
                raise ValueError(f"the predicted hit_rate of {name!r:.40} must be a share from 0 to 1")
            report["predicted"][_text(name, "a predicted policy")] = {
                "hit_rate": share, "per_replica": _per_replica(run.get("per_replica", []), "predicted per_replica")}
    else:
        report["predicted"] = None
    return report


def _dup(r: dict) -> str:
    if r.get("held_tokens") is None or r.get("duplicate_tokens") is None:
        return "-"
    held = r["held_tokens"]
    return f"{r['duplicate_tokens']:,} ({r['duplicate_tokens'] / held:.0%})" if held else "0"


def lab_table(report: dict) -> str:
    """One row per policy: measured through the real router, and the simulator's prediction beside it."""
    predicted = report.get("predicted")
    head = ("| policy | answered | cached share | TTFT p50 | TTFT p95 | output tok/s | requests per replica "
            "| duplicate tokens (of held) |")
    rule = "|---|---:|---:|---:|---:|---:|---|---:|"
    if predicted is not None:
        head, rule = head + " simulated share | simulated per replica |", rule + "---:|---|"
    lines = [head, rule]
    for r in report["rows"]:
        line = (f"| {r['policy']} | {r['answered']}/{r['requests']} | {r['hit_rate']:.1%} | "
                f"{r['ttft_p50_s'] * 1000:.0f} ms | {r['ttft_p95_s'] * 1000:.0f} ms | "
                f"{r['output_tokens_per_s']:.1f} | {' / '.join(map(str, r['per_replica']))} | {_dup(r)} |")
        if predicted is not None:
            run = predicted.get(r["policy"])
            line += (f" {run['hit_rate']:.1%} | {' / '.join(map(str, run['per_replica']))} |" if run is not None
                     else " - | - |")
        lines.append(line)
    return "\n".join(lines)


def lab_caption(report: dict) -> str:
    """What the table measured: the fleet, the trace, the machine and the day."""
    parts = [f"{report['replicas']} fresh replicas per policy" if report["replicas"] else "",
             f"model {report['model']}" if report["model"] else "",
             f"the built-in trace: {report['users']} users x {report['turns']} turns, {report['concurrency']} at a "
             f"time, {report['max_tokens']} new tokens each" if report["users"] else "",
             report["machine"], report["date"]]
    return "; ".join(p for p in parts if p)


def to_json(report: dict) -> str:
    """The report as ``parse_report`` reads it back (checked on the way out too)."""
    text = json.dumps(report, indent=1)
    parse_report(text)
    return text
