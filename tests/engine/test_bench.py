"""The benchmark's paths compute the same logits; its table prints (tiny model, tiny sizes)."""

from __future__ import annotations

from engine.engine import Engine
from engine.tools.bench import bench_size, format_table


def test_bench_rows_on_tiny_model(tiny_runner):
    engine = Engine(tiny_runner, budget_bytes=4000 * tiny_runner.kv_bytes_per_token)
    rows = [bench_size(engine, n, 8, repeats=2) for n in (32, 64)]
    for row in rows:
        assert row["max_logit_diff"] < 1e-4
        assert row["full_ms"] > 0 and row["engine_ms"] > 0 and row["ideal_ms"] > 0
    engine.check_invariants()
    table = format_table(rows, "tiny")
    assert "| 64 | 8 |" in table
