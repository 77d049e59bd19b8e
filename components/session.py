"""Visitor identity on the page, the page's shipped blocks handed to the engine, and Stop.

Owns: who a page request comes from (``page_visitor``: the address the page is served to,
``server.request_guard.connection_origin``, the same rule the API's per-client limits count
by, and Gradio's session hash; a client cannot choose either), handing the engine the page's
shipped blocks once per engine (``share_page_blocks``: the preset system prompts and few-shot
sets as text, which the engine tokenizes) and the running requests Stop cancels.

The keys themselves are the engine's (``EngineAPI.key_for``, by ``engine.cache_keys.KeyRules``,
which the HTTP API keys by too): ``page_keyed`` is a page request keyed for its visitor,
``visitor_namespace`` (and ``sub_namespace``, one per ordering variant, inside the visitor's own)
the namespace alone. Fair shares of the cache and the scheduler's turns count per owner (the
part before ``/``), so tabs or invented session hashes from one address cannot multiply a
share, just as ``cache_salt`` values cannot for an API client. Holds no secret and no token ids.
"""

from __future__ import annotations

import threading

from components.chat_presets import FEW_SHOT_PRESETS, SYSTEM_PRESETS, few_shot_static_part
from components.panels.engine_state import engine_state
from engine.api import EngineAPI, ServingAPI, TextAPI
from engine.cache_keys import KeyedPrompt, Visitor
from engine.types import GenerationRequest
from server.request_guard import connection_origin


def page_visitor(request) -> Visitor:
    """Who sends a page request, as the server saw it: the address and Gradio's session hash."""
    if request is None:  # no HTTP request behind it: nothing says where it came from
        return Visitor.page("", None)
    return Visitor.page(origin_of(request), getattr(request, "session_hash", None))


def origin_of(request) -> str:
    """The address a page request comes from (``connection_origin``); "unknown" without one."""
    headers = getattr(request, "headers", None)
    if headers is None or not hasattr(headers, "get"):
        headers = {}
    client = getattr(request, "client", None)
    return connection_origin(headers, getattr(client, "host", None))


def visitor_namespace(request, engine: ServingAPI) -> str:
    """A private namespace for this visitor's session, inside its owner (its address);
    ``PUBLIC`` (everything shared) when the engine does not isolate visitors."""
    return engine.namespace_for(page_visitor(request))


def sub_namespace(request, engine: ServingAPI, name: str) -> str:
    """A namespace of its own for one part of a visitor's work (an ordering variant),
    inside the visitor's namespace, so it stays private and the visitor's tree view
    still shows it (``EngineAPI.snapshot`` treats ``<viewer>/...`` as the viewer's own)."""
    return engine.namespace_for(page_visitor(request), name)


def own_namespace(request, engine: ServingAPI) -> str | None:
    """What a visitor's history and controls cover: their namespace in isolation
    mode, ``None`` (everything) when the whole cache is shared."""
    return visitor_namespace(request, engine) if engine.isolation else None


def page_keyed(engine: EngineAPI, gen: GenerationRequest, request) -> KeyedPrompt:
    """``gen`` tokenized once and keyed by the engine for the visitor of the page ``request``
    (None: no session), after the page's shipped blocks are shared with this engine."""
    share_page_blocks(engine)
    return engine.key_for(gen, page_visitor(request))


def share_page_blocks(engine: EngineAPI) -> int:
    """Hand the engine the page's shipped blocks, once per engine (kept by ``engine_state``)."""
    return engine_state(engine, "session.shared_blocks", lambda: engine.share_blocks(shipped_block_texts(engine)))


def shipped_block_texts(engine: TextAPI) -> list[str]:
    """Every shipped block as the chat template renders it at the start of a prompt: each
    system preset, and each few-shot set's instruction and examples (up to the query)."""
    out = [engine.render_chat([{"role": "system", "content": text}], add_generation_prompt=False)
           for text in SYSTEM_PRESETS.values()]
    for preset in FEW_SHOT_PRESETS.values():
        static = few_shot_static_part(preset["instruction"], preset["examples"])
        rendered = engine.render_chat([{"role": "user", "content": static + "\x00"}])
        out.append(rendered[: rendered.index("\x00")])
    return out


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
