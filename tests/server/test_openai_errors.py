"""The API's accounting and error mapping, on a scripted engine (exact event sequences, no model)
and on the tiny engine served with isolation: ``usage.completion_tokens`` equals the tokens
returned when a stop string cuts the answer; faults of the server answer 5xx (500
``server_error`` for ``EngineFault``, 503 for a full queue), bad input 400 naming the
parameter; unsalted calls on an isolating server run as one owner (one share of rows), uncached."""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from engine.cache_keys import KeyedPrompt
from engine.engine import Engine
from engine.handle import END_OF_STREAM, RequestHandle
from engine.namespaces import owner_of
from engine.types import (
    CacheKey,
    EngineBusy,
    EngineError,
    EngineFault,
    GenerationEvent,
    GenerationRequest,
    RequestMetrics,
)
from server.cache_scope import api_visitor
from server.openai_api import ApiState, api_routes
from tests.helpers_app import assert_clean, launched_app, wait_idle

PIECES = ["One", " two", " STOP", " three", " four"]  # one token each


def metrics(output_ids: list[int], text: str, reason: str = "cancelled") -> RequestMetrics:
    return RequestMetrics(
        request_id=1, tag="api", namespace="", prompt_tokens=3, cached_tokens=0, computed_tokens=3, prefill_ms=1.0,
        baseline_prefill_ms=None, ttft_ms=1.0, queue_ms=0.0, decode_tokens_per_s=None,
        output_tokens=len(output_ids), finish_reason=reason, cache_bytes=0, cache_budget_bytes=0, evicted_tokens=0,
        inserted_tokens=0, matched_path=[], prompt_ids=[1, 2, 3], output_ids=output_ids, output_text=text)


class ScriptedEngine:
    """Just what the API reads of an engine; ``submit`` replays ``script`` (events and exceptions)."""

    isolation = False
    max_new_tokens_cap = 64
    max_queue = 32

    def __init__(self, script=None, refuse: Exception | None = None) -> None:
        self.script, self.refuse = script or [], refuse
        self.submitted: list[GenerationRequest] = []

    def info(self):
        return SimpleNamespace(model_name="scripted")

    def key_for(self, request: GenerationRequest, visitor, sub=None) -> KeyedPrompt:
        """The route's keying step: three tokens, nothing cached (the script stands for the rest)."""
        return KeyedPrompt(CacheKey((1, 2, 3)), 0, True)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        if self.refuse is not None:
            raise self.refuse
        self.submitted.append(request)
        handle = RequestHandle(request, [1, 2, 3], 1)
        for item in self.script:
            handle.events.put(item)
        handle.events.put(END_OF_STREAM)
        return handle


def overrun_after_stop() -> list:
    """What the engine does under a stop string: the API cancels when " STOP" arrives, but the
    scheduler has already generated two more tokens by its next step, and counts them."""
    events, text = [], ""
    for i, piece in enumerate(PIECES):
        text += piece
        events.append(GenerationEvent(text=text, token_id=100 + i))
    events.append(GenerationEvent(text=text, done=True, metrics=metrics([100 + i for i in range(5)], text)))
    return events


def http(engine) -> TestClient:
    return TestClient(FastAPI(routes=api_routes(ApiState(get_engine=lambda: engine))))


BODY = {"prompt": "count", "max_tokens": 8, "stop": [" STOP"], "return_token_ids": True}


def test_usage_counts_the_tokens_returned_under_a_stop_string():
    engine = ScriptedEngine(overrun_after_stop())
    with http(engine) as client:
        plain = client.post("/v1/completions", json=BODY).json()
        assert plain["choices"][0]["text"] == "One two" and plain["choices"][0]["finish_reason"] == "stop"
        assert plain["choices"][0]["token_ids"] == [100, 101, 102]  # up to the token that completed the stop
        assert plain["usage"]["completion_tokens"] == 3 == len(plain["choices"][0]["token_ids"])
        assert plain["usage"]["total_tokens"] == 3 + 3
        lines = client.post("/v1/completions", json=BODY | {"stream": True,
                                                           "stream_options": {"include_usage": True}}).text
    import json

    chunks = [json.loads(line[5:]) for line in lines.splitlines() if line.startswith("data:") and "[DONE]" not in line]
    streamed_ids = [i for c in chunks for ch in c["choices"] for i in ch.get("token_ids", [])]
    assert streamed_ids == [100, 101, 102]
    assert chunks[-1]["usage"]["completion_tokens"] == 3


def test_usage_without_a_stop_string_is_the_engines_count():
    script = overrun_after_stop()
    done = script[-1]
    script[-1] = GenerationEvent(text=done.text, done=True, metrics=metrics(done.metrics.output_ids, done.text, "length"))
    with http(ScriptedEngine(script)) as client:
        body = client.post("/v1/completions", json=BODY | {"stop": None}).json()
    assert body["usage"]["completion_tokens"] == 5 == len(body["choices"][0]["token_ids"])


def test_an_engine_fault_answers_500_server_error_with_one_log_line(caplog):
    fault = EngineFault("The request failed: RuntimeError: out of memory")
    engine = ScriptedEngine([GenerationEvent(text="One", token_id=1), fault])
    with caplog.at_level(logging.INFO, logger="server.openai_api"), http(engine) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["type"] == "server_error" and "out of memory" in error["message"]
        assert "Traceback" not in r.text
        streamed = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "stream": True}).text
        assert '"type": "server_error"' in streamed and streamed.rstrip().endswith("data: [DONE]")
    records = [r for r in caplog.records if r.name == "server.openai_api"]
    assert len(records) == 2 and all(r.levelno == logging.ERROR and r.exc_info is None for r in records)
    assert all(len(r.getMessage().splitlines()) == 1 for r in records)


def test_a_full_queue_answers_503_and_bad_input_400_naming_the_parameter():
    with http(ScriptedEngine(refuse=EngineBusy("The engine is busy."))) as client:
        r = client.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "server_error" and r.json()["error"]["code"] == "queue_full"
    with http(ScriptedEngine(refuse=EngineError("The prompt is empty: type something first."))) as client:
        r = client.post("/v1/completions", json={"prompt": "  "})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": " "}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(("field", "value", "words"), [
    ("max_tokens", 0, "from 1 to 64;"),
    ("max_tokens", -5, "from 1 to 64;"),
    ("max_tokens", 3_000_000_000, "at most 64"),
    ("max_completion_tokens", 0, "from 1 to 64;"),
    ("seed", -1, "from 0 to 9223372036854775807;"),
    ("repetition_penalty", 0.001, "from 0.01 to 10;"),
    ("ignore_eos", "yes", "must be true or false"),
    ("return_token_ids", 1.5, "must be true or false"),
])
def test_range_errors_say_the_real_range_in_plain_digits(field, value, words):
    with http(ScriptedEngine()) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", field: value})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == field
    assert words in error["message"] and "e+" not in error["message"], error["message"]


def test_unsalted_calls_on_an_isolating_server_are_one_owner_and_not_stored(tiny_runner, make_engine):
    engine, shared = (make_engine(isolation=iso, max_new_tokens_cap=2) for iso in (True, False))

    def keyed(eng: Engine, salt: str | None, client: str = "addr:1.2.3.4"):
        return eng.key_for(GenerationRequest(prompt="hi"), api_visitor(client, salt))

    a, b = keyed(engine, None).key.namespace, keyed(engine, None).key.namespace
    owner = owner_of(a)
    assert a != b and owner_of(b) == owner and "1.2.3.4" not in owner
    assert not keyed(engine, None).store and keyed(engine, "team").store and keyed(shared, None).store
    # A salt is a sub-namespace of its client's: salts never multiply a client's share (issue 28).
    assert owner_of(keyed(engine, "team").key.namespace) == owner
    assert owner_of(keyed(engine, None, "addr:5.6.7.8").key.namespace) != owner

    engine = make_engine(budget_bytes=16 * 2**20, isolation=True, max_new_tokens_cap=8)
    submitted: list[GenerationRequest] = []
    submit = engine.submit

    def recording_submit(request: GenerationRequest):
        handle = submit(request)
        submitted.append(request)
        return handle

    engine.submit = recording_submit  # type: ignore[method-assign]
    body = {"model": engine.info().model_name, "max_tokens": 6, "temperature": 0}
    with launched_app(engine) as url:
        answers: list[httpx.Response] = []

        def call(i: int, salt: str | None = None) -> None:
            extra = {"cache_salt": salt} if salt else {}
            answers.append(httpx.post(url + "v1/completions", json=body | {"prompt": f"Caller {i} asks."} | extra,
                                      timeout=120))

        threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        with tiny_runner.lock:  # the model is busy: all four arrive before any is admitted
            for t in threads:
                t.start()
            deadline = time.monotonic() + 30
            while len(submitted) < 4 and time.monotonic() < deadline:
                time.sleep(0.02)
        for t in threads:
            t.join()
        call(9, salt="team")
    assert [r.status_code for r in answers] == [200] * 5
    unsalted = [g for g in submitted if "/anon-" in g.namespace]
    assert len(unsalted) == 4 and len({g.namespace for g in unsalted}) == 4
    assert all(g.store is False for g in unsalted)
    assert [g.store for g in submitted if g not in unsalted] == [True]
    # One visitor (one owner): its unsalted requests all count as one client's rows, never more than
    # one owner's cap (nobody else waited here, so work-conserving turns let them run together).
    from engine.scheduler.policy import owner_row_cap

    owners = {owner_of(g.namespace) for g in unsalted}
    assert len(owners) == 1
    for rec in engine.step_log():
        assert sum(owner_of(ns) in owners for ns in rec.namespaces) <= owner_row_cap(engine.scheduler.config), rec
    wait_idle(engine)
    assert_clean(engine)
