"""The HTTP server's guard: Gradio's file routes refused, request bodies capped, for every route.

Owns: ``RequestGuard``, an ASGI middleware for the whole server (Gradio's routes and the
API's beside them), by path only: Gradio's file upload, deep-link (which writes a session's
whole state to a file that is then served), upload-progress, recording and run-history
routes answer 404 before Gradio sees them, and every request body is capped at
``MAX_BODY_BYTES`` (413), with or without a Content-Length. ``guard_middleware`` is what
``launch(app_kwargs={"middleware": ...})`` takes. Knows nothing about Gradio's Blocks or the engine.
"""

from __future__ import annotations

import json
import logging
import re

log = logging.getLogger(__name__)
# The largest legitimate body: the chat box's 200,000 characters (at most 3 UTF-8 bytes per
# UTF-16 unit Gradio counts) plus a history that fits the model's context: about 700 KB.
MAX_BODY_BYTES = 2**20
# Routes that accept files or write them: the app takes no files and shares no session state.
REFUSED_PATH = re.compile(r"(^|/)gradio_api/(upload|upload_progress|deep_link|process_recording)/?$"
                          r"|(^|/)(gradio_api/)?(run-history|vibe-|undo-vibe-|proxy=)")


class RequestGuard:
    """ASGI middleware: refuse file routes (404) and bodies over ``max_body_bytes`` (413).

    Path-based and generic: JSON bodies up to the cap pass on any route. A body with no
    Content-Length is counted as it streams; past the cap the app reads a disconnect,
    and the client gets 413 if no response has started."""

    def __init__(self, app, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if REFUSED_PATH.search(path):
            log.info("refused a request to %s: route disabled", path[:80])
            await _plain(send, 404, "Not found: this app takes no files and shares no session state.")
            return
        declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            log.info("refused a request to %s: body of %s bytes", path[:80], declared[:20].decode("latin-1"))
            await _plain(send, 413, f"Request body too large: the limit is {self.max_body_bytes:,} bytes.")
            return
        seen, over, started = 0, False, False

        async def counted_receive():
            nonlocal seen, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message.get("type") == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def tracked_send(message):
            nonlocal started
            if message.get("type") == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except Exception:
            if not over or started:
                raise
        if over and not started:
            log.info("refused a request to %s: body over %d bytes", path[:80], self.max_body_bytes)
            await _plain(send, 413, f"Request body too large: the limit is {self.max_body_bytes:,} bytes.")


async def _plain(send, status: int, text: str) -> None:
    body = json.dumps({"detail": text}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def guard_middleware() -> list:
    """``app_kwargs["middleware"]`` for ``demo.launch``: the guard, outermost of the app's own."""
    from starlette.middleware import Middleware

    return [Middleware(RequestGuard)]
