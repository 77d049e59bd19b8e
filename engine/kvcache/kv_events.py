"""This engine's cache as KV events, in vLLM's format, so any KV-event consumer can follow it.

Owns: ``KVEventPublisher``, a ``RadixTree`` listener (``tree.listener = publisher``) that turns
what the tree caches into vLLM's stream, and the ZMQ side (a PUB socket and a ROUTER replay
endpoint with the last ``buffer_steps`` batches), configured by vLLM's own JSON
(``--kv-events-config``: ``enable_kv_cache_events``, ``publisher`` "zmq", ``endpoint``,
``replay_endpoint``, ``topic``, ``buffer_steps``, ``hwm``; plus ``block_size``, ours, default 32).

What is published (every message ``[topic, seq 8-byte big-endian from 0, msgpack
[ts, events, data_parallel_rank]]``, events maps tagged by ``"type"`` like vLLM 0.32):

- ``BlockStored`` for every full block of ``block_size`` tokens along a path the tree caches,
  once, parents first (``parent_block_hash`` chains them; None for a path's first block);
- ``BlockRemoved`` as soon as any token of a published block leaves the tree (an evicted or
  removed node takes every block that overlaps it, and the blocks below it);
- ``AllBlocksCleared`` from ``cleared()`` (the pool's blocks; what the second tier still holds
  is published again in the same batch, since a subscriber forgets every medium on a clear);
- ``medium`` is ``"GPU"`` for the pool (vLLM's word for its device memory, even on CPU). The
  second tier (``engine.kvcache.second_tier.SecondTier``, attached by ``RadixCache.publish_to``)
  publishes under vLLM's names for its offloading tiers: ``"STORAGE"`` for the disk store,
  ``"CPU"`` for the host-memory store. A block is in the tier when every 64-token chunk that
  overlaps it is (``tier_kept``); it leaves the tier when any of them is dropped
  (``tier_dropped``); a load back into the pool publishes it under ``"GPU"`` again (the tree's
  ``cached``), while the tier keeps its copy. A block may so be held in two media at once:
  ``published`` maps each hash to the media that hold it.

The hash is stable across restarts and processes: the first 8 bytes (as an unsigned int, top
bit cleared) of SHA-256 over the parent's hash, the block's namespaces and its token ids, so the
same content under the same namespaces always has the same hash. Namespaces other than the
public one go in ``extra_keys`` (one entry per block: a tuple of the block's namespaces, or
None). With ``private_tokens=False`` (isolation), a block holding any visitor's token carries no
token ids (``token_ids`` empty for that event), so a subscriber sees its shape, not its text.

Thread safety: the listener calls come under the cache's lock (the tier's drops too, as the cache
is the store's only caller); one lock of the publisher's orders them anyway, and they only
encode and queue (``tier_kept`` asks the store before taking it). One daemon thread owns both
sockets (ZMQ sockets are not thread safe). Knows nothing about HTTP or UI.
"""

from __future__ import annotations

import hashlib
import json
import queue
import struct
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from engine.kvcache.kv_tier import CHUNK_TOKENS
from engine.kvcache.radix_tree import Node
from engine.types import PUBLIC, CacheKey

if TYPE_CHECKING:
    from engine.kvcache.second_tier import SecondTier

MEDIUM_POOL = "GPU"
MEDIUM_CPU = "CPU"  # vLLM's MEDIUM_CPU: host memory (our HostStore)
MEDIUM_STORAGE = "STORAGE"  # vLLM's MEDIUM_STORAGE: its disk tier (our DiskStore)
TIER_MEDIA = {"disk": MEDIUM_STORAGE, "host memory": MEDIUM_CPU}  # ChunkStore.kind -> medium
BlockSpec = tuple[int, "int | None", tuple[int, ...], tuple[str, ...]]  # hash, parent hash, tokens, namespaces
END_SEQ = (-1).to_bytes(8, "big", signed=True)


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


def block_hash(parent: int | None, namespaces: tuple[str, ...], token_ids: tuple[int, ...]) -> int:
    """Stable across restarts: SHA-256 of (parent hash, namespaces, tokens), 63 bits."""
    h = hashlib.sha256()
    h.update(struct.pack(">q", -1 if parent is None else parent))
    h.update("\x1f".join(namespaces).encode())
    h.update(b"\x00")
    h.update(struct.pack(f">{len(token_ids)}I", *token_ids))
    return int.from_bytes(h.digest()[:8], "big") >> 1


def _path(node: Node) -> list[Node]:
    out = []
    while node.parent is not None:
        out.append(node)
        node = node.parent
    return out[::-1]


def _node_tokens(path: list[Node]) -> tuple[list[int], list[str]]:
    """Token ids along ``path`` and the namespace each one is cached under."""
    ids: list[int] = []
    spaces: list[str] = []
    for n in path:
        ids.extend(n.key)
        spaces.extend([n.namespace] * len(n.key))
    return ids, spaces


def _key_tokens(key: CacheKey) -> tuple[list[int], list[str]]:
    """The same for a ``CacheKey`` (the tree puts each position under ``key.ns_at``)."""
    return list(key.ids), [key.ns_at(i) for i in range(len(key.ids))]


class KVEventPublisher:
    """A ``RadixTree`` listener that publishes vLLM-format KV events (see the module docstring)."""

    def __init__(self, endpoint: str = "tcp://*:5557", replay_endpoint: str | None = None, topic: str = "",
                 block_size: int = 32, buffer_steps: int = 10_000, hwm: int = 100_000,
                 private_tokens: bool = True) -> None:
        self.block_size = block_size
        self.private_tokens = private_tokens
        self.config: dict = {}  # the config it was made from, as ``GET /kv_event_sources`` serves it
        self.topic = topic.encode()
        self.published: dict[int, set[str]] = {}  # block hash -> the media holding it, as subscribers hold it now
        self._tier_blocks: dict[int, BlockSpec] = {}  # blocks the second tier holds (published again after a clear)
        self._chunk_blocks: dict[str, set[int]] = {}  # tier chunk key -> the tier's blocks that overlap it
        self.tier_medium: str | None = None
        self._lock = threading.RLock()
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        (self._pub.bind if "*" in endpoint or endpoint.startswith(("ipc://", "inproc://")) else self._pub.connect)(
            endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self._replay = None
        self.replay_endpoint = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._seq = 0
        self._thread = threading.Thread(target=self._loop, name="kv-events-publisher", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: str | dict, private_tokens: bool = True) -> KVEventPublisher | None:
        """vLLM's ``--kv-events-config`` JSON; None when it turns events off."""
        c = json.loads(config) if isinstance(config, str) else dict(config)
        if not c.get("enable_kv_cache_events", True) or c.get("publisher", "zmq") != "zmq":
            return None
        publisher = cls(c.get("endpoint", "tcp://*:5557"), c.get("replay_endpoint"), c.get("topic", ""),
                        int(c.get("block_size", 32)), int(c.get("buffer_steps", 10_000)),
                        int(c.get("hwm", 100_000)), private_tokens)
        publisher.config = {"enable_kv_cache_events": True, "publisher": "zmq", **c,
                            "endpoint": c.get("endpoint", "tcp://*:5557"), "topic": c.get("topic", ""),
                            "block_size": publisher.block_size}
        return publisher

    @property
    def num_published(self) -> int:
        """(hash, medium) pairs a subscriber holds now: what its block count should be."""
        with self._lock:
            return sum(len(media) for media in self.published.values())

    def held(self, medium: str) -> int:
        with self._lock:
            return sum(medium in media for media in self.published.values())

    # ----------------------------------------------------------- the tree's listener
    def cached(self, node: Node) -> None:
        """Tokens are cached along the path root -> ``node``: publish its new full blocks."""
        self.stored_path(_path(node))

    def removed(self, node: Node) -> None:
        """``node``'s tokens left the tree (its parent link still stands): every published
        block that overlaps them goes from the pool, and so do the blocks below them."""
        with self._lock:
            path = _path(node)
            start = sum(len(n.key) for n in path[:-1])
            first = start // self.block_size
            gone = [b[0] for b in self._blocks(*_node_tokens(path))[first:]] + self._below(node)
            self._emit([BlockRemoved([h], MEDIUM_POOL) for h in dict.fromkeys(gone) if self._drop(h, MEDIUM_POOL)])

    def cleared(self) -> None:
        """Everything left the pool (a clear of the whole cache). vLLM's ``AllBlocksCleared``
        makes a subscriber forget every medium, so what the second tier holds follows it."""
        with self._lock:
            for h in list(self.published):
                self._drop(h, MEDIUM_POOL)
            again = [b for b in self._tier_blocks.values() if b[0] in self.published]
            for b in again:
                self.published.pop(b[0])
            self._emit([AllBlocksCleared(), *self._store_events(again, self.tier_medium or MEDIUM_CPU)])

    def stored_path(self, path: list[Node], medium: str = MEDIUM_POOL) -> None:
        with self._lock:
            self._emit(self._store_events(self._blocks(*_node_tokens(path)), medium))

    # ----------------------------------------------------------- the second tier's listener
    def tier_kept(self, tier: SecondTier, path: CacheKey, ends: list[int]) -> None:
        """The tier holds the chunks of ``path`` that end at ``ends`` (just written, or found at
        start): publish, under the tier's medium, each block they touch whose chunks it all holds."""
        if not ends:
            return
        bs, c, n = self.block_size, CHUNK_TOKENS, len(path.ids)
        new: list[tuple[BlockSpec, list[str]]] = []
        for i, block in enumerate(self._blocks(*_key_tokens(path))):  # asks the store outside our lock
            lo, hi = i * bs, (i + 1) * bs
            if not any(stop - c < hi and stop > lo for stop in ends):
                continue
            stops = range((lo // c + 1) * c, ((hi - 1) // c + 1) * c + 1, c)  # the chunks over [lo, hi)
            keys = [tier.key_of(path, stop) for stop in stops if stop <= n]
            if len(keys) == len(stops) and all(k in tier.store for k in keys):
                new.append((block, keys))
        with self._lock:
            medium = self.tier_medium = TIER_MEDIA.get(tier.kind, MEDIUM_CPU)
            for block, keys in new:
                for k in keys:
                    self._chunk_blocks.setdefault(k, set()).add(block[0])
                self._tier_blocks[block[0]] = block
            self._emit(self._store_events([b for b, _ in new], medium))

    def tier_dropped(self, key: str) -> None:
        """The tier let the chunk ``key`` go (for room, or found bad): its blocks leave the tier."""
        with self._lock:
            medium = self.tier_medium or MEDIUM_CPU
            gone = []
            for h in sorted(self._chunk_blocks.pop(key, ())):
                if self._drop(h, medium):
                    self._tier_blocks.pop(h, None)
                    gone.append(BlockRemoved([h], medium))
            self._emit(gone)

    # ----------------------------------------------------------- blocks along a path
    def _blocks(self, ids: list[int], spaces: list[str]) -> list[BlockSpec]:
        """(hash, parent hash, tokens, namespaces) of each full block of a path's tokens."""
        bs, out, parent = self.block_size, [], None
        for i in range(len(ids) // bs):
            tokens = tuple(ids[i * bs:(i + 1) * bs])
            ns = tuple(dict.fromkeys(s for s in spaces[i * bs:(i + 1) * bs] if s != PUBLIC))
            h = block_hash(parent, ns, tokens)
            out.append((h, parent, tokens, ns))
            parent = h
        return out

    def _below(self, node: Node) -> list[int]:
        """Blocks that end below ``node`` (its subtree, still linked to it)."""
        out: list[int] = []
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if not n.children:
                out += [b[0] for b in self._blocks(*_node_tokens(_path(n)))]
        return out

    def _drop(self, h: int, medium: str) -> bool:
        """Forget that ``medium`` holds ``h``; False if it was not published there."""
        media = self.published.get(h)
        if media is None or medium not in media:
            return False
        media.discard(medium)
        if not media:
            del self.published[h]
        return True

    def _store_events(self, blocks: list[BlockSpec], medium: str) -> list[BlockStored]:
        """``BlockStored`` events for the ``blocks`` not yet published in ``medium`` (marked now):
        one event per run of consecutive blocks of the same kind, like vLLM's per-prompt event."""
        events: list[BlockStored] = []
        for h, parent, tokens, ns in blocks:
            media = self.published.setdefault(h, set())
            if medium in media:
                continue
            media.add(medium)
            private = bool(ns)
            ids = list(tokens) if self.private_tokens or not private else []
            last = events[-1] if events else None
            if (last is not None and last.block_hashes[-1] == parent and bool(last.token_ids) == bool(ids)
                    and (last.extra_keys is None) == (not private)):
                last.block_hashes.append(h)
                last.token_ids.extend(ids)
                if last.extra_keys is not None:
                    last.extra_keys.append(list(ns))
                continue
            events.append(BlockStored([h], parent, ids, self.block_size, None, medium, None,
                                      [list(ns)] if private else None))
        return events

    # ----------------------------------------------------------- the socket thread
    def _emit(self, events: list) -> None:
        if events:
            self._queue.put(self._encoder.encode(EventBatch(time.time(), events, 0)))

    def _loop(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                payload = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if payload is None:
                break
            seq = self._seq.to_bytes(8, "big")
            self._pub.send_multipart((self.topic, seq, payload))
            self._buffer.append((self._seq, payload))
            self._seq += 1
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until every queued batch is sent (tests, shutdown)."""
        end = time.monotonic() + timeout_s
        while not self._queue.empty() and time.monotonic() < end:
            time.sleep(0.01)
        time.sleep(0.05)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._ctx.term()
