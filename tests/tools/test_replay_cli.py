"""The replay command line: --simulate with a report, --strict, Ctrl-C mid-run, and the
HTML report opened in headless Chromium."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from analysis.replay.synthetic_log import generate
from tools.replay import main, parse_ttl

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
SYSTEM = "You are the support assistant of ACME Networks. Answer briefly and never promise refunds."


def cli(capsys, *args) -> subprocess.CompletedProcess:
    """The command line, in this process (the subprocess start-up costs seconds per call)."""
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out.out, out.err)


def write_log(path: Path, lines) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_simulate_writes_a_self_contained_report(tmp_path, capsys):
    lines = [{"messages": [{"role": "system", "content": f"Now: 2026-03-0{i} 10:0{i}. {SYSTEM}"},
                           {"role": "user", "content": f"Question {i}: how do I reset it?"}],
              "timestamp": f"2026-03-01T10:0{i}:00Z"} for i in range(1, 6)]
    lines.insert(2, '{"prompt": "<script>alert(1)</script> hostile text"}')
    lines.insert(3, '{"prompt": "<script>alert(1)</script> hostile text, again"}')
    lines.append("this is not json")
    report = tmp_path / "out" / "report.html"
    out = cli(capsys, write_log(tmp_path / "log.jsonl", lines), "--simulate", "--report", report, "--no-progress")
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])["summary"]
    assert summary["mode"] == "simulation" and summary["requests"] == 7 and summary["skipped_lines"] == 1
    assert summary["mean_prefill_ms"] is None  # a simulation has no timings
    assert "per-request-value" in summary["miss_causes"]
    assert summary["text"].startswith("On this log, prefix caching would serve")
    assert "line 8: skipped: not valid JSON" in out.stderr
    page = report.read_text()
    assert "SIMULATION" in page and "a value that changes per request" in page
    assert "<script>alert(1)" not in page and "&lt;script&gt;" in page  # log text is escaped
    assert not re.search(r"<script[^>]+src=", page)  # plotly.js inlined: opens offline
    assert page.count("Plotly.newPlot") >= 5 and "not valid JSON" in page


def test_gzip_bom_empty_and_all_bad_logs(tmp_path, capsys):
    import gzip

    lines = ['{"prompt": "The capital of France is"}', '{"prompt": "The capital of France is Paris"}']
    with gzip.open(tmp_path / "log.jsonl.gz", "wt", encoding="utf-8-sig") as fh:  # with a byte-order mark
        fh.write("\n".join(lines) + "\n")
    out = cli(capsys, tmp_path / "log.jsonl.gz", "--simulate", "--no-progress", "--per-request")
    assert out.returncode == 0, out.stderr[-2000:]
    *per_request, last = [json.loads(x) for x in out.stdout.splitlines()]
    assert [r["line"] for r in per_request] == [1, 2] and per_request[1]["cached_tokens"] == 5
    assert last["summary"]["requests"] == 2 and last["summary"]["skipped_lines"] == 0
    (tmp_path / "empty.jsonl").write_text("\n\n")
    bad = write_log(tmp_path / "bad.jsonl", ["nope", "[]"])
    for log in (tmp_path / "empty.jsonl", bad):
        out = cli(capsys, log, "--simulate", "--no-progress", "--report", tmp_path / "r.html")
        assert out.returncode == 0 and json.loads(out.stdout.splitlines()[-1])["summary"]["requests"] == 0
        assert "No request was replayed" in (tmp_path / "r.html").read_text()


def test_strict_stops_at_the_first_bad_line_and_flags_are_checked(tmp_path, capsys):
    log = write_log(tmp_path / "log.jsonl", ['{"prompt": "fine"}', '{"prompt": 3}'])
    out = cli(capsys, log, "--simulate", "--strict", "--no-progress")
    assert out.returncode == 2 and 'line 2: "prompt" must be text' in out.stderr
    assert cli(capsys, log, "--ttl", "5m").returncode == 2  # the engine has no TTL: simulation only
    assert cli(capsys, tmp_path / "missing.jsonl", "--simulate").returncode == 2
    assert parse_ttl("5m") == 300 and parse_ttl("1h") == 3600 and parse_ttl("90") == 90
    with pytest.raises(Exception, match="not a time-to-live"):
        parse_ttl("soon")


def test_ctrl_c_mid_run_still_writes_the_report(tmp_path):
    log = write_log(tmp_path / "big.jsonl", generate(4000, seed=1))
    report = tmp_path / "report.html"
    proc = subprocess.Popen([sys.executable, "-m", "tools.replay", str(log), "--simulate", "--report",
                             str(report)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    os.set_blocking(proc.stderr.fileno(), False)
    seen, deadline = b"", time.monotonic() + 120
    while time.monotonic() < deadline and not re.search(rb"simulating: [1-9]", seen):
        seen += proc.stderr.read() or b""
        time.sleep(0.1)
    assert proc.poll() is None, "finished before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    stderr = seen + stderr
    assert proc.returncode == 130, stderr[-2000:]
    assert b"stopping after the current request" in stderr and b"Traceback" not in stderr
    summary = json.loads(stdout.decode().strip().splitlines()[-1])["summary"]
    assert summary["stopped"] and 0 < summary["requests"] < 4000
    assert "Stopped early" in report.read_text()


@pytest.mark.browser
def test_report_renders_offline_in_chromium(tmp_path, capsys, chromium_executable):
    from playwright.sync_api import sync_playwright

    log = write_log(tmp_path / "log.jsonl", generate(400, seed=2))
    report = tmp_path / "report.html"
    out = cli(capsys, log, "--simulate", "--report", report, "--budget-mb", "300", "--ttl", "5m", "--no-progress")
    assert out.returncode == 0, out.stderr[-2000:]
    requests: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_executable, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1300, "height": 1000})
        page.on("request", lambda r: requests.append(r.url))
        page.goto(report.as_uri())
        page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length >= 5", timeout=20000)
        assert page.evaluate("typeof window.Plotly") == "object"
        assert "prefix caching would serve" in page.inner_text(".summary")
        shot = Path(os.environ.get("REPLAY_SCREENSHOT", tmp_path / "replay-report.png"))
        page.screenshot(path=str(shot), full_page=False)
        browser.close()
    assert all(u.startswith(("file:", "data:", "about:")) for u in requests), requests
    assert shot.stat().st_size > 20_000


@pytest.mark.slow
def test_measured_replay_on_the_real_model_writes_its_report(tmp_path, capsys):
    report = tmp_path / "measured.html"
    out = cli(capsys, ROOT / "examples" / "trace.jsonl", "--baseline", "--max-new-tokens", "2", "--report", report,
              "--no-progress")
    assert out.returncode == 0, out.stderr[-2000:]
    *per_request, last = [json.loads(x) for x in out.stdout.splitlines()]
    summary = last["summary"]
    assert summary["mode"] == "measured" and summary["requests"] == len(per_request) == 5
    assert per_request[1]["cached_tokens"] > 0 and all("miss_cause" in r for r in per_request)
    assert summary["mean_prefill_ms"] > 0 and summary["mean_baseline_prefill_ms"] > 0
    page = report.read_text()
    assert "MEASURED on the real model" in page and "Prefill time per request (measured)" in page
    assert "Measured prefill:" in summary["text"]


def test_replay_honours_the_loop_guard(tiny_runner, make_engine):
    """``--no-repeat-ngram`` / ``--repetition-penalty`` reach the engine: the replayed answer is the
    one a direct run with the same guard gives, and the guard changes the request's sampling."""
    from analysis.replay.log_formats import LogRecord
    from engine.types import GenerationRequest, SamplingParams
    from tools.replay import to_request

    guard = SamplingParams(no_repeat_ngram_size=2, repetition_penalty=1.3)
    record = LogRecord(line=1, messages=None, prompt="one two three one two three one two", max_new_tokens=12)
    req = to_request(record, 32, False, guard)
    assert (req.sampling.max_new_tokens, req.sampling.no_repeat_ngram_size, req.sampling.repetition_penalty) == (
        12, 2, 1.3)
    assert to_request(record, 32, False).sampling.no_repeat_ngram_size == 0  # off unless asked
    engine = make_engine(budget_bytes=500 * tiny_runner.kv_bytes_per_token)
    direct = engine.run(GenerationRequest(prompt=record.prompt, sampling=SamplingParams(max_new_tokens=12,
                                                                                         no_repeat_ngram_size=2,
                                                                                         repetition_penalty=1.3)))
    assert engine.run(req).output_ids == direct.output_ids
    out = direct.output_ids
    assert len({tuple(out[i:i + 2]) for i in range(len(out) - 1)}) == len(out) - 1  # no bigram repeats
