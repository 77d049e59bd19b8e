"""Limits per API client on a public deployment: who a client is, and how many requests it may
have queued or running at once.

Owns: ``client_identity`` (the API key a request carries, when the server takes keys; else the
address it connects from, ``request_guard.connection_origin``: the socket's peer, or on Hugging
Face Spaces the address the Space's proxy appends last to ``X-Forwarded-For``) and
``ClientLimits``, a count of each client's requests in flight (queued or running) with a cap:
past it the request is refused at once with 429 and ``Retry-After``, so one client never fills
the engine's shared inbox (``max_queue``) and inventing ``cache_salt`` values buys nothing.
Shares in the cache and turns in the scheduler follow the same identity (the engine keys by
``server.cache_scope.api_visitor``).
Knows nothing about the engine or the model.
"""

from __future__ import annotations

import threading

from server.openai_protocol import ApiError
from server.request_guard import connection_origin


def client_identity(headers, peer: str | None, keyed: bool) -> str:
    """``key:<key>`` when the server takes API keys (the key names the client), else
    ``addr:<address>``. ``headers``: the request's (case-insensitive mapping)."""
    if keyed:
        given = headers.get("authorization", "")
        return "key:" + given.removeprefix("Bearer ").strip()
    return "addr:" + connection_origin(headers, peer)


def default_max_per_client(isolation: bool, max_queue: int) -> int | None:
    """A public deployment: at most a quarter of the shared inbox per client (at least 1, at most
    4); locally: no cap (load tests send many requests from one address)."""
    return max(1, min(4, max_queue // 4)) if isolation else None


class Lease:
    """One request's place in its client's count; ``release`` is idempotent."""

    def __init__(self, limits: ClientLimits | None, client: str) -> None:
        self._limits, self.client = limits, client

    def release(self) -> None:
        limits, self._limits = self._limits, None
        if limits is not None:
            limits._release(self.client)


class ClientLimits:
    """At most ``max_per_client`` requests in flight per client (None: no cap, only counted)."""

    def __init__(self, max_per_client: int | None) -> None:
        self.max_per_client = max_per_client
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}

    def take(self, client: str) -> Lease:
        """A place for one more of ``client``'s requests, or ``ApiError`` 429 when it has its cap."""
        with self._lock:
            n = self._in_flight.get(client, 0)
            if self.max_per_client is not None and n >= self.max_per_client:
                raise ApiError(429, f"Too many requests at once from this client: at most {self.max_per_client} "
                               "may be queued or running; wait for one to finish and try again.",
                               "rate_limit_exceeded", None, "too_many_requests")
            self._in_flight[client] = n + 1
        return Lease(self, client)

    def in_flight(self, client: str) -> int:
        with self._lock:
            return self._in_flight.get(client, 0)

    def _release(self, client: str) -> None:
        with self._lock:
            n = self._in_flight.get(client, 0) - 1
            if n > 0:
                self._in_flight[client] = n
            else:
                self._in_flight.pop(client, None)
