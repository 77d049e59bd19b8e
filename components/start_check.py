"""Gradio's start-up check of its own page, made patient.

``demo.launch()`` asks whether the page answers on localhost before it returns: one HEAD request
with a 3 s timeout, and a timeout counts as "not accessible", so the launch stops with "When
localhost is not accessible, a shareable link must be created". On a loaded machine (two cores, a
benchmark or another test run beside the app) the first render of this page takes longer than
that now and then, and ``python app.py`` would not start. Here a slow answer is asked again, for up
to ``PATIENCE_S``; a refused connection (nothing listening) still fails at once, as in Gradio.
"""

from __future__ import annotations

import time

import gradio.networking
import httpx

PATIENCE_S = 60.0
ANSWER_TIMEOUT_S = 10.0
SERVED = (200, 301, 302, 303, 307, 308, 401)  # Gradio's own list: a redirect or an auth wall is served


def page_answers(url: str, patience_s: float = PATIENCE_S) -> bool:
    """Whether ``url`` answers a HEAD request within ``patience_s`` (slow answers asked again)."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            if httpx.head(url, timeout=ANSWER_TIMEOUT_S, verify=False).status_code in SERVED:
                return True
        except httpx.TimeoutException:
            pass
        except (ConnectionError, httpx.ConnectError):
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)


def install() -> None:
    """Gradio's launch asks ``page_answers`` instead of its one-shot check (idempotent)."""
    gradio.networking.url_ok = page_answers
