"""Queue and limits on a public page: a bounded queue that answers a friendly "busy", caps on
prompt and new tokens set by flag or environment variable, enforced by the engine and shown
by the UI."""

from __future__ import annotations

import time

import pytest

import app
from engine.types import EngineBusy, EngineError, GenerationRequest, SamplingParams
from tests.helpers_app import assert_clean, launched_app, shown_logs, visitor, wait_idle


def _wait(cond, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_full_engine_queue_answers_busy(tiny_runner, make_engine):
    engine = make_engine(max_queue=2, max_new_tokens_cap=4)
    req = GenerationRequest(prompt="hello", sampling=SamplingParams(max_new_tokens=2))
    with tiny_runner.lock:  # the model is busy: the worker takes one request and waits for it
        first = engine.submit(req)
        _wait(lambda: engine._in_hand == [first])
        assert engine.stats().queue_depth == 1  # in the worker's hand, not admitted: still waiting
        second = engine.submit(req)
        assert engine.stats().queue_depth == 2
        with pytest.raises(EngineBusy, match="busy.*try again"):
            engine.submit(req)
    for handle in (first, second):
        assert list(handle)[-1].done
    engine.run(req)  # room again once the queue drains
    wait_idle(engine)
    assert_clean(engine)


def test_busy_message_reaches_the_visitor(tiny_runner, make_engine):
    engine = make_engine(max_queue=2, max_new_tokens_cap=4)
    chat = ("Hello!", [], "Pirate", "", 2, False)
    with launched_app(engine, max_queue=2) as url:
        a, b, c = visitor(url), visitor(url), visitor(url)
        with tiny_runner.lock:  # the model is busy: A waits in the worker's hand, B in the inbox
            job_a = a.submit(*chat, api_name="/chat")
            _wait(lambda: len(engine._in_hand) == 1 and job_a.status().code.name in ("PROCESSING", "ITERATING"))
            job_b = b.submit(*chat, api_name="/chat")
            _wait(lambda: engine.stats().queue_depth == 2)
            job_c = c.submit(*chat, api_name="/chat")
            history_c = job_c.result(timeout=60)[0]
            assert history_c == []  # nothing was added to C's chat
            assert any("busy" in msg.lower() and level == "warning" for msg, level in shown_logs(job_c))
        for job in (job_a, job_b):
            assert len(job.result(timeout=60)[0]) == 2  # question and answer
    wait_idle(engine)
    assert len(engine.recent()) == 2
    assert_clean(engine)


@pytest.mark.parametrize("source", ["flags", "env"])
def test_caps_from_flags_and_env(tiny_runner, monkeypatch, source):
    for var in ("RADIX_MAX_PROMPT_TOKENS", "RADIX_MAX_NEW_TOKENS", "RADIX_MAX_QUEUE"):
        monkeypatch.delenv(var, raising=False)
    if source == "flags":
        args = app.parse_args(["--max-prompt-tokens", "40", "--max-new-tokens", "5", "--max-queue", "3"])
    else:
        monkeypatch.setenv("RADIX_MAX_PROMPT_TOKENS", "40")
        monkeypatch.setenv("RADIX_MAX_NEW_TOKENS", "5")
        monkeypatch.setenv("RADIX_MAX_QUEUE", "3")
        args = app.parse_args([])
    engine = app.build_engine(args, runner=tiny_runner)
    assert (engine.max_prompt_tokens, engine.max_new_tokens_cap, engine._queue.maxsize) == (40, 5, 3)
    with pytest.raises(EngineError, match="limit is 40 tokens"):
        engine.submit(GenerationRequest(prompt="word " * 60))
    m = engine.run(GenerationRequest(prompt="word " * 30, sampling=SamplingParams(max_new_tokens=10_000)))
    assert m.prompt_tokens <= 40 and m.output_tokens <= 5


def test_flag_caps_never_exceed_the_model_context(tiny_runner):
    engine = app.build_engine(app.parse_args(["--max-prompt-tokens", "10000000"]), runner=tiny_runner)
    assert engine.max_prompt_tokens == tiny_runner.max_context


def test_public_deployment_gets_lower_defaults(monkeypatch):
    for var in ("RADIX_MAX_PROMPT_TOKENS", "RADIX_MAX_NEW_TOKENS", "RADIX_ISOLATE", "SYSTEM"):
        monkeypatch.delenv(var, raising=False)
    local, public = app.parse_args([]), app.parse_args(["--isolate"])
    assert (local.max_new_tokens, local.max_prompt_tokens) == (512, None)
    assert (public.max_new_tokens, public.max_prompt_tokens) == (256, 4096)
    explicit = app.parse_args(["--isolate", "--max-new-tokens", "400", "--max-prompt-tokens", "6000"])
    assert (explicit.max_new_tokens, explicit.max_prompt_tokens) == (400, 6000)


def test_batching_flags_and_env(tiny_runner, monkeypatch):
    monkeypatch.delenv("RADIX_MAX_BATCH", raising=False)
    monkeypatch.setenv("RADIX_CHUNK_TOKENS", "64")
    engine = app.build_engine(app.parse_args(["--max-batch", "1"]), runner=tiny_runner)
    assert (engine.scheduler.config.max_batch, engine.scheduler.config.chunk_tokens) == (1, 64)
    engine = app.build_engine(app.parse_args([]), runner=tiny_runner)
    assert engine.scheduler.config.max_batch == 16


@pytest.mark.parametrize("argv", [["--max-new-tokens", "0"], ["--max-queue", "-1"], ["--max-prompt-tokens", "x"],
                                  ["--max-batch", "0"], ["--chunk-tokens", "-3"],
                                  ["--cache-budget-mb", "-5"], ["--cache-budget-mb", "nan"]])
def test_bad_flag_values_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        app.parse_args(argv)
    assert exc.value.code == 2
    assert "error: argument" in capsys.readouterr().err


def test_bad_env_values_are_usage_errors(monkeypatch, capsys):
    monkeypatch.setenv("RADIX_MAX_NEW_TOKENS", "lots")
    with pytest.raises(SystemExit):
        app.parse_args([])
    assert "--max-new-tokens" in capsys.readouterr().err


def test_ui_caps_through_the_api(tiny_runner):
    """The chat's slider stops at the engine's cap; a client sending more gets a clear error."""
    engine = app.build_engine(app.parse_args(["--max-new-tokens", "4", "--max-prompt-tokens", "60"]),
                              runner=tiny_runner)
    with launched_app(engine) as url:
        client = visitor(url)
        from gradio_client.exceptions import AppError

        with pytest.raises(AppError, match="greater than maximum value 4"):
            client.predict("Hello", [], "Pirate", "", 50, False, api_name="/chat")
        job = client.submit("word " * 100, [], "Custom…", "", 4, False, api_name="/chat")
        assert job.result(timeout=60)[0] == []
        assert any("limit is 60 tokens" in msg for msg, _ in shown_logs(job))
    wait_idle(engine)
    assert_clean(engine)
