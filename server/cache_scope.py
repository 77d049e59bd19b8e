"""Which cache namespace an API request runs in, like vLLM's ``cache_salt``, and whose it is.

When isolation is off (running locally):

- a request with ``cache_salt`` runs in ``salt-<hmac(secret, salt)>``: the same salt shares
  reuse, different salts never do, and no salt shares with the page's visitors;
- without a salt: ``PUBLIC``, shared with everything.

When isolation is on (a public deployment), every namespace belongs to the *client* that sent
the request (``client_owner``: an HMAC of its identity, its API key or its address, see
``server.client_limits``), so that salts cannot multiply a client's share:

- with a salt: ``<client>/salt-<hmac(secret, salt)>``: the same client's same salt shares
  reuse; different salts, or the same salt from another client, never do;
- without a salt: ``<client>/anon-<random>``: a fresh sub-namespace that shares nothing with
  anyone. Nobody can ever hit what such a request would cache, so it is sent with
  ``store=False``.

Since the engine counts a namespace's owner by the part before ``/``, all of one client's
requests, salted or not, are one owner in the cache's fair share and one visitor for the
scheduler's one-running-request-per-visitor rule. The secret is the server's and is never
sent anywhere: a client cannot pick another client's namespace, only repeat its own salt.
Knows nothing about HTTP or the model.
"""

from __future__ import annotations

import secrets

from engine.namespaces import secret_name
from engine.types import PUBLIC

MAX_SALT_CHARS = 256
CLIENT_PREFIX = "api-"  # every API client's owner name starts so (the page's visitors are ``v-...``)


class CacheScope:
    """Namespaces for API requests; one per app (``secret`` defaults to a random one per process)."""

    def __init__(self, isolation: bool, secret: bytes | None = None) -> None:
        self.isolation = isolation
        self._secret = secret or secrets.token_bytes(16)

    def client_owner(self, client: str) -> str:
        """The owner name of the client with identity ``client`` (its address or key never shows)."""
        return secret_name(CLIENT_PREFIX, self._secret, "client\0" + client, 12)

    def namespace(self, cache_salt: str | None, client: str = "") -> str:
        if not self.isolation:
            return PUBLIC if cache_salt is None else secret_name("salt-", self._secret, cache_salt, 16)
        owner = self.client_owner(client)
        if cache_salt is not None:
            return f"{owner}/{secret_name('salt-', self._secret, cache_salt, 16)}"
        return f"{owner}/anon-{secrets.token_hex(8)}"

    def store(self, cache_salt: str | None) -> bool:
        """Whether the request's prompt and reply are worth caching: not for an unsalted call on
        an isolating server, whose namespace nobody can ever name again."""
        return cache_salt is not None or not self.isolation
