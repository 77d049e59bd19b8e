"""A remote engine's KV events on the wire: decoding and validating (msgspec), finding the endpoints.

Owns: the wire format (our own msgspec Structs mirroring vLLM's ``KVEventBatch``: an array
``[ts, events, data_parallel_rank]`` whose events are maps tagged by ``"type"``, unknown
fields ignored; and SGLang's older array form, ``["BlockStored", hashes, parent, tokens,
block_size, lora_id]`` without a medium), what a valid batch is, and finding the endpoints
(``GET /kv_event_sources`` on the backend, ``*`` replaced by the backend's host; the
``--backend-kv-events`` override). Pure: no sockets, no threads; the subscriber
(``server.remote.kv_events``) uses it.

Validation: a backend (or anything that can reach its port) may send anything, so every field
is checked before the block tree sees it: hashes are ints or bytes of at most
``MAX_HASH_BYTES``; token ids ints in ``[0, 2**32)``; ``block_size`` an int in ``[1,
MAX_BLOCK_SIZE]``; media and LoRA names short strings; ``extra_keys`` one entry per block,
each None or a short list of scalars (str, int, float, bool, None, bytes) or flat lists of
them, the shapes vLLM publishes (a ``cache_salt``, a LoRA name, multimodal hashes); every
list bounded (``MAX_EVENTS``, ``MAX_BLOCKS``, ``MAX_TOKENS``); ``ts`` finite and >= 0. A
payload that fails any check raises ``WireError`` for the whole batch (``decode_batch``): the
subscriber applies a batch whole or not at all, so a bad one leaves the tree as it was. An
event of a type this dashboard does not know (a map or an array tagged by an unknown name) is
skipped, as vLLM's own consumers do with newer event types; anything else malformed rejects
the batch.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import urlsplit

import msgspec
from msgspec import Meta

from server.remote.block_tree import ClearedEvent, Event, RemovedEvent, StoredEvent

log = logging.getLogger(__name__)

END_SEQ = -1  # the replay endpoint's last frame

# ---------------------------------------------------------------- bounds (far above what a real server sends)
MAX_PAYLOAD_BYTES = 64 << 20  # one batch's msgpack (also the sockets' ZMQ_MAXMSGSIZE)
MAX_EVENTS = 1 << 16  # events in one batch
MAX_BLOCKS = 1 << 16  # hashes in one event (a 2M-token prompt in 32-token blocks)
MAX_TOKENS = 1 << 22  # token ids in one event
MAX_BLOCK_SIZE = 1 << 16
MAX_HASH_BYTES = 64  # vLLM's bytes hashes are SHA-256 digests (32 bytes)
MAX_TOKEN_ID = 2**32 - 1
MAX_NAME = 256  # a medium's or LoRA's name
MAX_KEYS_PER_BLOCK = 64  # extra keys of one block
MAX_KEY_BYTES = 4096  # one extra key (a salt, a multimodal hash)
MAX_KEY_ITEMS = 64  # a nested extra key's items

Hash = int | Annotated[bytes, Meta(min_length=1, max_length=MAX_HASH_BYTES)]
Hashes = Annotated[list[Hash], Meta(max_length=MAX_BLOCKS)]
TokenIds = Annotated[list[Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]], Meta(max_length=MAX_TOKENS)]
BlockSize = Annotated[int, Meta(ge=1, le=MAX_BLOCK_SIZE)]
Name = Annotated[str, Meta(max_length=MAX_NAME)]
SmallInt = Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)]
ExtraKeys = Annotated[list[Any], Meta(max_length=MAX_BLOCKS)]  # the entries' shapes: _check_extra_keys


class WireError(msgspec.DecodeError):
    """A payload that is not a valid event batch (not msgpack, or a field of the wrong type, shape
    or size). A ``msgspec.DecodeError`` (so a ``ValueError``), as the decoders' own errors are."""


# ---------------------------------------------------------------- the wire format
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's and SGLang's batch: ``[ts, events, data_parallel_rank]`` (SGLang's older one has no rank)."""

    ts: Annotated[float, Meta(ge=0.0)]
    events: Annotated[list[Any], Meta(max_length=MAX_EVENTS)]
    data_parallel_rank: SmallInt | None = None


class _MapEvent(msgspec.Struct, tag_field="type", omit_defaults=True, gc=False):
    """vLLM: events are maps tagged by ``"type"``; fields left at None are omitted."""


class MapBlockStored(_MapEvent, tag="BlockStored"):
    block_hashes: Hashes
    block_size: BlockSize
    parent_block_hash: Hash | None = None
    token_ids: TokenIds = []
    lora_id: SmallInt | None = None
    medium: Name | None = None
    lora_name: Name | None = None
    extra_keys: ExtraKeys | None = None
    group_idx: SmallInt | None = None


class MapBlockRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: Hashes
    medium: Name | None = None
    group_idx: SmallInt | None = None


class MapAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


class _ArrayEvent(msgspec.Struct, array_like=True, tag=True, omit_defaults=True, gc=False):
    """SGLang: tagged arrays, the tag (the class name) first; extra trailing fields ignored."""


class BlockStored(_ArrayEvent):
    block_hashes: Hashes
    parent_block_hash: Hash | None
    token_ids: TokenIds
    block_size: BlockSize
    lora_id: SmallInt | None = None
    medium: Name | None = None


class BlockRemoved(_ArrayEvent):
    block_hashes: Hashes
    medium: Name | None = None


class AllBlocksCleared(_ArrayEvent):
    pass


AnyEvent = MapBlockStored | MapBlockRemoved | MapAllBlocksCleared | BlockStored | BlockRemoved | AllBlocksCleared
_batch_decoder = msgspec.msgpack.Decoder(EventBatch)
_event_types = {"BlockStored": (MapBlockStored, BlockStored), "BlockRemoved": (MapBlockRemoved, BlockRemoved),
                "AllBlocksCleared": (MapAllBlocksCleared, AllBlocksCleared)}


def _scalar_ok(x: Any) -> bool:
    if x is None or isinstance(x, bool | int):
        return True
    if isinstance(x, float):
        return math.isfinite(x)
    if isinstance(x, str | bytes):
        return len(x) <= MAX_KEY_BYTES
    return False


def _check_extra_keys(extra: list[Any], blocks: int) -> None:
    """vLLM's ``extra_keys``: one entry per block (at most), each None or a list of keys, a key a
    scalar or a flat list of scalars (a multimodal hash with its offset). Raises ``WireError``."""
    if len(extra) > blocks:
        raise WireError(f"extra_keys has {len(extra)} entries for {blocks} blocks")
    for i, keys in enumerate(extra):
        if keys is None:
            continue
        if not isinstance(keys, list) or len(keys) > MAX_KEYS_PER_BLOCK:
            raise WireError(f"extra_keys[{i}] is not a list of at most {MAX_KEYS_PER_BLOCK} keys")
        for key in keys:
            if isinstance(key, list):
                if len(key) > MAX_KEY_ITEMS or not all(map(_scalar_ok, key)):
                    raise WireError(f"extra_keys[{i}] holds a list that is not a short list of scalars")
            elif not _scalar_ok(key):
                raise WireError(f"extra_keys[{i}] holds a {type(key).__name__}, not a scalar key")


def decode_event(raw: Any) -> Event | None:
    """One raw event (a map tagged by "type", or an array tagged by its first element) as a
    block-tree event; None for an event type this dashboard does not know (or another KV group's
    event). Raises ``msgspec.ValidationError`` / ``WireError`` for a malformed one."""
    if isinstance(raw, dict):
        kind, form = raw.get("type"), 0
    elif isinstance(raw, list) and raw:
        kind, form = raw[0], 1
    else:
        raise WireError(f"an event is a map or a tagged array, not {type(raw).__name__}")
    if not isinstance(kind, str):
        raise WireError(f"an event's type is a string, not {type(kind).__name__}")
    types = _event_types.get(kind)
    if types is None:
        return None
    e = msgspec.convert(raw, types[form])
    if isinstance(e, MapBlockStored | BlockStored):
        extra = getattr(e, "extra_keys", None)
        if extra is not None:
            _check_extra_keys(extra, len(e.block_hashes))
        if getattr(e, "group_idx", None) not in (None, 0):  # another KV group (hybrid models): not drawn
            return None
        return StoredEvent(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.medium, extra)
    if isinstance(e, MapBlockRemoved | BlockRemoved):
        if getattr(e, "group_idx", None) not in (None, 0):
            return None
        return RemovedEvent(e.block_hashes, e.medium)
    return ClearedEvent()


def decode_batch(payload: bytes) -> tuple[float, list[Event]]:
    """A payload as ``(ts, events)``, every field checked (the module docstring); raises
    ``WireError`` for anything else, with what was wrong. Nothing is applied
    here, so a caller that applies only what returns applies a batch whole or not at all."""
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise WireError(f"a payload is bytes, not {type(payload).__name__}")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise WireError(f"a payload of {len(payload):,} bytes (at most {MAX_PAYLOAD_BYTES:,})")
    try:
        batch = _batch_decoder.decode(payload)
        if not math.isfinite(batch.ts):
            raise WireError("ts is not a finite number")
        events = [e for e in map(decode_event, batch.events) if e is not None]
    except WireError:
        raise
    except msgspec.DecodeError as exc:
        raise WireError(f"not msgpack ({exc})") from None
    except msgspec.ValidationError as exc:
        raise WireError(str(exc)) from None
    except RecursionError:
        raise WireError("nested too deep") from None
    except (TypeError, ValueError, OverflowError) as exc:  # msgspec's other refusals (e.g. an unhashable map key)
        raise WireError(f"{type(exc).__name__}: {exc}") from None
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
    entry) as an ``EventSource``: ``*`` becomes the backend's host. A plain host means the server
    connects (we bind), unless ``"publisher_binds": true`` (this app's publisher on its default,
    loopback endpoint) says it bound that host itself. None when events are off."""
    if not isinstance(config, dict) or not config.get("enable_kv_cache_events", True):
        return None
    if str(config.get("publisher", "zmq")) != "zmq" or not config.get("endpoint"):
        return None
    host = urlsplit(backend_url).hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    endpoint = str(config["endpoint"])
    replay = config.get("replay_endpoint")
    publisher_binds = "*" in endpoint or not endpoint.startswith("tcp") or config.get("publisher_binds") is True
    return EventSource(endpoint=_swap_star(endpoint, host),
                       replay_endpoint=_swap_star(str(replay), host) if replay else None,
                       topic=str(config.get("topic") or ""), bind=not publisher_binds)


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
