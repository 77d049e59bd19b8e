"""Input hygiene for every event handler of the app, applied once to the built Blocks.

A visitor's browser, or anyone calling the API, can send strings holding lone UTF-16
surrogates (``"\\ud800"``): JSON carries them as escapes, but UTF-8 cannot encode them.
The engine copes (it replaces them before tokenizing), yet a handler that echoes such
text into an output (the chat history, a table of queries, a template) makes Gradio's
response serialization (orjson) fail, and the visitor's event stream breaks off.

``sanitize_handlers(demo)`` wraps each handler so that every string in its inputs, also
inside lists, tuples and dicts (chat histories, tables), reaches it with lone surrogates
replaced by U+FFFD. Other values (requests, event data, session state) pass untouched.
A wrapped generator handler also stops (and closes what it streams from, which cancels
the engine request) when its visitor never opened the result stream: an event posted
to ``/gradio_api/queue/join`` with nobody reading ``/queue/data`` would otherwise run
to its last token, holding the model for everyone. Gradio keeps each session's unread
messages in a queue; ``UNREAD_LIMIT`` of them unread means nobody is listening (a
reader drains them as they come). A stream that was opened and then closed is
already stopped by Gradio (it drops the generator, which cancels the request).

``quiet_input_errors(demo)``: input that Gradio itself refuses (a chat history whose
5,000 turns are malformed fails Gradio's validation with 5,000 errors) is answered with
one short message and logged as one line, not a traceback of three lines per error.

``RequestGuard``: an ASGI middleware for the whole server (Gradio's routes and any
others mounted beside them), by path only: Gradio's file upload, deep-link (which
writes a session's whole state to a file that is then served), upload-progress,
recording and run-history routes answer 404 before Gradio sees them, and every
request body is capped at ``MAX_BODY_BYTES`` (413), with or without a Content-Length.
``launch_kwargs`` in ``components/demo.py`` installs it.

``harden(demo)`` applies the handler wrappers and Gradio's cache cleaning. Knows nothing about the panels themselves.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import re
from collections.abc import Callable
from typing import Any

import gradio as gr

from engine.validation import valid_text

log = logging.getLogger(__name__)
MALFORMED_INPUT = "The request's inputs are malformed: reload the page and try again."
# The largest legitimate body: the chat box's 200,000 characters (at most 3 UTF-8 bytes per
# UTF-16 unit Gradio counts) plus a history that fits the model's context: about 700 KB.
MAX_BODY_BYTES = 2**20
# Routes that accept files or write them: the app takes no files and shares no session state.
REFUSED_PATH = re.compile(r"(^|/)gradio_api/(upload|upload_progress|deep_link|process_recording)/?$"
                          r"|(^|/)(gradio_api/)?(run-history|vibe-|undo-vibe-|proxy=)")
UNREAD_LIMIT = 64  # unread stream messages of one session: nobody is listening
CACHE_CLEANING = (3600, 3600)  # Gradio's delete_cache: every hour, files older than an hour


def clean(value: Any) -> Any:
    """``value`` with lone surrogates replaced in every string it holds (plain containers only).

    Returns the very same object when there was nothing to replace, so session state that
    a handler updates in place stays the object Gradio keeps."""
    if isinstance(value, str):
        return valid_text(value)
    if type(value) in (list, tuple):
        items = [clean(v) for v in value]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        return items if type(value) is list else tuple(items)
    if type(value) is dict:
        pairs = [(clean(k), clean(v)) for k, v in value.items()]
        if all(k2 is k and v2 is v for (k2, v2), (k, v) in zip(pairs, value.items(), strict=True)):
            return value
        return dict(pairs)
    return value


def sanitized(fn: Callable) -> Callable:
    """``fn`` taking cleaned arguments; generator functions stay generator functions
    (Gradio streams them), and the signature (``gr.Request`` parameters) is kept."""
    if getattr(fn, "__sanitized__", False) or inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        return fn
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def gen_wrapper(*args, **kwargs):
            inner = fn(*clean(args), **{k: clean(v) for k, v in kwargs.items()})
            try:
                for value in inner:
                    yield value
                    unread = unread_messages()
                    if unread >= UNREAD_LIMIT:
                        log.info("stopped %s: %d messages of its result stream unread", fn.__name__, unread)
                        return
            finally:
                inner.close()  # the handler's own cleanup runs now: its engine request is cancelled

        wrapper = gen_wrapper
    else:
        @functools.wraps(fn)
        def plain_wrapper(*args, **kwargs):
            return fn(*clean(args), **{k: clean(v) for k, v in kwargs.items()})

        wrapper = plain_wrapper
    wrapper.__sanitized__ = True  # type: ignore[attr-defined]
    return wrapper


def unread_messages() -> int:
    """Messages Gradio holds unread for the session of the event being handled (0 outside one)."""
    try:
        from gradio.context import LocalContext

        blocks, request = LocalContext.blocks.get(None), LocalContext.request.get(None)
        session = getattr(request, "session_hash", None)
        queue = blocks._queue.pending_messages_per_session.get(session) if blocks and session else None
        return queue.qsize() if queue is not None else 0
    except Exception:  # Gradio internals moved: never break a handler over this check
        return 0


def sanitize_handlers(demo: gr.Blocks) -> gr.Blocks:
    """Wrap every handler of ``demo`` in place (idempotent); returns ``demo``."""
    wrapped: dict[int, Callable] = {}  # one wrapper per function, however many events call it
    for block in demo.fns.values():
        if block.fn is not None:
            block.fn = wrapped.setdefault(id(block.fn), sanitized(block.fn))
    return demo


def quiet_input_errors(demo: gr.Blocks) -> gr.Blocks:
    """Refuse input that fails Gradio's own checks (before any handler runs) with one log line.

    Gradio prints the whole exception of a failed event; for a pydantic validation error
    that is three lines per malformed value, and its text echoes the values. Raising a
    ``gr.Error`` with ``print_exception=False`` instead keeps the visitor's message short
    and the log to the one line written here. Idempotent."""
    original = demo.preprocess_data
    if getattr(original, "__quiet__", False):
        return demo

    @functools.wraps(original)
    async def preprocess_data(*args, **kwargs):
        try:
            return await original(*args, **kwargs)
        except gr.Error:
            raise
        except Exception as exc:
            count = exc.error_count() if callable(getattr(exc, "error_count", None)) else 1
            log.warning("refused a request: malformed inputs (%s, %d error%s)", type(exc).__name__, count,
                        "" if count == 1 else "s")
            raise gr.Error(MALFORMED_INPUT, print_exception=False) from None

    preprocess_data.__quiet__ = True  # type: ignore[attr-defined]
    demo.preprocess_data = preprocess_data  # type: ignore[method-assign]
    return demo


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


def harden(demo: gr.Blocks) -> gr.Blocks:
    """Everything in this module that applies to ``demo`` (the server's middleware goes to
    ``launch``): clean handler inputs, quiet refusals, and Gradio's temporary files deleted
    on a schedule and when the server stops. Returns ``demo``."""
    demo.delete_cache = demo.delete_cache or CACHE_CLEANING
    return quiet_input_errors(sanitize_handlers(demo))
