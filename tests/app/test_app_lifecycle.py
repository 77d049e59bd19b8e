"""How ``python app.py`` starts and stops (issue 28): a port that cannot be served ends in one
line before anything is loaded; SIGTERM ends the app with one line and no traceback, whether
it comes while the model loads or while the page is served. Each runs the real ``app.py`` in a
subprocess on the tiny random Llama, saved to a folder as a local model."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers_app import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model_dir(tiny_runner, tokenizer, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-model")
    tiny_runner.model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _env() -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False", RADIX_DISK_CACHE_MB="0",
                PYTHONUNBUFFERED="1")


def _start(model: str, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "app.py", "--model", model, "--port", str(port)], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_busy_port_ends_in_one_line_before_loading_anything():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        # A model that does not exist: had the app loaded it first, it would say so instead.
        proc = subprocess.run([sys.executable, "app.py", "--model", "/nonexistent", "--port", str(port)], cwd=ROOT,
                              env=_env(), capture_output=True, text=True, timeout=120)
        elapsed = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Traceback" not in out and "Loading model" not in out and "terminate" not in out
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error:") and str(port) in errors[0], out
    assert "in use" in errors[0], out
    assert elapsed < 60


@pytest.fixture
def switch_interval():
    """The interpreter's GIL switch interval, put back after a test that runs ``app.main``."""
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_a_bind_failure_at_launch_ends_in_one_line(monkeypatch, capsys, tokenizer, switch_interval):
    """The port is taken between the check and the launch: one line, exit code 1, no traceback.
    The local engine's process runs with the short GIL switch interval (app.SWITCH_INTERVAL_S).
    The app's exit stops its engine's runner (``Engine.shutdown``), so the engine gets a runner of
    its own: on the session's shared one, every later test of this worker would find it stopped."""
    import app
    from tests.conftest import make_tiny_runner

    own = make_tiny_runner(tokenizer)
    monkeypatch.setattr(app, "port_problem", lambda host, port: None)
    monkeypatch.setattr(app, "build_engine", lambda args: _engine(own))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc = app.main(["--model", "tiny", "--port", str(port), "--no-cache"])
    err = capsys.readouterr().err
    assert rc == 1
    assert sys.getswitchinterval() == pytest.approx(app.SWITCH_INTERVAL_S)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and str(port) in lines[0], err
    assert own.compute.stopped  # the exit ended the engine's threads, its runner's included


def _engine(runner):
    from engine.engine import Engine

    return Engine(runner, enable_cache=False, max_new_tokens_cap=4)  # by hand: app.main's exit shuts it down


def _read_until(proc: subprocess.Popen, needle: str, timeout_s: float) -> str:
    """stdout (merged with stderr) up to the line holding ``needle``."""
    seen = []
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return "".join(seen)
    raise AssertionError(f"never printed {needle!r}:\n{''.join(seen)}")


def _stopped(proc: subprocess.Popen) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out


def test_sigterm_while_loading_ends_in_one_line(tiny_model_dir):
    proc = _start(tiny_model_dir, free_port())
    try:
        before = _read_until(proc, "Loading model", 120)
        rc, out = _stopped(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, before + out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert "Stopped." in out


def test_sigterm_while_serving_ends_in_one_line(tiny_model_dir):
    port = free_port()
    proc = _start(tiny_model_dir, port)
    try:
        before = _read_until(proc, "Running on local URL", 240)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).status_code == 200
        rc, out = _stopped(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, before + out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out and "terminate" not in out, out
    assert out.strip().splitlines()[-1] == "Stopped.", out


def test_sigterm_under_load_as_a_space_ends_cleanly(tiny_model_dir):
    """Issue 58: a Space (isolation, visitors by X-Forwarded-For) stopped by SIGTERM while API
    streams and page events are in flight printed ``terminate called without an active
    exception`` (a native thread still running when the interpreter went away). It ends with
    "Stopped." and exit code 0, nothing after it."""
    import threading

    port = free_port()
    env = dict(_env(), SYSTEM="spaces")
    proc = subprocess.Popen([sys.executable, "app.py", "--model", tiny_model_dir, "--port", str(port),
                             "--max-new-tokens", "256"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    streams: list[threading.Thread] = []
    try:
        before = _read_until(proc, "Running on local URL", 240)

        def stream(i: int) -> None:
            body = {"prompt": f"Story {i}: once upon a time", "max_tokens": 256, "stream": True, "ignore_eos": True}
            try:
                with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60,
                                  headers={"x-forwarded-for": f"198.51.100.{i + 1}"}) as r:
                    for _ in r.iter_lines():
                        pass
            except httpx.HTTPError:
                pass  # the server went away mid-stream: expected

        streams = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(3)]
        for t in streams:
            t.start()
        time.sleep(1.5)  # the streams are running
        rc, out = _stopped(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, before + out
    assert "terminate called" not in out and "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert out.strip().splitlines()[-1] == "Stopped.", out
