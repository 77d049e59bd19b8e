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

The HTTP side of the same hygiene (file routes refused, bodies capped) is the server's:
``server/request_guard.py``, installed by ``launch_kwargs`` in ``components/demo.py``.

``harden(demo)`` applies the handler wrappers and Gradio's cache cleaning. Knows nothing about the panels themselves.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import gradio as gr

from engine.validation import valid_text

log = logging.getLogger(__name__)
MALFORMED_INPUT = "The request's inputs are malformed: reload the page and try again."
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


def harden(demo: gr.Blocks) -> gr.Blocks:
    """Everything in this module that applies to ``demo`` (the server's middleware goes to
    ``launch``): clean handler inputs, quiet refusals, and Gradio's temporary files deleted
    on a schedule and when the server stops. Returns ``demo``."""
    demo.delete_cache = demo.delete_cache or CACHE_CLEANING
    return quiet_input_errors(sanitize_handlers(demo))
