"""The HTTP server's guard: Gradio's file routes refused, request bodies capped, for every route.

Owns: ``RequestGuard``, an ASGI middleware for the whole server (Gradio's routes and the
API's beside them), by path only: Gradio's file upload, deep-link (which writes a session's
whole state to a file that is then served), upload-progress, recording and run-history
routes answer 404 before Gradio sees them, and every request body is capped at
``MAX_BODY_BYTES`` (413), with or without a Content-Length: the one body limit of the server
(the API reads it from here). ``guard_middleware`` is what
``launch(app_kwargs={"middleware": ...})`` takes. Also the one rule for where a request comes
from (``connection_origin``), which the API's per-client limits and the page's visitor
namespaces both count by. Knows nothing about Gradio's Blocks or the engine.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re

from starlette.requests import ClientDisconnect

log = logging.getLogger(__name__)
# The largest legitimate body: the chat box's 200,000 characters (at most 3 UTF-8 bytes per
# UTF-16 unit Gradio counts) plus a history that fits the model's context: about 700 KB.
MAX_BODY_BYTES = 2**20
# Routes that accept files or write them: the app takes no files and shares no session state.
REFUSED_PATH = re.compile(r"(^|/)gradio_api/(upload|upload_progress|deep_link|process_recording)/?$"
                          r"|(^|/)(gradio_api/)?(run-history|vibe-|undo-vibe-|proxy=)")


def connection_origin(headers, peer: str | None) -> str:
    """The client a request comes from, as the internet counts clients: on Hugging Face Spaces the
    address the Space's proxy appends last to ``X-Forwarded-For`` (the one entry a client cannot
    forge; with several header lines, the last entry of the last line, since a proxy that appends
    a line puts its own after the client's), else the socket's peer; then as ``client_address``
    names it (an IPv6 client by its /64, an IPv4-mapped one as IPv4). ``headers``: a mapping with
    ``get`` (and ``getlist`` where it has several lines: Starlette's ``Headers``), names in lower
    case as Starlette and Gradio give them."""
    if os.environ.get("SYSTEM") == "spaces":  # behind the Space's proxy: the hop it appended
        lines = headers.getlist("x-forwarded-for") if hasattr(headers, "getlist") else [headers.get("x-forwarded-for")]
        forwarded = [part.strip() for line in lines for part in str(line or "").split(",") if part.strip()]
        if forwarded:
            return client_address(forwarded[-1])
    return client_address(peer) if peer else "unknown"


def client_address(text: str) -> str:
    """One client's name for an address: an IPv4 address as it is, an IPv4-mapped IPv6 one as its
    IPv4, any other IPv6 address as its /64 (what one subscriber line is given, so rotating
    through it buys nothing); text that is no address (a test client's name) as it is, cut."""
    text = text.strip()
    candidate = text[1:text.index("]")] if text.startswith("[") and "]" in text else text  # [v6]:port
    candidate = candidate.split("%", 1)[0]  # a zone index names an interface, not a client
    try:
        address = ipaddress.ip_address(candidate)
    except ValueError:
        host, sep, port = candidate.rpartition(":")  # v4:port
        if sep and port.isdigit() and host.count(":") == 0:
            try:
                return str(ipaddress.IPv4Address(host))
            except ValueError:
                pass
        return text[:200]
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class BodyTooLarge(ClientDisconnect):
    """Raised by the guarded ``receive`` once a body without a Content-Length passes the cap.
    A ``ClientDisconnect``, so code that stops reading on a disconnect stops here too; the
    API answers 413 for it, and whatever else a route answers the guard replaces with 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"Request body too large: the limit is {limit:,} bytes.")
        self.limit = limit


class RequestGuard:
    """ASGI middleware: refuse file routes (404) and bodies over ``max_body_bytes`` (413).

    Path-based and generic: JSON bodies up to the cap pass on any route. A body with no
    Content-Length is counted as it streams; past the cap reading it raises ``BodyTooLarge``,
    and the client gets 413 unless a response had started before: a route's own answer to
    the cut body (a 500 for the disconnect, say) is dropped, unless it is a 413 itself."""

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
        seen, over, started, dropped = 0, False, False, False

        async def counted_receive():
            nonlocal seen, over
            if over:
                raise BodyTooLarge(self.max_body_bytes)
            message = await receive()
            if message.get("type") == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    over = True
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        async def tracked_send(message):
            nonlocal started, dropped
            if message.get("type") == "http.response.start":
                if over and message.get("status") != 413:
                    dropped = True  # the route's answer to a body it could not read: 413 instead
                else:
                    started = True
            if not dropped:
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
