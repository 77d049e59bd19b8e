"""A public deployment stays fair and bounded (issue 28), over the app's own HTTP surface on
the tiny random Llama in isolation mode: one body limit answered 413 on ``/v1`` whichever way
the body comes, a clear error for an unknown preset on ``/chat``, and limits counted per
client (API key or address), not per ``cache_salt``."""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from gradio_client.exceptions import AppError

from engine.engine import Engine
from engine.namespaces import owner_of
from engine.scheduler.policy import owner_row_cap
from server.request_guard import MAX_BODY_BYTES
from tests.helpers_app import assert_clean, free_port, launched_app, visitor, wait_idle


def _wait(cond, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def app_url(tiny_runner, make_module_engine):
    engine = make_module_engine(tiny_runner, isolation=True, max_new_tokens_cap=4)
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


# ------------------------------------------------------------------ per client, not per salt
@contextmanager
def _served(engine: Engine, api_key: str | None = None):
    import app
    from components.demo import launch_kwargs

    demo = app.build_app(engine, engine.max_queue)
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=free_port(), quiet=True,
                **launch_kwargs(app.app_kwargs(engine, api_key)))
    try:
        yield demo.local_url
    finally:
        demo.close()


def _post(url: str, key: str, i: int, salt: str | None, stream: bool = False) -> httpx.Response:
    body = {"prompt": f"Client request {i}.", "max_tokens": 3, "temperature": 0, "stream": stream}
    if salt is not None:
        body["cache_salt"] = salt
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}v1/completions", json=body, headers=headers, timeout=120)


def test_one_client_is_capped_and_counted_once_however_many_salts(tiny_runner, make_engine):
    """Six requests at once from one key, each with a new salt: four (the public default for an
    inbox of 32) are taken, two get 429 with Retry-After at once; another key is not affected;
    all of the first key's requests are one owner (never more than one owner's rows)."""
    engine = make_engine(tiny_runner, isolation=True, max_new_tokens_cap=4, max_queue=32)
    with _served(engine, api_key="key-one,key-two") as url:
        answers: list[httpx.Response] = []

        def send(i: int) -> None:
            answers.append(_post(url, "key-one", i, salt=f"invented-{i}", stream=i % 2 == 0))

        threads = [threading.Thread(target=send, args=(i,)) for i in range(6)]
        with tiny_runner.lock:  # the model is busy: all six are in flight together
            for t in threads:
                t.start()
            _wait(lambda: sum(r.status_code == 429 for r in answers) >= 2)
            refused = [r for r in answers if r.status_code == 429]
            assert len(refused) == 2
            for r in refused:
                assert r.headers.get("retry-after") and r.json()["error"]["code"] == "too_many_requests"
            # Another client still gets in (not refused while the first one holds its cap).
            other: list[httpx.Response] = []
            t_other = threading.Thread(target=lambda: other.append(_post(url, "key-two", 9, salt=None)))
            t_other.start()
            time.sleep(0.5)
            assert not other  # queued behind the busy model, not refused
        for t in [*threads, t_other]:
            t.join()
        assert sorted(r.status_code for r in answers) == [200] * 4 + [429] * 2
        assert other[0].status_code == 200
        wait_idle(engine)
        api = [m for m in engine.recent() if m.tag == "api"]
        first_key = {owner_of(m.namespace) for m in api if m.namespace != other_ns(api)}
        assert len(api) == 5 and len(first_key) == 1  # four salts, one owner
        cap = owner_row_cap(engine.scheduler.config)
        for rec in engine.step_log():  # counted as one client, whatever its salts: the rows of one owner
            owners = [owner_of(ns) for ns in rec.namespaces]
            assert owners.count(next(iter(first_key))) <= cap, rec
        # Places are given back when requests end (streamed or not): the cap is free again.
        again = [_post(url, "key-one", 20 + i, salt="again", stream=i % 2 == 0) for i in range(5)]
        assert [r.status_code for r in again] == [200] * 5
    wait_idle(engine)
    assert_clean(engine)


def other_ns(api) -> str:
    """The namespace of the one request sent with the second key (the unsalted one)."""
    return next(m.namespace for m in api if "/anon-" in m.namespace)


def test_a_stream_closed_by_its_client_gives_its_place_back(tiny_runner, make_engine):
    engine = make_engine(tiny_runner, isolation=True, max_new_tokens_cap=64, max_queue=4)  # a cap of one
    with _served(engine) as url:
        body = {"prompt": "A long story, please.", "max_tokens": 64, "temperature": 0, "stream": True}
        started, close = threading.Event(), threading.Event()

        def streamer() -> None:
            with httpx.stream("POST", f"{url}v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                started.set()
                close.wait(60)  # then the client goes away mid-stream

        with tiny_runner.lock:  # the model is busy: the stream holds its place, waiting
            t = threading.Thread(target=streamer)
            t.start()
            assert started.wait(60)
            busy = _post(url, "", 1, salt="other")
            assert busy.status_code == 429  # the one place is taken
            close.set()
            t.join()
        # The client went away: the place comes back once the engine ends the request.
        deadline = time.monotonic() + 60
        while True:
            r = _post(url, "", 2, salt=None)
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.status_code == 200
    wait_idle(engine)
    assert_clean(engine)


def test_page_tabs_from_one_address_are_one_owner_over_the_real_page(tiny_runner, make_engine):
    """Three page sessions (tabs) from this machine's one address ask at once: each runs in a
    namespace of its own, all inside one owner, so they count as one visitor (one owner's rows
    at most) while their texts stay apart; with nobody else waiting they run in the same batches
    (a classroom behind one address is not served one tab at a time)."""
    from components.chat_presets import DEFAULT_SYSTEM

    engine = make_engine(tiny_runner, isolation=True, max_new_tokens_cap=4)
    with launched_app(engine) as url:
        tabs = [visitor(url) for _ in range(3)]
        assert len({t.session_hash for t in tabs}) == 3
        first_id = engine._submitted
        with tiny_runner.lock:  # all three are in the engine before any runs
            jobs = [t.submit(f"Tab {i} asks.", [], DEFAULT_SYSTEM, "", 3, False, api_name="/chat")
                    for i, t in enumerate(tabs)]
            _wait(lambda: engine._submitted >= first_id + 3)  # three submitted (one may sit with the worker)
        for job in jobs:
            job.result(timeout=120)
        wait_idle(engine)
    chats = [m for m in engine.recent() if m.tag == "chat"]
    assert len(chats) == 3
    assert len({m.namespace for m in chats}) == 3  # a namespace per tab
    owners = {owner_of(m.namespace) for m in chats}
    assert len(owners) == 1  # one owner per address
    owner = next(iter(owners))
    cap = owner_row_cap(engine.scheduler.config)
    for rec in engine.step_log():
        assert sum(owner_of(ns) == owner for ns in rec.namespaces) <= cap, rec
    assert any(len(set(rec.namespaces)) == 3 for rec in engine.step_log()), "the tabs ran one at a time"
    assert_clean(engine)
