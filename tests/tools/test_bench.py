"""The benchmark's paths compute the same logits; its tables print (tiny model, tiny sizes), in fp32 and bf16
side by side, with the greedy tokens compared with and without reuse."""

from __future__ import annotations

from engine.model import loader
from tools import bench
from tools.bench import bench_size, format_dtype_table, format_table


def test_bench_rows_on_tiny_model(tiny_runner, make_engine):
    engine = make_engine(budget_bytes=4000 * tiny_runner.kv_bytes_per_token)
    rows = [bench_size(engine, n, 8, repeats=2, greedy_tokens=6) for n in (32, 64)]
    for row in rows:
        assert row["max_logit_diff"] < 1e-4
        assert row["full_ms"] > 0 and row["engine_ms"] > 0 and row["ideal_ms"] > 0
        assert row["dtype"] == "float32" and row["greedy_same"] == row["greedy_tokens"] > 0
    engine.check_invariants()
    table = format_table(rows, "tiny")
    assert "| 64 | 8 | float32 |" in table and "| 6 of 6 |" in table


def test_bench_tier_row_loads_the_prefix_back_exactly(tiny_runner, tmp_path, make_engine):
    engine = make_engine(budget_bytes=4000 * tiny_runner.kv_bytes_per_token, tier_bytes=2**26,
                         tier_dir=str(tmp_path))
    row = bench_size(engine, 128, 8, repeats=2, greedy_tokens=0)
    assert row["tier_ms"] > 0 and row["max_logit_diff"] < 1e-4
    assert engine.stats().tier_loaded_tokens >= 2 * 128
    assert "x |" in format_table([row], "tiny").splitlines()[-1]
    engine.check_invariants()


def test_fp32_and_bf16_side_by_side_in_one_run(tiny_runner, tiny_runner_bf16, monkeypatch, capsys):
    """``--dtypes float32,bfloat16`` loads the model once per dtype and prints both, plus the comparison."""
    runners = {"float32": tiny_runner, "bfloat16": tiny_runner_bf16}
    asked = []

    def fake_load(model, device, dtype):
        asked.append(dtype)
        r = runners[dtype]
        return loader.LoadedModel(model=r.model, tokenizer=r.text.tokenizer, name="tiny", device=r.device,
                                        dtype=r.dtype)

    monkeypatch.setattr(loader, "load_model", fake_load)
    assert bench.main(["--sizes", "32", "--suffix", "4", "--repeats", "1", "--greedy-tokens", "4",
                       "--dtypes", "float32,bfloat16"]) == 0
    out = capsys.readouterr().out
    assert asked == ["float32", "bfloat16"]
    assert "| 32 | 4 | float32 |" in out and "| 32 | 4 | bfloat16 |" in out
    assert "full prefill vs float32" in out
    half = tiny_runner_bf16.kv_bytes_per_token
    assert "| 32 | bfloat16 | " in out and f"| {half:,} | 4 of 4 |" in out and half * 2 == tiny_runner.kv_bytes_per_token


def test_dtype_table_compares_each_dtype_with_the_first():
    rows = [dict(cached=8, dtype=d, full_ms=f, engine_ms=e, speedup=f / e, kv_bytes_per_token=b, greedy_same=s,
                 greedy_tokens=16) for d, f, e, b, s in [("float32", 100.0, 10.0, 8, 16), ("bfloat16", 50.0, 8.0, 4, 11)]]
    table = format_dtype_table(rows)
    assert "| 8 | float32 | 1.00x | 1.00x | 10.0x | 8 | 16 of 16 |" in table
    assert "| 8 | bfloat16 | 2.00x | 1.25x | 6.2x | 4 | 11 of 16 |" in table
