"""vLLM's KV-event messages as this engine writes them, and the hashes that name its blocks.

Owns: the msgspec Structs of what goes out (``EventBatch`` ``[ts, events, data_parallel_rank]``,
its events maps tagged by ``"type"`` like vLLM 0.32: ``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``), the media names (vLLM's: ``"GPU"`` for the pool, ``"STORAGE"`` and ``"CPU"``
for the second tier's disk and host-memory stores), ``block_hash`` and ``namespace_tag``. Pure:
knows nothing about trees, sockets or threads (``engine.kvcache.kv_events`` decides what to
publish, ``engine.kvcache.kv_event_stream`` sends it); the subscriber's side, which decodes and
validates anyone's events, is ``server.remote.kv_wire``.

Hashes: a public block's (every token under ``PUBLIC``) is stable across restarts and
processes: the first 8 bytes (as an unsigned int, top bit cleared) of SHA-256 over the parent's
hash and its token ids, so any subscriber or router can match shared content, as vLLM's hashes
do. A private block's (any token under another namespace) is the same over HMAC-SHA256 keyed
with a secret of the publisher (``secrets.token_bytes(32)``, never sent): the same within the
process, but nobody who guesses its tokens (and knows the parent's hash, which is published)
can confirm the guess by hashing it. Its namespaces never go out: its ``extra_keys`` entry is
``[tag]``, ``tag`` an opaque keyed name of them (``ns-`` and 24 hex digits, the same for the
same namespaces in this process), which a subscriber takes for a salt (``server.remote``
draws such blocks apart, as others' blocks).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Any

import msgspec

MEDIUM_POOL = "GPU"
MEDIUM_CPU = "CPU"  # vLLM's MEDIUM_CPU: host memory (our HostStore)
MEDIUM_STORAGE = "STORAGE"  # vLLM's MEDIUM_STORAGE: its disk tier (our DiskStore)
TIER_MEDIA = {"disk": MEDIUM_STORAGE, "host memory": MEDIUM_CPU}  # ChunkStore.kind -> medium
BlockSpec = tuple[int, "int | None", tuple[int, ...], tuple[str, ...]]  # hash, parent hash, tokens, namespaces


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class BlockStored(msgspec.Struct, tag_field="type", tag="BlockStored", gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None


class BlockRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved", gc=False):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared", gc=False):
    pass


def block_hash(parent: int | None, namespaces: tuple[str, ...], token_ids: tuple[int, ...],
               key: bytes | None = None) -> int:
    """63 bits of a digest of (parent hash, namespaces, tokens): SHA-256 for a public block (no
    namespaces; stable across restarts), HMAC-SHA256 under ``key`` for a private one (``key``
    required: see the module docstring)."""
    if namespaces and not key:
        raise ValueError("a private block's hash needs the publisher's key")
    h = hmac.new(key, digestmod=hashlib.sha256) if namespaces and key else hashlib.sha256()
    h.update(struct.pack(">q", -1 if parent is None else parent))
    h.update("\x1f".join(namespaces).encode("utf-8", "surrogatepass"))
    h.update(b"\x00")
    h.update(struct.pack(f">{len(token_ids)}I", *token_ids))
    return int.from_bytes(h.digest()[:8], "big") >> 1


def namespace_tag(namespaces: tuple[str, ...], key: bytes) -> str:
    """What a private block's ``extra_keys`` entry says of its namespaces: ``ns-`` and 24 hex
    digits of HMAC-SHA256 under ``key``, the same for the same namespaces, naming none."""
    text = "\x1f".join(namespaces).encode("utf-8", "surrogatepass")
    return "ns-" + hmac.new(key, b"namespace-tag\x00" + text, hashlib.sha256).hexdigest()[:24]
