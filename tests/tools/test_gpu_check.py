"""tools/gpu_check: what travels to the device machine (the tokenizer, no wheel), that the check's
imports need none of the device's missing packages, the model shapes, and the table. The whole
rehearsal (tools/gpu_check.sh --rehearse: a fresh venv with transformers 5.17, 2.5 to 4.5 minutes
here) is the slow test at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools import gpu_check

ROOT = Path(__file__).resolve().parents[2]


def run_tool(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.gpu_check", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


def test_prepare_saves_a_tokenizer_that_travels(tmp_path, tokenizer):
    done = run_tool("prepare", "--dir", str(tmp_path / "gpu"), env={"RADIX_TOKENIZER_DIR": str(tmp_path / "none")})
    assert done.returncode == 0, done.stdout + done.stderr
    files = [p for p in (tmp_path / "gpu").rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 8 * 2**20  # 3.4 MiB: far inside the 64 MiB a call carries
    from transformers import AutoTokenizer

    carried = AutoTokenizer.from_pretrained(tmp_path / "gpu" / "tokenizer")
    assert carried.encode("Shipping is free over $40.") == tokenizer.encode("Shipping is free over $40.")


def test_the_check_imports_nothing_the_device_lacks():
    done = run_tool("imports")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(gpu_check.CHECK_MODULES)} of {len(gpu_check.CHECK_MODULES)} modules import" in done.stdout


def test_a_barred_import_is_reported(tmp_path):
    code = ("import sys; from tools import gpu_check as g; g.CHECK_MODULES = ('engine.engine', 'gradio'); "
            "sys.exit(g.check_imports())")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "FAILED gradio" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize(("shape", "params"), [("embedded", 134_515_008), ("1b", 1_073_809_408),
                                               ("1.7b", 1_711_376_384)])
def test_model_shapes(tokenizer, shape, params):
    """The embedded shape has SmolLM2-135M's parameter count; the 1B-class one about a billion; the
    ZeroGPU Space's model, SmolLM2-1.7B's 1.71 billion."""
    from transformers import LlamaForCausalLM

    cfg = gpu_check.shape_config(shape, tokenizer)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    assert sum(p.numel() for p in model.parameters()) == params
    assert cfg.vocab_size == len(tokenizer) == 49152 and cfg.tie_word_embeddings and cfg.head_dim == 64


def test_table_marks_each_step_and_reads_the_rows(tmp_path):
    (tmp_path / "steps.tsv").write_text("env\t0\t1\ncuda_tests\t1\t20\nbench_1b\t124\t150\nserve_1b\t125\t0\n"
                                        "serve_embedded\t1\t90\n")
    (tmp_path / "env.json").write_text(json.dumps(dict(device="NVIDIA H100 80GB HBM3, 79 GiB", python="3.12.3",
                                                       torch="2.11.0+cu130", transformers="5.17.0", mode="device")))
    (tmp_path / "cuda_tests.xml").write_text('<testsuites><testsuite tests="2" failures="1" errors="0" skipped="0"/>'
                                             "</testsuites>")
    (tmp_path / "bench_embedded.json").write_text(json.dumps(dict(title="t", rows=[dict(
        cached=8000, suffix=32, full_ms=40.0, engine_ms=4.0, speedup=10.0, max_logit_diff=0.01, greedy_same=16,
        greedy_tokens=16)])))
    (tmp_path / "serve_embedded.json").write_text(json.dumps(dict(title="t", weight_bytes=256 * 2**20, rows=[dict(
        streams=64, engine="batched", tokens_per_s=2000.0, ttft_p50_ms=50, ttft_p95_ms=90, identical=60, requests=64,
        device_peak_mb=1400.0, budget_mb=1024.0, rss_growth_mb=3.0)])))
    (tmp_path / "zerogpu_turn_embedded.json").write_text(json.dumps(dict(title="t", rows=[dict(
        turn=2, prompt_tokens=2320, cached_tokens=2308, new_tokens=96, identical=True, kv_in_mb=101.4, kv_out_mb=9.9,
        device_s=0.8, wall_s=1.1, asked_s=5)])))
    text = gpu_check.table(tmp_path)
    assert "| 2 | 2,320 | 2,308 | 96 | True | 101.4 / 9.9 | 0.80 | 1.10 | 5 |" in text
    assert "NVIDIA H100 80GB HBM3" in text and "transformers 5.17.0" in text
    assert "| cuda_tests | FAILED (exit 1), 20 s | 1 passed, 1 failed, 0 skipped |" in text
    assert "| bench_1b | TIMED OUT, 150 s |" in text and "| serve_1b | SKIPPED (no time left), 0 s |" in text
    assert "| serve_embedded | ran; not every answer identical to solo (exit 1), 90 s |" in text
    assert "| 8,000 | 32 | 40.0 ms | 4.0 ms | 10.0x |" in text
    assert "peak GPU 1,400 MiB = weights 256 + KV budget 1,024 + 120" in text and "| 60/64 |" in text
    assert "Steps failed: cuda_tests, bench_1b, serve_1b, serve_embedded." in text


@pytest.mark.slow
def test_rehearsal_end_to_end(tmp_path):
    """tools/gpu_check.sh --rehearse: every step passes on CPU with the device's transformers line."""
    # CI makes the venv at install time (.ci/run: tools/gpu_check.sh --rehearse-venv) and names it in
    # GPU_CHECK_VENV; without it the script makes one (pip, once).
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
           "GPU_CHECK_VENV": os.environ.get("GPU_CHECK_VENV") or str(tmp_path / "venv")}
    done = subprocess.run(["bash", "tools/gpu_check.sh", "--rehearse"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    table = (tmp_path / "out" / "gpu_check.md").read_text()
    assert done.returncode == 0 and "Steps failed: none." in table, table + done.stdout[-3000:]
    assert "transformers 5.17.0" in table and "| 1,024 | 32 |" in table and "| 8 | batched |" in table
    assert "A ZeroGPU turn's call body, embedded shape" in table and "| 8 | True |" in table
    assert json.loads((tmp_path / "out" / "results.json").read_text())["serve_embedded"]["rows"]
