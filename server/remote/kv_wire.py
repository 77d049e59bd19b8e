"""A remote engine's KV events on the wire: decoding (msgspec) and finding the endpoints.

Owns: the wire format (our own msgspec Structs mirroring vLLM's ``KVEventBatch``: an array
``[ts, events, data_parallel_rank]`` whose events are maps tagged by ``"type"``, unknown
fields ignored; and SGLang's older array form, ``["BlockStored", hashes, parent, tokens,
block_size, lora_id]`` without a medium), and finding the endpoints (``GET
/kv_event_sources`` on the backend, ``*`` replaced by the backend's host; the
``--backend-kv-events`` override). Pure: no sockets, no threads; the subscriber
(``server.remote.kv_events``) uses it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec

from server.remote.block_tree import ClearedEvent, Event, RemovedEvent, StoredEvent

log = logging.getLogger(__name__)

END_SEQ = -1  # the replay endpoint's last frame

# ---------------------------------------------------------------- the wire format
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's and SGLang's batch: ``[ts, events, data_parallel_rank]`` (SGLang's older one has no rank)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _MapEvent(msgspec.Struct, tag_field="type", omit_defaults=True, gc=False):
    """vLLM: events are maps tagged by ``"type"``; fields left at None are omitted."""


class MapBlockStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class MapBlockRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class MapAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


class _ArrayEvent(msgspec.Struct, array_like=True, tag=True, omit_defaults=True, gc=False):
    """SGLang: tagged arrays, the tag (the class name) first; extra trailing fields ignored."""


class BlockStored(_ArrayEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(_ArrayEvent):
    block_hashes: list[int | bytes]
    medium: str | None = None


class AllBlocksCleared(_ArrayEvent):
    pass


AnyEvent = MapBlockStored | MapBlockRemoved | MapAllBlocksCleared | BlockStored | BlockRemoved | AllBlocksCleared
_batch_decoder = msgspec.msgpack.Decoder(EventBatch)
_event_types = {"BlockStored": (MapBlockStored, BlockStored), "BlockRemoved": (MapBlockRemoved, BlockRemoved),
                "AllBlocksCleared": (MapAllBlocksCleared, AllBlocksCleared)}


def decode_event(raw: Any) -> Event | None:
    """One raw event (a map tagged by "type", or an array tagged by its first element) as a
    block-tree event; None for an event type this dashboard does not know."""
    if isinstance(raw, dict):
        kind, form = raw.get("type"), 0
    elif isinstance(raw, list | tuple) and raw:
        kind, form = raw[0], 1
    else:
        return None
    types = _event_types.get(kind) if isinstance(kind, str) else None
    if types is None:
        return None
    e = msgspec.convert(raw, types[form])
    if isinstance(e, MapBlockStored | BlockStored):
        extra = getattr(e, "extra_keys", None)
        if getattr(e, "group_idx", None) not in (None, 0):  # another KV group (hybrid models): not drawn
            return None
        return StoredEvent(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.medium, extra)
    if isinstance(e, MapBlockRemoved | BlockRemoved):
        if getattr(e, "group_idx", None) not in (None, 0):
            return None
        return RemovedEvent(e.block_hashes, e.medium)
    return ClearedEvent()


def decode_batch(payload: bytes) -> tuple[float, list[Event]]:
    """A payload as ``(ts, events)``; raises ``msgspec.DecodeError`` / ``ValidationError``."""
    batch = _batch_decoder.decode(payload)
    events = [e for e in map(decode_event, batch.events) if e is not None]
    return batch.ts, events


# ---------------------------------------------------------------- endpoints
@dataclass(frozen=True)
class EventSource:
    """Where to follow a server's events. ``bind``: the server connects to us (its endpoint
    names a plain host), so we bind; otherwise it binds (``*``) and we connect."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    bind: bool = False


def _swap_star(endpoint: str, host: str) -> str:
    return endpoint.replace("*", host, 1) if "*" in endpoint else endpoint


def source_from_config(config: dict, backend_url: str) -> EventSource | None:
    """vLLM's/SGLang's ``--kv-events-config`` (as ``GET /kv_event_sources`` returns it, one
    entry) as an ``EventSource``: ``*`` becomes the backend's host. None when events are off."""
    if not isinstance(config, dict) or not config.get("enable_kv_cache_events", True):
        return None
    if str(config.get("publisher", "zmq")) != "zmq" or not config.get("endpoint"):
        return None
    host = urlsplit(backend_url).hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    endpoint = str(config["endpoint"])
    replay = config.get("replay_endpoint")
    return EventSource(endpoint=_swap_star(endpoint, host),
                       replay_endpoint=_swap_star(str(replay), host) if replay else None,
                       topic=str(config.get("topic") or ""), bind="*" not in endpoint and endpoint.startswith("tcp"))


def parse_override(text: str) -> EventSource | None | bool:
    """``--backend-kv-events``: "" (ask the backend: True), "off" (None), an endpoint
    ``tcp://host:port`` with an optional ``,tcp://host:replay_port`` and ``,topic=NAME``."""
    text = text.strip()
    if not text:
        return True
    if text.lower() in ("off", "none", "0", "false", "no"):
        return None
    parts = [p.strip() for p in text.split(",") if p.strip()]
    topic = next((p.split("=", 1)[1] for p in parts if p.startswith("topic=")), "kv-events")
    urls = [p for p in parts if "://" in p]
    if not urls:
        raise ValueError(f"expected tcp://host:port[,tcp://host:replay_port][,topic=NAME] or 'off', got {text!r}")
    return EventSource(urls[0], urls[1] if len(urls) > 1 else None, topic)


def discover(http_get: Callable[[str], Any], backend_url: str) -> EventSource | None:
    """The backend's first event source, from ``GET /kv_event_sources`` (``{"0": {...}}``);
    None when it has none (llama.cpp, a server without the flag) or the route fails."""
    try:
        body = http_get("/kv_event_sources")
    except Exception as exc:  # any failure means "no events": the shadow tree stays
        log.info("No KV events from %s (%s)", backend_url, exc)
        return None
    if not isinstance(body, dict) or not body:
        return None
    first = body.get("0", next(iter(body.values())))
    return source_from_config(first, backend_url)
