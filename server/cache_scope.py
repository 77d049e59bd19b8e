"""Which cache namespace an API request runs in, like vLLM's ``cache_salt``, and whose it is.

Owns one ``engine.cache_keys.KeyRules`` per app (its secret defaults to a random one per
process) and hands the routes its answers for an API client: the namespace of a request with
or without ``cache_salt``, whether it is worth storing, and the client's owner name (an HMAC
of its identity, its API key or its address, see ``server.client_limits``). The rules
themselves (isolation, ``salt-`` and ``anon-`` parts, never storing an unsalted call on an
isolating server) live in ``engine.cache_keys``, which the page keys by too.

Since the engine counts a namespace's owner by the part before ``/``, all of one client's
requests, salted or not, are one owner in the cache's fair share and one visitor for the
scheduler's one-running-request-per-visitor rule. Knows nothing about HTTP or the model.
"""

from __future__ import annotations

from engine.cache_keys import CLIENT_PREFIX, KeyRules, Visitor

__all__ = ["CLIENT_PREFIX", "MAX_SALT_CHARS", "CacheScope"]

MAX_SALT_CHARS = 256


class CacheScope:
    """Namespaces for API requests; one per app (``secret`` defaults to a random one per process)."""

    def __init__(self, isolation: bool, secret: bytes | None = None) -> None:
        self.isolation = isolation
        self.rules = KeyRules(isolation, secret) if secret else KeyRules(isolation)

    def client_owner(self, client: str) -> str:
        """The owner name of the client with identity ``client`` (its address or key never shows)."""
        return self.rules.owner(Visitor.api(client, None))

    def namespace(self, cache_salt: str | None, client: str = "") -> str:
        return self.rules.namespace(Visitor.api(client, cache_salt))

    def store(self, cache_salt: str | None) -> bool:
        """Whether the request's prompt and reply are worth caching (``KeyRules.store``)."""
        return self.rules.store(Visitor.api("", cache_salt))
