"""The serving benchmark runs end to end on the tiny model (a smoke test; figures are not asserted)."""

from __future__ import annotations

from tools.measure import MachineLimits
from tools.serve_bench import format_table, run_bench


def test_serve_bench_smoke_on_tiny_model(tiny_runner):
    rows = run_bench(tiny_runner, streams=[1, 3], n_requests=3, max_new_tokens=3, engines=["one", "batched", "hf"],
                     log=lambda s: None, limits=MachineLimits(20e9, 100e9))
    assert len(rows) == 6
    for row in rows:
        assert row.output_tokens > 0 and len(row.ttft_ms) == 3
        if row.engine != "hf":
            assert row.identical == 3
        assert row.limit_tokens_per_s > 0  # each row beside its step's limit
    table = format_table(rows, "tiny")
    assert "limit tokens/s (share)" in table and "%) |" in table
    assert "continuous batching" in table and "x transformers generate_batch" in table
