"""What the page keeps per session, per visitor and per request is bounded, and goes (issue 58:
resident memory grew 15 MiB a minute under steady traffic).

Many page events from fresh sessions (``/gradio_api/call/chat``, as a script or each new tab opens
them) and from many addresses, through the real app on the tiny random Llama as a Space runs it;
then the sessions age past ``SESSION_IDLE_S``: Gradio's per-session state, message queues and
event ids are gone, its per-event records capped, and the app's own per-visitor and per-request
records (Stop's handles, the API's counts per client, the timing memo, the shared views) empty or
within their caps."""

from __future__ import annotations

import time

import httpx
import pytest

from components.chat_presets import DEFAULT_SYSTEM
from tests.helpers_app import assert_clean, free_port, wait_idle

EVENTS = 120


@pytest.fixture
def space_app(tiny_runner, make_engine, monkeypatch):
    import app
    from components.demo import launch_kwargs

    monkeypatch.setenv("SYSTEM", "spaces")
    engine = make_engine(tiny_runner, isolation=True, max_new_tokens_cap=2)
    demo = app.build_app(engine, 32)
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=free_port(), quiet=True,
                **launch_kwargs(app.app_kwargs(engine)))
    try:
        yield demo, engine
    finally:
        demo.close()
        wait_idle(engine)
        assert_clean(engine)


def _sizes(demo) -> dict[str, int]:
    q = demo._queue
    return {"state": len(demo.state_holder.session_data), "messages": len(q.pending_messages_per_session),
            "event ids": len(q.pending_event_ids_session), "analytics": len(q.event_analytics)}


def test_sessions_and_their_records_expire_and_stay_capped(space_app):
    from components.panels.live import MAX_VIEWS
    from components.session import RUNNING
    from server import page_queue
    from server.page_queue import MAX_ANALYTICS, prune_sessions

    demo, engine = space_app
    with httpx.Client(base_url=demo.local_url, timeout=60) as http:
        for i in range(EVENTS):  # each a session of its own, from many addresses; half never read back
            r = http.post("gradio_api/call/chat", headers={"x-forwarded-for": f"10.9.{i // 200}.{i % 200}"},
                          json={"data": [f"hello {i}", [], DEFAULT_SYSTEM, "", 2, False]})
            assert r.status_code == 200, r.text
            if i % 2 == 0:
                http.get(f"gradio_api/call/chat/{r.json()['event_id']}").read()
        for i in range(8):  # the API too: one request per address
            http.post("v1/completions", headers={"x-forwarded-for": f"10.8.0.{i}"},
                      json={"prompt": f"Hi {i}", "max_tokens": 2})
    wait_idle(engine)
    time.sleep(0.5)
    grown = _sizes(demo)
    assert grown["state"] >= EVENTS // 2, grown  # what a soak accumulates, session by session
    assert grown["analytics"] <= MAX_ANALYTICS
    gone = prune_sessions(demo, now=time.time() + page_queue.SESSION_IDLE_S + 1)
    after = _sizes(demo)
    assert gone >= EVENTS // 2 and after["state"] == 0 and after["messages"] == 0 and after["event ids"] == 0, after
    # The app's own per-visitor and per-request records.
    assert not RUNNING._handles
    from analysis.prefill_timing import timer_for
    from components.panels.live import _slot

    timer = timer_for(engine)
    assert timer is None or (len(timer._memo) <= timer.policy.memo_size
                             and len(timer._by_request) <= timer.MAX_REQUEST_TIMINGS)
    shared = _slot(engine).shared
    assert shared is None or len(shared.views) <= MAX_VIEWS  # one snapshot's views, replaced each tick
    assert len(engine.recent()) <= engine.history.maxlen


def test_analytics_records_are_capped(space_app):
    from server.page_queue import MAX_ANALYTICS

    demo, _ = space_app
    assert demo._queue.ANALYTICS_MAX_EVENTS == MAX_ANALYTICS
