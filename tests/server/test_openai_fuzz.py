"""Fuzz the OpenAI-compatible routes and vLLM's render routes beside them (issue 43): random JSON bodies (valid fields with values of the
wrong type, unknown fields, huge lists, deep nesting, wrong shapes) and random bytes, through the
real routes and the server's guard, in process (Starlette's test client) on the tiny model.

After each body: the answer is 200 (it happened to be a valid request) or a 4xx with an
OpenAI-shaped error, never a 5xx; no traceback reaches the log; and at the end the engine is idle
with its tree's invariants holding and the next valid request served.
"""

from __future__ import annotations

import json
import logging

import pytest
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.middleware import Middleware
from starlette.testclient import TestClient

import app
from server.request_guard import RequestGuard
from tests.helpers_app import assert_clean, wait_idle

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/chat/completions/render", "/v1/completions/render")
FIELDS = ("model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "stream", "stream_options", "stop", "n", "seed", "cache_salt", "logprobs", "top_logprobs", "echo",
          "ignore_eos", "presence_penalty", "frequency_penalty", "user", "tools", "response_format")

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=6)),
                           max_leaves=30)
message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]),
                                                   json_values),
                                 "content": st.one_of(st.text(max_size=60), json_values,
                                                      st.lists(st.fixed_dictionaries(
                                                          {"type": st.sampled_from(["text", "image_url"]),
                                                           "text": json_values}), max_size=3))})
bodies = st.one_of(
    json_values,
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8),
    st.fixed_dictionaries({"messages": st.lists(message, max_size=4)},
                          optional={k: json_values for k in ("max_tokens", "stream", "stop", "temperature", "n",
                                                             "logprobs", "top_logprobs", "cache_salt",
                                                             "stream_options")}),
    st.fixed_dictionaries({"prompt": st.one_of(st.text(max_size=60), st.lists(st.integers(-5, 2**40), max_size=20),
                                               json_values)},
                          optional={k: json_values for k in ("max_tokens", "stream", "echo", "logprobs", "stop")}),
)
raw = st.one_of(st.binary(max_size=200), st.sampled_from([b"[" * 5000, b"{" * 5000, b'"\\ud800"', b"NaN",
                                                          b"1e999999", b'{"prompt": "x", "max_tokens": 1e308}',
                                                          b'{"messages": ' + b"[" * 3000 + b"]" * 3000 + b"}"]))


@pytest.fixture(scope="module")
def api(make_module_engine):
    engine = make_module_engine(isolation=True, max_new_tokens_cap=2, max_queue=32)
    fastapi = FastAPI(routes=app.server_routes(engine, max_per_client=0), middleware=[Middleware(RequestGuard)])
    with TestClient(fastapi, raise_server_exceptions=False) as client:
        yield client, engine
    wait_idle(engine)
    assert_clean(engine)


def _check(response) -> None:
    assert response.status_code < 500, response.text[:400]
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and "Traceback" not in error["message"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(body=bodies, route=st.sampled_from(ROUTES))
def test_random_json_bodies_get_a_clear_answer(api, body, route, caplog):
    client, _ = api
    with caplog.at_level(logging.WARNING):
        _check(client.post(route, content=json.dumps(body).encode(), headers={"content-type": "application/json"}))
    assert "Traceback" not in caplog.text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=raw, route=st.sampled_from(ROUTES))
def test_random_bytes_get_a_clear_answer(api, body, route, caplog):
    client, _ = api
    with caplog.at_level(logging.WARNING):
        _check(client.post(route, content=body, headers={"content-type": "application/json"}))
    assert "Traceback" not in caplog.text


def test_after_the_fuzz_a_valid_request_is_served(api):
    client, engine = api
    wait_idle(engine)
    engine.check_invariants()
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
