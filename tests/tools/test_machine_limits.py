"""The limit a benchmark prints beside each figure (tools.measure): its arithmetic, on made-up machines."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tools.measure import MachineLimits, ModelCost, decode_limit, limit_cell, machine_header, model_cost

COST = ModelCost(weight_bytes=1_000_000, kv_bytes_per_token=1_000, flops_per_token=2_000_000,
                 attention_flops_per_context_token=400)


def test_a_one_stream_step_is_bound_by_its_reads_on_a_fast_fma_machine():
    limits = MachineLimits(read_bytes_per_s=1e9, flops_per_s=1e15)
    # 1 MB of weights + 100 tokens x 1 kB of KV = 1.1 MB at 1 GB/s: 1.1 ms a step, one token
    assert decode_limit(COST, 1, 100, limits) == pytest.approx(1 / 1.1e-3)


def test_many_rows_share_the_weights_until_the_flops_bind():
    limits = MachineLimits(read_bytes_per_s=1e9, flops_per_s=1e10)
    # 16 rows over 100 tokens: reads 1 MB + 1.6 MB = 2.6 ms; FLOPs 16 x (2 M + 40 k) = 32.64 M at 10 GFLOP/s = 3.264 ms
    assert COST.step_seconds(16, 100, limits) == pytest.approx(3.264e-3)
    assert decode_limit(COST, 16, 100, limits) == pytest.approx(16 / 3.264e-3)
    assert decode_limit(COST, 16, 100, limits) > decode_limit(COST, 1, 100, limits)


def test_a_rows_share_of_its_limit():
    assert limit_cell(20.0, 32.0) == "32.0 (62%)"
    assert limit_cell(5.0, 0.0) == "-"


def test_the_model_cost_counts_a_tied_embedding_once_and_a_lookup_as_no_flops():
    class Tiny(nn.Module):
        def __init__(self, tied: bool) -> None:
            super().__init__()
            self.embed, self.body, self.head = nn.Embedding(10, 8), nn.Linear(8, 8, bias=False), nn.Linear(8, 10,
                                                                                                           bias=False)
            if tied:
                self.head.weight = self.embed.weight

        def get_input_embeddings(self) -> nn.Module:
            return self.embed

        def get_output_embeddings(self) -> nn.Module:
            return self.head

    tied = model_cost(Tiny(True), 64, 2, 4, 16)
    assert tied.weight_bytes == (80 + 64) * 4 and tied.flops_per_token == 2 * (80 + 64)  # the head is the embedding
    assert tied.kv_bytes_per_token == 64 and tied.attention_flops_per_context_token == 4 * 2 * 4 * 16
    untied = model_cost(Tiny(False), 64, 2, 4, 16)
    assert untied.weight_bytes == (80 + 64 + 80) * 4 and untied.flops_per_token == 2 * (64 + 80)
    assert model_cost(Tiny(True).to(torch.bfloat16), 64, 2, 4, 16).weight_bytes == (80 + 64) * 2


def test_the_folder_cost_of_a_peer_matches_its_stored_tensors(tmp_path):
    from safetensors.torch import save_file

    from tools.peer_bench import folder_cost, limit_lines

    save_file({"w": torch.zeros(100, 10)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 2, "hidden_size": 16,
                                                      "num_hidden_layers": 3, "num_key_value_heads": 1}))
    cost = folder_cost(tmp_path, "float32")
    assert cost == ModelCost(4000, 2 * 3 * 1 * 8 * 4, 2000, 4 * 3 * 2 * 8)
    assert folder_cost(tmp_path, "bfloat16").weight_bytes == 2000
    from tools.peer_bench import Result, Row

    row = Row("ours float32", 1, (Result(10, 90, 80, 0.1, "x", 1.0),), 1.0, system_tokens=80)
    lines = limit_lines([row, Row("vLLM bfloat16", 1, (), 1.0)], "float32", 4_192e3 * 10, 1e15, 21, tmp_path)
    # 4,000 B of weights + 100 tokens x 192 B = 23,200 B a step at 41.92 MB/s: 1,807 tokens/s; 10 are 1%
    assert len(lines) == 3 and "10.0 tokens/s = 1% of the limit 1806.9 at 100 tokens" in lines[2]


def test_the_header_names_the_cpu_its_isa_flags_and_radix_isa(monkeypatch):
    monkeypatch.setenv("RADIX_ISA", "avx2")
    text = machine_header(MachineLimits(20e9, 150e9))
    assert text.startswith("CPU: ") and "avx512f " in text and "amx_tile " in text
    assert "RADIX_ISA=avx2" in text and "20.0 GB/s" in text and "150 GFLOP/s" in text


def test_a_shared_prefix_is_read_once_per_step():
    limits = MachineLimits(read_bytes_per_s=1e9, flops_per_s=1e15)
    # 8 rows over 100 tokens, the first 90 shared: 1 MB + (90 + 8 x 10) kB = 1.17 ms (not 1.8 ms)
    assert COST.step_seconds(8, 100, limits, shared_tokens=90) == pytest.approx(1.17e-3)
    assert decode_limit(COST, 8, 100, limits, 90) > decode_limit(COST, 8, 100, limits)
    assert COST.step_seconds(1, 100, limits, shared_tokens=90) == COST.step_seconds(1, 100, limits)


def test_issue_48s_serial_estimate_adds_the_reading_and_the_linears_at_half_the_fma_rate():
    limits = MachineLimits(read_bytes_per_s=1e9, flops_per_s=1e10)
    # 8 rows over 100 tokens, 90 shared: reads 1.17 MB = 1.17 ms, then 8 x 2 M FLOPs at 5 GFLOP/s = 3.2 ms
    assert COST.serial_seconds(8, 100, limits, shared_tokens=90) == pytest.approx(1.17e-3 + 3.2e-3)
    assert COST.serial_seconds(8, 100, limits, 90) >= COST.step_seconds(8, 100, limits, 90)
