"""Clients counted as the internet counts them (issue 43), through the real server on the tiny
model: on Spaces an IPv6 client is its /64 (rotating through it buys no more places), an
IPv4-mapped address is its IPv4, and with several ``X-Forwarded-For`` lines the last hop of the
last line (the proxy's) names the client, whatever a client forged before it. Also: deep JSON is
a 400 with no traceback, and a page address that fills its half of the inbox is told so, while
another address still gets in.
"""

from __future__ import annotations

import logging
import threading
import time

import httpx
import pytest
from starlette.datastructures import Headers

from components.chat_presets import DEFAULT_SYSTEM
from server.client_limits import default_max_per_client
from server.request_guard import client_address, connection_origin
from tests.helpers_app import assert_clean, launched_app, shown_logs, visitor, wait_for, wait_idle


@pytest.mark.parametrize(("given", "counted"), [
    ("203.0.113.7", "203.0.113.7"),
    ("::ffff:203.0.113.7", "203.0.113.7"),
    ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
    ("2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:db8:1:2::/64"),
    ("[2001:db8:1:2::9]:443", "2001:db8:1:2::/64"),
    ("203.0.113.7:5555", "203.0.113.7"),
    ("fe80::1%eth0", "fe80::/64"),
    ("testclient", "testclient"),
])
def test_addresses_are_named_as_clients(given, counted):
    assert client_address(given) == counted


def test_the_last_hop_of_the_last_line_names_the_client(monkeypatch):
    monkeypatch.setenv("SYSTEM", "spaces")
    two_lines = Headers(raw=[(b"x-forwarded-for", b"6.6.6.6"), (b"x-forwarded-for", b"198.51.100.4")])
    assert connection_origin(two_lines, "10.0.0.1") == "198.51.100.4"
    merged = Headers(raw=[(b"x-forwarded-for", b"6.6.6.6, 198.51.100.4")])
    assert connection_origin(merged, "10.0.0.1") == "198.51.100.4"
    assert connection_origin({"x-forwarded-for": "::ffff:198.51.100.4"}, None) == "198.51.100.4"
    monkeypatch.delenv("SYSTEM")
    assert connection_origin(two_lines, "::ffff:10.0.0.1") == "10.0.0.1"  # off Spaces: the peer


def _hold_streams(url: str, forwarded: list[list[str]]) -> list[int]:
    """One streamed request per entry (its X-Forwarded-For lines), all at once while the model is
    held; the statuses as soon as each is known."""
    seen: list[int] = []

    def send(lines: list[str]) -> None:
        headers = [("x-forwarded-for", line) for line in lines]
        body = {"prompt": "Rotate.", "max_tokens": 2, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "v1/completions", json=body, headers=headers, timeout=120) as r:
            seen.append(r.status_code)
            r.read()

    threads = [threading.Thread(target=send, args=(lines,)) for lines in forwarded]
    for t in threads:
        t.start()
    wait_for(lambda: len(seen) == len(forwarded), what="every status")
    return sorted(seen), threads


@pytest.mark.parametrize("rotation", ["ipv6-64", "mapped-ipv4", "forged-first-line"])
def test_a_client_rotating_its_address_is_still_one_client(tiny_runner, make_engine, monkeypatch, rotation):
    monkeypatch.setenv("SYSTEM", "spaces")
    engine = make_engine(tiny_runner, isolation=True, max_new_tokens_cap=2, max_queue=32)
    cap = default_max_per_client(True, 32)
    n = cap + 2
    forwarded = {
        "ipv6-64": [[f"2001:db8:5:6::{i + 1:x}"] for i in range(n)],
        "mapped-ipv4": [["::ffff:198.51.100.9" if i % 2 else "198.51.100.9"] for i in range(n)],
        "forged-first-line": [[f"6.6.6.{i}", "198.51.100.9"] for i in range(n)],
    }[rotation]
    with launched_app(engine) as url:
        with tiny_runner.lock:  # nothing finishes while they arrive
            statuses, threads = _hold_streams(url, forwarded)
            assert statuses == [200] * cap + [429] * 2, statuses
            other, more = _hold_streams(url, [["2001:db8:7:7::1"]])  # another /64: its own client
            assert other == [200]
        for t in [*threads, *more]:
            t.join(120)
    wait_idle(engine)
    assert_clean(engine)


def test_deeply_nested_json_is_a_clear_400_and_the_next_request_is_served(tiny_runner, make_engine, caplog):
    engine = make_engine(tiny_runner, max_new_tokens_cap=2)
    with launched_app(engine) as url, caplog.at_level(logging.INFO):
        for body in (b"[" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000, b"[" * 40 + b"]" * 40):
            r = httpx.post(url + "v1/chat/completions", content=body, headers={"content-type": "application/json"},
                           timeout=60)
            assert r.status_code == 400, r.text
            assert "nests deeper" in r.json()["error"]["message"]
        ok = httpx.post(url + "v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200, ok.text
    assert "Traceback" not in caplog.text and "RecursionError" not in caplog.text
    wait_idle(engine)
    assert_clean(engine)


def test_a_page_address_that_fills_its_half_of_the_inbox_is_told_so(tiny_runner, make_engine):
    """Page events from one address (fresh sessions each, as ``POST /gradio_api/call/chat`` opens
    them) stop at half the inbox with a message that says so; another address's visitor still
    gets a place (here: the engine is asked directly, as another address's tab is keyed)."""
    engine = make_engine(tiny_runner, isolation=True, max_new_tokens_cap=2, max_queue=8)
    half = engine.max_waiting_per_owner
    assert half == 4
    with launched_app(engine, max_queue=8) as url:
        first_id = engine._submitted
        with tiny_runner.lock:
            tabs = [visitor(url) for _ in range(half + 1)]
            jobs = []
            for i, t in enumerate(tabs[:half]):
                jobs.append(t.submit(f"Tab {i}.", [], DEFAULT_SYSTEM, "", 2, False, api_name="/chat"))
            wait_for(lambda: engine._submitted >= first_id + half, what="the first tabs' requests")
            extra = tabs[half].submit("One more.", [], DEFAULT_SYSTEM, "", 2, False, api_name="/chat")
            extra.result(timeout=60)
            logs = shown_logs(extra)
            assert any("you already have 4 requests waiting" in msg for msg, _ in logs), logs
            # Another address is not refused: its namespace's owner differs.
            from engine.types import GenerationRequest, SamplingParams

            elsewhere = engine.submit(GenerationRequest(prompt_ids=(5, 6, 7), namespace="v-elsewhere/s-1",
                                                        sampling=SamplingParams(max_new_tokens=2)))
        for job in jobs:
            job.result(timeout=120)
        assert list(elsewhere)[-1].done
        time.sleep(0.1)
    wait_idle(engine)
    assert_clean(engine)
