"""Cache keys: the one place where a visitor and a prompt's ids become the request's cache key.

Owns: ``Visitor`` (who sends a request, as the server saw it: a page tab from an address, or an
API client with its optional ``cache_salt``), ``KeyRules`` (one deployment's keying: whether
it isolates visitors, the secret its names are made with, the shipped blocks everyone may share),
whose ``key`` gives a request's ``CacheKey`` (namespace and shareable length) and ``store``
whether it is worth caching at all, and ``KeyedPrompt``, what ``EngineAPI.key_for`` answers.
The engine holds its ``KeyRules`` (``engine.facade.FacadeBase``): the page and the HTTP API hand
it a request and a ``Visitor`` and get the key back, so they cannot disagree.

The rules, with isolation off (running locally):

- a page visitor runs in ``PUBLIC``: everything is shared;
- an API request runs in ``PUBLIC`` without a ``cache_salt``, and in ``salt-<hmac(salt)>``
  with one: the same salt shares reuse, different salts never do, nor do salts and the page.

With isolation on (a public deployment), every namespace is ``<owner>/<part>``, and the owner
(the part before ``/``, ``engine.namespaces.owner_of``) is what fair shares and the scheduler's
turns count by, so sessions or salts cannot multiply one address's or one client's share:

- a page visitor: ``v-<hmac(origin)>/s-<hmac(session)>``; the session (a page tab) is the
  namespace, so no other visitor nor another tab gets a hit on it; a request with no session
  gets ``v-<hmac(origin)>/anon-<random>``, a namespace of its own inside its address's (never
  the shared one, and no fair share or waiting place of its own), or ``v-anon-<random>`` when
  nothing says where it came from (no HTTP request at all);
- an API client: ``api-<hmac(client)>/salt-<hmac(salt)>``, or ``.../anon-<random>`` without a
  salt; nobody can ever name such a namespace again, so that request is not stored.

A ``sub`` name (one ordering variant of the lab) keys inside the visitor's namespace:
``<namespace>/<sub>`` (just ``<sub>`` where the namespace is ``PUBLIC``).

Shareable length, for a page visitor: the longest shipped block (a preset's tokens, which the
page registers with ``EngineAPI.share_blocks``) that the ids start with *in full*; a prompt that
merely starts like one shares nothing, or the point where it left the block would show in the
public tree. An API request shares no block (0).

The secret never leaves the process: a client cannot pick another's namespace, only repeat its
own salt. Knows nothing about HTTP, Gradio, tokenizers or the model.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from engine.namespaces import secret_name
from engine.types import PUBLIC, CacheKey, GenerationRequest

PAGE_PREFIX = "v-"  # every page visitor's owner name starts so
CLIENT_PREFIX = "api-"  # every API client's owner name starts so


@dataclass(frozen=True)
class Visitor:
    """Who sends a request, as the server saw it (never as a client claims it).

    ``kind`` "page": ``identity`` is the address the page is served to, ``scope`` the
    session hash (None: no session). ``kind`` "api": ``identity`` is the client (its key or
    address), ``scope`` the request's ``cache_salt`` (None: no salt)."""

    kind: Literal["page", "api"]
    identity: str
    scope: str | None

    @classmethod
    def page(cls, origin: str, session: str | None) -> Visitor:
        return cls("page", origin, str(session) if session else None)

    @classmethod
    def api(cls, client: str, cache_salt: str | None) -> Visitor:
        return cls("api", client, cache_salt)


@dataclass(frozen=True)
class KeyRules:
    """One deployment's keying (see the module's docstring for the rules)."""

    isolation: bool
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(16), repr=False)
    shipped: tuple[tuple[int, ...], ...] = ()  # token ids of the blocks everyone may share

    def owner(self, visitor: Visitor) -> str:
        """Whose the visitor's namespaces are under isolation (its address or key never shows)."""
        if visitor.kind == "api":
            return secret_name(CLIENT_PREFIX, self.secret, "client\0" + visitor.identity, 12)
        return secret_name(PAGE_PREFIX, self.secret, "origin\0" + visitor.identity, 12)

    def namespace(self, visitor: Visitor, sub: str | None = None) -> str:
        """The visitor's namespace; with ``sub``, a namespace of its own inside it."""
        base = self._namespace(visitor)
        if not sub:
            return base
        return f"{base}/{sub}" if base else sub

    def _namespace(self, visitor: Visitor) -> str:
        if visitor.kind == "api":
            if not self.isolation:
                return PUBLIC if visitor.scope is None else self._salt(visitor.scope)
            part = self._salt(visitor.scope) if visitor.scope is not None else "anon-" + secrets.token_hex(8)
            return f"{self.owner(visitor)}/{part}"
        if not self.isolation:
            return PUBLIC
        if not visitor.scope:  # no session: a namespace nobody can name again, shared with no one
            part = "anon-" + secrets.token_hex(6)  # still its address's: it buys no share of its own
            return f"{self.owner(visitor)}/{part}" if visitor.identity else PAGE_PREFIX + part
        return f"{self.owner(visitor)}/{secret_name('s-', self.secret, visitor.scope, 12)}"

    def _salt(self, cache_salt: str) -> str:
        return secret_name("salt-", self.secret, cache_salt, 16)

    def public_len(self, ids: Sequence[int]) -> int:
        """Tokens of ``ids`` that everyone may share: the longest shipped block ``ids`` start with."""
        ids = tuple(ids)
        return max((len(p) for p in self.shipped if ids[: len(p)] == p), default=0)

    def store(self, visitor: Visitor) -> bool:
        """Whether the request's prompt and reply are worth caching: not for an unsalted API call
        on an isolating server, whose namespace nobody can ever name again."""
        return not (visitor.kind == "api" and visitor.scope is None and self.isolation)

    def key(self, ids: Sequence[int], visitor: Visitor, sub: str | None = None) -> CacheKey:
        """The cache key of ``ids`` sent by ``visitor``: the one function both the page and the API key by."""
        shared = self.public_len(ids) if visitor.kind == "page" else 0  # the API shares no block
        return CacheKey(tuple(ids), self.namespace(visitor, sub), shared)


@dataclass(frozen=True)
class KeyedPrompt:
    """A request's prompt as the engine keys it (``EngineAPI.key_for``): its ``key`` (the ids,
    the namespace, the shareable length), ``matched_len`` (tokens of it the engine would reuse
    if it ran now, see ``EngineAPI``'s contract) and ``store`` (whether it is worth caching)."""

    key: CacheKey
    matched_len: int
    store: bool = True

    @property
    def ids(self) -> tuple[int, ...]:
        return self.key.ids

    def request(self, base: GenerationRequest) -> GenerationRequest:
        """``base`` as submitted with this key: the ids (tokenized once), the namespace, the
        shareable length and ``store`` set; sampling, tag and the rest kept."""
        return replace(base, messages=None, prompt=None, prompt_ids=self.key.ids, namespace=self.key.namespace,
                       public_len=self.key.public_len, store=self.store)


def shipped_part(key: CacheKey) -> CacheKey | None:
    """The shareable part of ``key`` as everyone's (``PUBLIC``) key, for warming it before a
    visitor comes; None when nothing of it is shareable."""
    n = key.public_len
    return CacheKey(key.ids[:n], PUBLIC, n) if n else None
