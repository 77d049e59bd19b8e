"""Which cache namespace an API request runs in, like vLLM's ``cache_salt``.

- a request with ``cache_salt`` runs in ``salt-<hmac(secret, salt)>``: the same salt shares
  reuse, different salts never do, and no salt shares with the page's visitors;
- without a salt, when isolation is off (running locally): ``PUBLIC``, shared with everything;
- without a salt, when isolation is on (a public deployment): a fresh namespace of its own,
  so the request shares nothing with anyone.

The secret is the server's and is never sent anywhere: a client cannot pick another
client's namespace, only repeat its own salt. Knows nothing about HTTP or the model.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from engine.radix_tree import PUBLIC

MAX_SALT_CHARS = 256


class CacheScope:
    """Namespaces for API requests; one per app (``secret`` defaults to a random one per process)."""

    def __init__(self, isolation: bool, secret: bytes | None = None) -> None:
        self.isolation = isolation
        self._secret = secret or secrets.token_bytes(16)

    def namespace(self, cache_salt: str | None) -> str:
        if cache_salt is not None:
            digest = hmac.new(self._secret, cache_salt.encode("utf-8", "surrogatepass"), hashlib.sha256)
            return "salt-" + digest.hexdigest()[:16]
        if not self.isolation:
            return PUBLIC
        return "api-anon-" + secrets.token_hex(8)
