"""Which cache namespace an API request runs in, like vLLM's ``cache_salt``: the API's visitor.

Owns turning an API request into the ``engine.cache_keys.Visitor`` the engine keys by (the
client, its API key or its address, see ``server.client_limits``, and its optional
``cache_salt``) and ``keyed_request``: the request tokenized once and keyed by the engine
(``EngineAPI.key_for``). The rules themselves (isolation, ``salt-`` and ``anon-`` parts, never
storing an unsalted call on an isolating server, the engine's secret) are the engine's, which
keys the page by the same ``KeyRules``.

Since the engine counts a namespace's owner by the part before ``/``, all of one client's
requests, salted or not, are one owner in the cache's fair share and one visitor for the
scheduler's one-running-request-per-visitor rule. Knows nothing about HTTP or the model.
"""

from __future__ import annotations

from engine.api import ServingAPI
from engine.cache_keys import CLIENT_PREFIX, Visitor
from engine.types import GenerationRequest

__all__ = ["CLIENT_PREFIX", "MAX_SALT_CHARS", "api_visitor", "keyed_request"]

MAX_SALT_CHARS = 256


def api_visitor(client: str, cache_salt: str | None) -> Visitor:
    """The API client ``client`` (as ``client_limits.client_identity`` names it) with its salt."""
    return Visitor.api(client, cache_salt)


def keyed_request(engine: ServingAPI, gen: GenerationRequest, client: str, cache_salt: str | None) -> GenerationRequest:
    """``gen`` as the engine runs it for this client: tokenized once (same errors as ``submit``)
    and keyed (namespace, ``store``; an API request shares no shipped block)."""
    return engine.key_for(gen, api_visitor(client, cache_salt)).request(gen)
