"""Gradio's start-up check of its own page (``components.start_check``): a page slower than
Gradio's one 3 s try still counts as served, a port with nothing on it does not, and every launch
(``launch_kwargs``) installs the patient check."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import gradio.networking
import pytest

from components import start_check
from tests.helpers_app import free_port


class SlowFirst(BaseHTTPRequestHandler):
    """A page whose first answer takes 4 s (a first render on a loaded machine), then at once."""

    answered = 0

    def do_HEAD(self):  # noqa: N802 (http.server's name)
        if SlowFirst.answered == 0:
            time.sleep(4.0)
        SlowFirst.answered += 1
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def slow_page():
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), SlowFirst)
    SlowFirst.answered = 0
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def test_a_slow_first_answer_is_waited_for(slow_page, monkeypatch):
    monkeypatch.setattr(start_check, "ANSWER_TIMEOUT_S", 1.0)  # so the first try times out, as Gradio's does
    assert start_check.page_answers(slow_page, patience_s=30)
    assert SlowFirst.answered >= 1


def test_nothing_listening_fails_at_once():
    t0 = time.monotonic()
    assert not start_check.page_answers(f"http://127.0.0.1:{free_port()}/", patience_s=30)
    assert time.monotonic() - t0 < 5


def test_every_launch_installs_it(monkeypatch):
    from components.demo import launch_kwargs

    monkeypatch.setattr(gradio.networking, "url_ok", lambda url: False)
    launch_kwargs()
    assert gradio.networking.url_ok is start_check.page_answers
