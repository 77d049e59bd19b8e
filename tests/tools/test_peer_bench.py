"""The peer benchmark: its arguments, and its figures against this app's own /v1 served on the tiny model."""

from __future__ import annotations

import dataclasses

import pytest

from tests.helpers_app import launched_app
from tools.peer_bench import bench_server, conversations_for, format_table, parse_args


def test_arguments():
    args = parse_args(["--url", "http://x", "--streams", "1, 8,16", "--dtype", "float32", "--also", "6000:16"])
    assert args.url == ["http://x"] and args.streams == [1, 8, 16] and args.dtype == "float32"
    assert args.also == [(6000, [16])]
    assert args.max_tokens == 32 and args.requests == 16 and args.system_tokens == 2300
    for bad in ([], ["--url", "u", "--streams", "0"], ["--url", "u", "--max-tokens", "0"],
                ["--vllm", "--vllm-venv", "/nonexistent"], ["--url", "u", "--also", "x:1"], ["--url", "u", "--also", "6:a"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_figures_against_our_app_on_the_tiny_model(make_engine):
    conversations = conversations_for(0, 4, 5)
    assert len({c[1]["content"] for c in conversations}) == 4 and len({c[0]["content"] for c in conversations}) == 1
    engine = make_engine(budget_bytes=64 * 2**20, max_new_tokens_cap=64)
    with launched_app(engine) as url:
        rows = bench_server(url, "tiny", conversations, [1, 3], 5, log=lambda s: None)
    assert [r.streams for r in rows] == [1, 3]
    metrics = [m for m in engine.recent() if m.tag == "api"]
    for row in rows:
        assert len(row.results) == 4
        assert all(0 < r.output_tokens <= 5 and r.ttft_s > 0 and r.last_s >= r.ttft_s for r in row.results)
        assert row.decode_tokens_per_s > 0  # five tokens each: four after the first
        assert row.tokens_per_s == pytest.approx(row.output_tokens / row.wall_s)
        assert row.ttft_ms(0.5) <= row.ttft_ms(0.95)
        # The shared system prompt was cached by the warm-up request: every request hits it.
        assert all(r.cached_tokens > 0 and r.cached_tokens < r.prompt_tokens for r in row.results)
    # What the client counted is what the engine recorded (warm-up + 2 x 4 requests).
    assert len(metrics) == 9
    assert sum(r.output_tokens for row in rows for r in row.results) == sum(m.output_tokens for m in metrics[1:])
    table = format_table(rows + [dataclasses.replace(r, server="other", wall_s=r.wall_s * 2) for r in rows], "t")
    assert "| 0 | 1 | 2.00x |" in table and "| 0 | 3 | 2.00x |" in table
    fast = [dataclasses.replace(r, server=r.server + " fast", wall_s=r.wall_s / 2) for r in rows]
    three = format_table(rows + fast + [dataclasses.replace(r, server="vLLM", wall_s=r.wall_s * 4) for r in rows], "t")
    # each against the last server named, then the exact forward against its fast paths
    assert f"| {rows[0].server} / {rows[0].server} fast (tokens/s) |" in three
    assert "| 0 | 1 | 4.00x | 8.00x | 0.50x |" in three


def test_one_stream_rows_are_held_against_the_bandwidth_ceiling(tmp_path):
    import json

    import torch
    from safetensors.torch import save_file

    from tools.peer_bench import Result, Row, ceiling_lines

    save_file({"w": torch.zeros(1000, 1000)}, tmp_path / "model.safetensors")  # 4 MB in float32
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 1, "hidden_size": 8,
                                                      "num_hidden_layers": 1, "num_key_value_heads": 1}))
    # 10 tokens in 1 s of wall time: the first at 0.1 s, the last at 1.0 (9 more in 0.9 s: 10 a second)
    one = Row("ours float32", 1, (Result(10, 90, 80, 0.1, "x", 1.0),), 1.0, system_tokens=80)
    many = dataclasses.replace(one, streams=8)
    lines = ceiling_lines([one, many], "float32", [34e6, 38e6], max_tokens=21, folder=tmp_path)
    # 4 MB of weights + 100 context tokens x 64 B of KV per step at 36 MB/s: a ceiling of 8.99 tokens/s
    assert len(lines) == 3 and "ours float32, one stream" in lines[2]  # the 8-stream row has no ceiling
    assert "decoding at 10.0 tokens/s = 111% of 9.0" in lines[2] and "at 100 tokens" in lines[2]
    assert "0.0 and 0.0 GB/s" in lines[1] and "10.0 tokens/s in wall time" in lines[2]


def test_the_decode_rate_counts_the_tokens_after_the_first_over_the_time_after_it():
    from tools.peer_bench import Result, Row

    row = Row("s", 2, (Result(5, 9, 0, 0.5, "a", 1.5), Result(9, 9, 0, 1.0, "b", 2.0), Result(1, 9, 0, 0.2, "c", 0.2)),
              3.0)
    assert row.decode_tokens_per_s == pytest.approx((4 + 8) / 2.0)  # the one-token answer has no decode time
    assert Row("s", 1, (), 1.0).decode_tokens_per_s == 0.0


def test_a_row_bracketed_by_its_own_plain_reads_is_held_against_them(tmp_path):
    import json

    import torch
    from safetensors.torch import save_file

    from tools.peer_bench import Result, Row, ceiling_lines

    save_file({"w": torch.zeros(1000, 1000)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 1, "hidden_size": 8,
                                                      "num_hidden_layers": 1, "num_key_value_heads": 1}))
    one = Row("ours float32", 1, (Result(10, 90, 80, 0.1, "x", 1.0),), 1.0, system_tokens=80,
              bandwidth=(17e6, 19e6))
    lines = ceiling_lines([one], "float32", [34e6, 38e6], max_tokens=21, folder=tmp_path)
    # its own reads (18 MB/s mean), not the run's (36): a ceiling of 4.5 tokens/s
    assert "223% of 4.5" in lines[2] and "0.0 and 0.0 GB/s just before and after this row" in lines[2]


def test_bench_server_brackets_only_one_stream_rows(monkeypatch):
    from tools import peer_bench

    reads = iter([10e9, 12e9, 99e9])
    monkeypatch.setattr(peer_bench, "read_bandwidth", lambda: next(reads))
    monkeypatch.setattr(peer_bench, "served_model", lambda url: "m")
    monkeypatch.setattr(peer_bench, "chat_once", lambda *a, **k: None)
    monkeypatch.setattr(peer_bench, "run_streams", lambda url, model, conv, c, *a: peer_bench.Row("s", c, (), 1.0))
    rows = peer_bench.bench_server("http://x", "s", [[{"role": "system", "content": "x"}]], [1, 8], 4, log=lambda s: None,
                                   bracket=True)
    assert [r.bandwidth for r in rows] == [(10e9, 12e9), ()]
