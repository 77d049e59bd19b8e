"""A public deployment stays fair and bounded (issue 28), over the app's own HTTP surface on
the tiny random Llama in isolation mode: one body limit answered 413 on ``/v1`` whichever way
the body comes, a clear error for an unknown preset on ``/chat``, and limits counted per
client (API key or address), not per ``cache_salt``."""

from __future__ import annotations

import logging

import httpx
import pytest
from gradio_client.exceptions import AppError

from engine.engine import Engine
from server.request_guard import MAX_BODY_BYTES
from tests.helpers_app import assert_clean, launched_app, visitor, wait_idle


@pytest.fixture(scope="module")
def app_url(tiny_runner):
    engine = Engine(tiny_runner, isolation=True, max_new_tokens_cap=4)
    with launched_app(engine) as url:
        yield url, engine
    wait_idle(engine)
    assert_clean(engine)


def _chunks(total: int):
    sent = 0
    while sent < total:
        yield b" " * 65_536
        sent += 65_536


@pytest.mark.parametrize("route", ["v1/chat/completions", "v1/completions"])
def test_oversized_api_body_answers_413_chunked_or_with_a_length(app_url, route, caplog):
    url, _ = app_url
    over = MAX_BODY_BYTES + 3 * 65_536
    with caplog.at_level(logging.INFO):
        chunked = httpx.post(f"{url}{route}", content=_chunks(over), headers={"content-type": "application/json"})
        sized = httpx.post(f"{url}{route}", content=b" " * over, headers={"content-type": "application/json"})
    for r in (chunked, sized):
        assert r.status_code == 413, r.text
        assert f"{MAX_BODY_BYTES:,}" in r.text  # the one limit, said in the answer
    assert "Traceback" not in caplog.text and "API request failed" not in caplog.text
    # Just under the limit is read (and refused for what it says, not for its size).
    r = httpx.post(f"{url}{route}", content=_chunks(MAX_BODY_BYTES - 65_536), headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.text


@pytest.mark.parametrize("preset", ["No such preset", None])
def test_unknown_preset_on_the_chat_api_is_a_clear_error(app_url, preset):
    url, engine = app_url
    before = len(engine.recent())
    with pytest.raises(AppError, match="preset|choices") as err:
        visitor(url).predict("Hello", [], preset, "", 2, False, api_name="/chat")
    assert "Pirate" in str(err.value)  # the choices are named
    assert len(engine.recent()) == before  # nothing ran
