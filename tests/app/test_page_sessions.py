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
    from components.page_sessions import MAX_ANALYTICS, SESSION_IDLE_S, prune_sessions
    from components.panels.live import MAX_VIEWS
    from components.session import RUNNING

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
    gone = prune_sessions(demo, now=time.time() + SESSION_IDLE_S + 1)
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
    from components.page_sessions import MAX_ANALYTICS

    demo, _ = space_app
    assert demo._queue.ANALYTICS_MAX_EVENTS == MAX_ANALYTICS


def test_a_new_session_makes_block_configs_only_when_read(space_app):
    """Issue 58's flood: Gradio made a config of every block at a session's start, and again for
    each output an event changed, on the event loop (py-spy: three quarters of its time while one
    address's flood opened sessions). Lean sessions make none while serving a chat; a deep link's
    read still gets what Gradio's own session holds after the same changes."""
    import gradio as gr
    from gradio.state_holder import SessionState

    from components.page_sessions import lean_session

    demo, engine = space_app
    with httpx.Client(base_url=demo.local_url, timeout=60) as http:  # the first join makes new sessions lean
        r = http.post("gradio_api/call/chat", headers={"x-forwarded-for": "192.0.2.77"},
                      json={"data": ["hello lean", [], DEFAULT_SYSTEM, "", 2, False]})
        assert "hello lean" in http.get(f"gradio_api/call/chat/{r.json()['event_id']}").text
    wait_idle(engine)
    holder = demo.state_holder
    served = holder.session_data[next(reversed(holder.session_data))]
    assert type(served).__name__ == "_LeanSession" and dict.__len__(served.config_values) == 0

    eager, lean = SessionState(demo), lean_session(demo)
    assert vars(lean).keys() == vars(eager).keys()  # a Gradio that adds a field fails here
    blocks = demo.default_config.blocks
    box = next(k for k, b in blocks.items() if isinstance(b, gr.Markdown))
    text = next(k for k, b in blocks.items() if isinstance(b, gr.Textbox) and k != box)
    state = next(k for k, b in blocks.items() if isinstance(b, gr.State))
    for s in (eager, lean):  # what an event's outputs do to a session
        s._update_value_in_config(box, "**new**")
        s[text] = gr.Textbox(label="changed", render=False)
        s._update_config(text)
        s._update_value_in_config(text, "typed")
        s[state] = {"kept": 1}
        s._update_value_in_config(box, "**newer**")
    assert lean[state] == eager[state] == {"kept": 1}
    assert dict(lean.config_values.items()) == eager.config_values
    assert list(lean.components) == list(eager.components)
