"""Which cache namespace an API request runs in, like vLLM's ``cache_salt``.

- a request with ``cache_salt`` runs in ``salt-<hmac(secret, salt)>``: the same salt shares
  reuse, different salts never do, and no salt shares with the page's visitors;
- without a salt, when isolation is off (running locally): ``PUBLIC``, shared with everything;
- without a salt, when isolation is on (a public deployment): ``api-anon/<random>``, a fresh
  sub-namespace of one owner, ``api-anon``. The request shares nothing with anyone, and since
  the engine counts a namespace's owner by the part before ``/``, all unsalted calls together
  are one owner in the cache's fair share and one visitor for the scheduler's
  one-running-request-per-visitor rule (so they run one at a time, however many arrive).
  Nobody can ever hit what such a request would cache, so it is sent with ``store=False``.

The secret is the server's and is never sent anywhere: a client cannot pick another
client's namespace, only repeat its own salt. Knows nothing about HTTP or the model.
"""

from __future__ import annotations

import secrets

from engine.namespaces import secret_name
from engine.types import PUBLIC

MAX_SALT_CHARS = 256
ANON_OWNER = "api-anon"  # the one owner of every unsalted request's namespace when isolating


class CacheScope:
    """Namespaces for API requests; one per app (``secret`` defaults to a random one per process)."""

    def __init__(self, isolation: bool, secret: bytes | None = None) -> None:
        self.isolation = isolation
        self._secret = secret or secrets.token_bytes(16)

    def namespace(self, cache_salt: str | None) -> str:
        if cache_salt is not None:
            return secret_name("salt-", self._secret, cache_salt, 16)
        if not self.isolation:
            return PUBLIC
        return f"{ANON_OWNER}/{secrets.token_hex(8)}"

    def store(self, cache_salt: str | None) -> bool:
        """Whether the request's prompt and reply are worth caching: not for an unsalted call on
        an isolating server, whose namespace nobody can ever name again."""
        return cache_salt is not None or not self.isolation
