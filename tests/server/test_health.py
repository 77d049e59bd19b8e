"""``GET /health`` on the launched server, as vLLM answers it (its router waits for it at start):
200 with an empty body while the engine takes requests, 503 once it is closed; the same empty
answer to anyone on a public deployment; in remote mode, the backend's health."""

from __future__ import annotations

import time

import httpx

from server.remote.engine import RemoteEngine
from tests.helpers_app import launched_app


def test_health_is_200_and_empty_while_up_and_503_once_closed(make_engine):
    engine = make_engine(max_new_tokens_cap=4)
    with launched_app(engine) as url:
        up = httpx.get(url + "health", timeout=30)
        assert up.status_code == 200 and up.content == b""
        assert httpx.head(url + "health", timeout=30).status_code == 200
        engine.close()
        down = httpx.get(url + "health", timeout=30)
        assert down.status_code == 503 and down.content == b""


def test_a_public_deployment_answers_health_to_anyone_and_nothing_more(make_engine):
    engine = make_engine(isolation=True, max_new_tokens_cap=4)
    with launched_app(engine) as url:
        r = httpx.get(url + "health", timeout=30)
        assert r.status_code == 200 and r.content == b""
        assert httpx.get(url + "metrics", timeout=30).status_code == 404  # the server's figures stay closed


def test_remote_mode_answers_the_backends_health(tokenizer, make_engine):
    backend = make_engine(max_new_tokens_cap=4)
    with launched_app(backend) as backend_url:
        remote = RemoteEngine(backend_url, "", tokenizer)
        remote.check_backend()
        with launched_app(remote) as page:
            assert httpx.get(page + "health", timeout=30).status_code == 200
            backend.close()
            time.sleep(1.1)  # the remote engine keeps its backend's answer for a second
            assert httpx.get(page + "health", timeout=30).status_code == 503
        remote.close()
