"""Visitor identity on the page and what the page ships for everyone to share.

Owns: who a page request comes from (``page_visitor``: the address the page is served to,
``server.request_guard.connection_origin``, the same rule the API's per-client limits count
by, and Gradio's session hash; a client cannot choose either), the page's secret salt, the
shipped blocks' token ids (preset system prompts and few-shot sets, tokenized once per engine)
and the running requests Stop cancels. The keying rules themselves (isolation, the
``v-<owner>/s-<session>`` namespace, a namespace of its own without a session, only *whole*
shipped blocks public) are ``engine.cache_keys.KeyRules``, which the HTTP API keys by too:
``page_key`` is a page request's cache key, ``visitor_namespace`` and ``public_len`` its parts.

A panel that needs several namespaces per visitor (one per ordering variant) uses
``sub_namespace``, which stays inside the visitor's own. Fair shares of the cache and the
scheduler's turns count per owner (the part before ``/``), so tabs or invented session hashes
from one address cannot multiply a share, just as ``cache_salt`` values cannot for an API client.
"""

from __future__ import annotations

import secrets
import threading

from components.chat_presets import FEW_SHOT_PRESETS, SYSTEM_PRESETS, few_shot_static_part
from components.panels.engine_state import engine_state
from engine.api import EngineAPI
from engine.cache_keys import KeyRules, Visitor
from engine.types import CacheKey
from server.request_guard import connection_origin

_SALT = secrets.token_bytes(16)  # per server process, never sent to a client


def page_visitor(request) -> Visitor:
    """Who sends a page request, as the server saw it: the address and Gradio's session hash."""
    session = getattr(request, "session_hash", None) if request is not None else None
    return Visitor.page(origin_of(request) if session else "", session)


def _rules(engine: EngineAPI | None, shipped: tuple[tuple[int, ...], ...] = ()) -> KeyRules:
    """The page's keying for ``engine`` (isolating when there is none to ask)."""
    return KeyRules(engine is None or bool(engine.isolation), _SALT, shipped)


def visitor_namespace(request, engine: EngineAPI | None = None) -> str:
    """A private namespace for this visitor's session, inside its owner (its address);
    ``PUBLIC`` (everything shared) when the engine does not isolate visitors."""
    return _rules(engine).namespace(page_visitor(request))


def page_key(engine: EngineAPI, ids: list[int], request) -> CacheKey:
    """The cache key ``ids`` get when this visitor sends them from the page (``KeyRules.key``):
    the visitor's namespace and the shipped blocks' shareable length."""
    return _rules(engine, _public_prefixes(engine)).key(ids, page_visitor(request))


def origin_of(request) -> str:
    """The address a page request comes from (``connection_origin``); "unknown" without one."""
    headers = getattr(request, "headers", None)
    if headers is None or not hasattr(headers, "get"):
        headers = {}
    client = getattr(request, "client", None)
    return connection_origin(headers, getattr(client, "host", None))


def sub_namespace(request, engine: EngineAPI | None, name: str) -> str:
    """A namespace of its own for one part of a visitor's work (an ordering variant),
    inside the visitor's namespace, so it stays private and the visitor's tree view
    still shows it (``EngineAPI.snapshot`` treats ``<viewer>/...`` as the viewer's own)."""
    base = visitor_namespace(request, engine)
    return f"{base}/{name}" if base else name


def _public_prefixes(engine: EngineAPI) -> tuple[tuple[int, ...], ...]:
    """The shipped blocks' token ids, tokenized once per engine (kept by the page, ``engine_state``)."""
    return engine_state(engine, "session.public_prefixes", lambda: _tokenize_shipped(engine))


def _tokenize_shipped(engine: EngineAPI) -> tuple[tuple[int, ...], ...]:
    out = []
    for text in SYSTEM_PRESETS.values():
        out.append(tuple(engine.encode(engine.render_chat([{"role": "system", "content": text}],
                                                          add_generation_prompt=False))))
    for preset in FEW_SHOT_PRESETS.values():
        static = few_shot_static_part(preset["instruction"], preset["examples"])
        rendered = engine.render_chat([{"role": "user", "content": static + "\x00"}])
        out.append(tuple(engine.encode(rendered[: rendered.index("\x00")])))
    # A block's last token may merge with the text that follows it ("\n\n" + "Input"):
    # drop it, so that the rest is a token prefix of every prompt that holds the block.
    return tuple(p[:-1] for p in out if len(p) > 1)


def public_len(engine: EngineAPI, ids: list[int]) -> int:
    """Tokens of ``ids`` that are content shipped with the app (shareable): the longest
    shipped block that ``ids`` starts with in full, else 0."""
    return _rules(engine, _public_prefixes(engine)).public_len(ids)


def own_namespace(request, engine: EngineAPI) -> str | None:
    """What a visitor's history and controls cover: their namespace in isolation
    mode, ``None`` (everything) when the whole cache is shared."""
    return visitor_namespace(request, engine) if engine.isolation else None


class RunningRequests:
    """Each visitor's running request per panel, so that Stop cancels the request itself
    (the engine then ends it with ``finish_reason="cancelled"`` and its partial numbers)
    instead of killing the event that streams it, which left the status stuck."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: dict[tuple[str, str], object] = {}

    @staticmethod
    def _key(request, panel: str) -> tuple[str, str] | None:
        session = getattr(request, "session_hash", None) if request is not None else None
        return (str(session), panel) if session else None

    def started(self, request, panel: str, handle) -> None:
        key = self._key(request, panel)
        if key is not None:
            with self._lock:
                self._handles[key] = handle

    def finished(self, request, panel: str, handle) -> None:
        key = self._key(request, panel)
        if key is not None:
            with self._lock:
                if self._handles.get(key) is handle:
                    del self._handles[key]

    def cancel(self, request, panel: str) -> bool:
        """Cancel this visitor's running request in ``panel``; False when none runs."""
        key = self._key(request, panel)
        with self._lock:
            handle = self._handles.pop(key, None) if key is not None else None
        if handle is None:
            return False
        handle.cancel()
        return True


RUNNING = RunningRequests()

ISOLATION_NOTE = (
    "**Private mode.** Your chat, the prompts you cache and every figure marked *yours* are yours alone: other "
    "visitors never get a cache hit on your text. Shared: the preset system prompts and few-shot sets (cached once "
    "for everyone), and the cache's size and memory (*everyone's*).")
RELOAD_NOTE = "Reloading the page starts a new chat: the conversation is kept only while this page is open."
