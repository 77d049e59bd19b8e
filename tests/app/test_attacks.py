"""Attacks on a public page over the app's own HTTP surface (issue 14), each bounded in count
and time, loopback only, on the tiny random Llama in isolation mode: amplification through the
template linter, files in and out, request bodies, refusals that cost more than the request.

Each test reproduces the attack and checks what must hold; memory is checked on the server
process itself (the app runs in-process), never time."""

from __future__ import annotations

import json
import logging
import resource
from pathlib import Path

import httpx
import pytest

from engine.types import EngineError
from server.request_guard import MAX_BODY_BYTES
from tests.helpers_app import assert_clean, fn_id, launched_app, raw_call, visitor, wait_idle


@pytest.fixture(scope="module")
def app_url(make_module_engine):
    engine = make_module_engine(isolation=True, max_new_tokens_cap=4)
    with launched_app(engine) as url:
        yield url, engine
    wait_idle(engine)
    assert_clean(engine)


def _lint_fn(client) -> int:
    """The template linter's event: the private ``change`` event of the 'Your template' box."""
    box = next(c["id"] for c in client.config["components"] if c.get("props", {}).get("label") == "Your template")
    return next(d["id"] for d in client.config["dependencies"]
                if any(t[0] == box and t[1] == "change" for t in d["targets"]))


def _rss_peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def test_template_amplification_is_refused_cheaply(app_url):
    """2,000 x {a} with two 9,900-character values: 20 million characters per request, tokenized
    twice, took 79 s and 5 GB. Now one short message, and memory grows by at most 300 MB."""
    url, engine = app_url
    client = visitor(url)
    values = "\n".join(json.dumps({"a": c * 9_900}) for c in "xy")
    peak_before = _rss_peak_mb()
    for template in ("{a}" * 2_000, "{a}" * 200, "Q: {a}\n" * 100):
        res = raw_call(url, _lint_fn(client), [template, "", values], timeout_s=60)
        assert res["success"], res
        assert "limit" in str(res["output"][0]), res["output"]
    assert _rss_peak_mb() - peak_before < 300
    res = raw_call(url, _lint_fn(client), ["Static text first.\nQ: {a}", "", values], timeout_s=60)
    assert res["success"] and "limit" not in str(res["output"][0])  # what fits still lints


def _files_under(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*") if p.is_file()} if folder.exists() else set()


def test_uploads_and_deep_links_answer_4xx_and_write_nothing(app_url):
    url, _ = app_url
    import gradio.utils

    folder = Path(gradio.utils.get_upload_folder())
    client = visitor(url)
    client.predict("my secret question", [], "Pirate", "", 2, False, api_name="/chat")  # a session with state
    before = _files_under(folder)
    for route in ("gradio_api/upload", "gradio_api/upload/", "gradio_api/upload?upload_id=abc"):
        r = httpx.post(f"{url}{route}", files={"files": ("x.txt", b"secret prompt")})
        assert r.status_code == 404, (route, r.status_code)
    r = httpx.get(f"{url}gradio_api/deep_link", params={"session_hash": client.session_hash})
    assert r.status_code == 404 and "secret" not in r.text
    assert httpx.get(f"{url}gradio_api/upload_progress", params={"upload_id": "abc"}).status_code == 404
    assert _files_under(folder) == before  # nothing written


def test_request_bodies_are_capped(app_url):
    url, _ = app_url
    client = visitor(url)
    chat = fn_id(client, "chat")
    over = json.dumps({"data": ["x" * MAX_BODY_BYTES, [], "Pirate", "", 2, False], "fn_index": chat,
                       "session_hash": "s1", "event_data": None, "trigger_id": None})
    r = httpx.post(f"{url}gradio_api/queue/join", content=over, headers={"content-type": "application/json"})
    assert r.status_code == 413

    def chunks():  # no Content-Length: counted as it streams
        for _ in range(MAX_BODY_BYTES // 65_536 + 4):
            yield b" " * 65_536

    r = httpx.post(f"{url}gradio_api/queue/join", content=chunks(), headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500
    # The largest legitimate request still passes: the chat box's 200,000 characters, non-ASCII.
    job = client.submit("漢" * 200_000, [], "Pirate", "", 2, False, api_name="/chat")
    job.result()
    from tests.helpers_app import shown_logs

    assert any("far over the limit" in m for m, _ in shown_logs(job))  # the engine's own message, not a 413


def test_malformed_turns_are_refused_with_one_log_line(app_url, caplog):
    """A chat history of 5,000 malformed turns wrote about 15,000 log lines (Gradio printed the
    validation error, three lines per turn); now one line and one short message."""
    url, _ = app_url
    client = visitor(url)
    chat = fn_id(client, "chat")
    lines_before = len(caplog.records)
    with caplog.at_level(logging.INFO):
        res = raw_call(url, chat, ["hello", [{"role": "user", "content": {"bad": 1}}] * 5_000, "Pirate", "", 2,
                                   False], timeout_s=60)
    assert not res["success"] and "malformed" in str(res["error"])
    refused = [r for r in caplog.records[lines_before:] if "malformed" in r.getMessage()]
    assert len(refused) == 1 and len(refused[0].getMessage()) < 200


def test_over_long_prompt_refused_after_a_bounded_prefix(app_url, monkeypatch):
    url, engine = app_url
    client = visitor(url)
    real = engine.runner.text.encode
    tokenized: list[int] = []
    monkeypatch.setattr(engine.runner.text, "encode", lambda text: tokenized.append(len(text)) or real(text))
    # Under the character bound (about 660,000 characters on the real model), far over the token limit.
    text = "word " * (engine.max_prompt_tokens * engine.runner.text.max_token_chars // 10)
    job = client.submit(text, [], "Pirate", "", 2, False, api_name="/chat")
    job.result()
    from tests.helpers_app import shown_logs

    assert any("over the limit" in m for m, _ in shown_logs(job))
    assert tokenized and sum(tokenized) < len(text) // 4, (len(text), tokenized[:5])



def _session(name: str):
    from types import SimpleNamespace

    return SimpleNamespace(session_hash=f"session-{name}")


def test_one_visitor_cannot_flush_another_visitors_cache(tiny_runner, make_engine):
    """Three long unique prompts from one visitor under a small budget evicted everyone else's
    entries and the shipped blocks (global LRU): the other visitor's next turn got 5 of 217
    tokens from the cache. Now the attacker evicts their own entries first, and shipped blocks
    stay pinned: the other visitor keeps at least half of their cached prompt."""
    import random

    from components.chat_presets import CUSTOM_SYSTEM, DEFAULT_SYSTEM, STARTER_QUESTIONS, SYSTEM_PRESETS
    from components.panels.chat_panel import build_request, chat_messages

    engine = make_engine(isolation=True, budget_bytes=800 * tiny_runner.kv_bytes_per_token,
                         max_new_tokens_cap=4)

    def turn(who: str, system: str, history: list[dict], question: str):
        req = build_request(engine, chat_messages(system, history, question), 4, False, _session(who), "chat")
        m = engine.run(req)
        return m, history + [{"role": "user", "content": question}, {"role": "assistant", "content": m.output_text}]

    system = SYSTEM_PRESETS[DEFAULT_SYSTEM]
    _, history = turn("b", system, [], STARTER_QUESTIONS[0])
    before, history = turn("b", system, history, STARTER_QUESTIONS[1])
    def public_tokens() -> int:
        return sum(len(n.key) for n in engine.cache.tree.nodes() if n.namespace == "")

    public_before = public_tokens()
    rng = random.Random(0)
    for i in range(3):  # the attack: long unique prompts
        words = " ".join(f"w{rng.randrange(10**6)}" for _ in range(110))
        try:
            turn("a", "", [], f"{CUSTOM_SYSTEM} {i} {words}")
        except EngineError as exc:  # all KV is in the budget: a prompt past the visitor's room is refused
            assert "shared deployment" in str(exc)
        engine.check_invariants()
    after, _ = turn("b", system, history, STARTER_QUESTIONS[2])
    assert after.cached_tokens >= before.prompt_tokens // 2, (after.cached_tokens, before.prompt_tokens)
    assert public_tokens() >= public_before > 0  # shipped blocks pinned
    engine.check_invariants()


def test_work_for_a_result_stream_never_opened_is_stopped(make_engine):
    """A request only posted to the queue (/queue/join), with nobody reading /queue/data, ran
    to its last token and held the model for everyone; now it is cancelled. A visitor who
    reads the stream still gets every token."""
    import time
    import uuid

    from components.panels.hardening import UNREAD_LIMIT

    # The limit counts messages, and a consumer slower than the engine takes several tokens a
    # message: the tiny model makes ~1,000 tokens a second, so a short answer can end before 64
    # messages pile up when the machine is busy (CI once saw 256 tokens in fewer). Twelve
    # times the limit leaves room for that and still fits the tiny model's 1,024 positions.
    cap = 12 * UNREAD_LIMIT
    engine = make_engine(isolation=True, max_new_tokens_cap=cap)

    def finished(n: int):
        deadline = time.monotonic() + 120
        while len(engine.recent()) < n and time.monotonic() < deadline:
            time.sleep(0.1)
        return engine.recent()[-1]

    with launched_app(engine) as url:
        chat = fn_id(visitor(url), "chat")
        args = ["hello there", [], "Pirate", "", cap, False]
        body = {"data": args, "fn_index": chat, "session_hash": uuid.uuid4().hex[:11], "event_data": None,
                "trigger_id": None}
        assert httpx.post(f"{url}gradio_api/queue/join", json=body).status_code == 200  # and never read
        m = finished(1)
        assert m.finish_reason == "cancelled" and m.output_tokens < cap, (m.finish_reason, m.output_tokens)
        assert raw_call(url, chat, args)["success"]
        m = finished(2)
        assert m.finish_reason == "length" and m.output_tokens == cap
        wait_idle(engine)
    assert_clean(engine)
