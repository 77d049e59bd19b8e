"""``python app.py --replica`` (a fleet's replica, issue 45): none of the page's start-up work (no
warm start of the shipped prompts, no growth curve), so its cache starts empty and it answers
``/health`` soon after the model is loaded; ``RADIX_REPLICA`` turns it on like the flag."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

import app
from tests.helpers_app import free_port, save_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def test_the_flag_and_its_env_var(monkeypatch):
    assert app.parse_args([]).replica is False
    assert app.parse_args(["--replica"]).replica is True
    monkeypatch.setenv("RADIX_REPLICA", "1")
    assert app.parse_args([]).replica is True and app.parse_args(["--no-replica"]).replica is False


def test_a_replica_starts_with_an_empty_cache_and_no_page_work(tmp_path, tokenizer):
    model = save_tiny_model(tmp_path / "tiny", tokenizer)
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False", RADIX_DISK_CACHE_MB="0",
               PYTHONUNBUFFERED="1", RADIX_REPLICA="1")
    log = tmp_path / "replica.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "app.py", "--model", model, "--port", str(port)], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        else:
            raise AssertionError(f"no /health within 300 s:\n{log.read_text()}")
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert "radix_cache_tokens 0.0" in metrics and "radix_requests_total 0.0" in metrics  # nothing warmed
        r = httpx.post(url + "/v1/completions", json={"prompt": "The harbour opens at", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    text = log.read_text()
    assert "Warm start" not in text and "Growth curve" not in text and "Traceback" not in text, text
    assert proc.returncode == 0 and "Stopped." in text
