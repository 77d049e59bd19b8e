"""This engine's cache as KV events, in vLLM's format, so any KV-event consumer can follow it.

Owns: ``KVEventPublisher``, a ``RadixTree`` listener (``tree.listener = publisher``) and the second
tier's, that turns what the tree and the tier hold into vLLM's stream: which blocks are
published in which medium, their hashes along a path, and the events that say so. It is made
from vLLM's own JSON (``--kv-events-config``: ``enable_kv_cache_events``, ``publisher`` "zmq",
``endpoint``, ``replay_endpoint``, ``topic``, ``buffer_steps``, ``hwm`` (ours defaults to
10,000), ``max_queue_size``; plus ``block_size``, ours, default 32). The messages and the hashes
are ``engine.kvcache.kv_event_format``'s; the sockets, the sending thread, the replay endpoint
and their bounds are ``engine.kvcache.kv_event_stream``'s (``EventStream``, this class's base).
Knows nothing about HTTP or UI.

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

A public block's hash is stable across processes, a private one's keyed with a secret of this
publisher, its namespaces sent only as an opaque tag (``kv_event_format``). With
``private_tokens=False`` (isolation), a private block carries no token ids either
(``token_ids`` empty for that event), so a subscriber sees its shape, not its text.

Endpoints: without ``endpoint`` in the config the PUB socket binds loopback only
(``tcp://127.0.0.1:5557``; the config served then says ``"publisher_binds": true``, as a plain
host otherwise means vLLM connects). vLLM's forms are honoured as vLLM reads them
(``kv_event_stream``): ``*`` binds every interface (a one-line warning says so), a plain host
connects (binds, with our ``"publisher_binds": true``); the replay endpoint always binds.

Thread safety: the listener calls come under the cache's lock (the tier's drops too, as the cache
is the store's only caller); one lock of the publisher's orders them anyway, and they only
encode and queue, never wait nor log (``tier_kept`` asks the store before taking it).
"""

from __future__ import annotations

import json
import secrets
import threading
from typing import TYPE_CHECKING

from engine.kvcache.chunks import CHUNK_TOKENS
from engine.kvcache.kv_event_format import (
    MEDIUM_CPU,
    MEDIUM_POOL,
    TIER_MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockSpec,
    BlockStored,
    block_hash,
    namespace_tag,
)
from engine.kvcache.kv_event_stream import DEFAULT_HWM, EventStream
from engine.kvcache.radix_tree import Node
from engine.types import PUBLIC, CacheKey

if TYPE_CHECKING:
    from engine.kvcache.second_tier import SecondTier

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"  # bound, loopback only, when the config names none


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


class KVEventPublisher(EventStream):
    """A ``RadixTree`` listener that publishes vLLM-format KV events (see the module docstring)."""

    def __init__(self, endpoint: str | None = None, replay_endpoint: str | None = None, topic: str = "",
                 block_size: int = 32, buffer_steps: int = 10_000, hwm: int = DEFAULT_HWM,
                 private_tokens: bool = True, max_queue: int | None = None, bind: bool = False) -> None:
        """``endpoint`` None: bind ``DEFAULT_ENDPOINT`` (loopback). Otherwise vLLM's rule: ``*``,
        ``ipc://`` and ``inproc://`` bind, a plain host connects, unless ``bind`` (ours: a router
        connects to each replica's loopback endpoint). ``max_queue``: batches waiting for the
        sending thread (default ``buffer_steps``)."""
        self.block_size = block_size
        self.private_tokens = private_tokens
        self.config: dict = {}  # the config it was made from, as ``GET /kv_event_sources`` serves it
        self.published: dict[int, set[str]] = {}  # block hash -> the media holding it, as subscribers hold it now
        self._tier_blocks: dict[int, BlockSpec] = {}  # blocks the second tier holds (published again after a clear)
        self._chunk_blocks: dict[str, set[int]] = {}  # tier chunk key -> the tier's blocks that overlap it
        self.tier_medium: str | None = None
        self._key = secrets.token_bytes(32)  # private blocks' hashes and tags; never leaves this object
        self._lock = threading.RLock()
        super().__init__(DEFAULT_ENDPOINT if endpoint is None else endpoint, replay_endpoint, topic,
                         buffer_steps, hwm, max_queue, bind=bind or endpoint is None)

    @classmethod
    def from_config(cls, config: str | dict, private_tokens: bool = True) -> KVEventPublisher | None:
        """vLLM's ``--kv-events-config`` JSON; None when it turns events off. Without an
        ``endpoint`` it binds loopback (``DEFAULT_ENDPOINT``), and the config it serves says
        ``"publisher_binds": true`` so a subscriber connects to the plain host. Given with a plain
        host (ours, not vLLM's), ``"publisher_binds": true`` binds that host and port: a router
        then connects to each replica on loopback (``tools.fleet``)."""
        c = json.loads(config) if isinstance(config, str) else dict(config)
        if not c.get("enable_kv_cache_events", True) or c.get("publisher", "zmq") != "zmq":
            return None
        endpoint = c.get("endpoint") or None
        publisher = cls(endpoint, c.get("replay_endpoint"), c.get("topic", ""),
                        int(c.get("block_size", 32)), int(c.get("buffer_steps", 10_000)),
                        int(c.get("hwm", DEFAULT_HWM)), private_tokens,
                        int(c["max_queue_size"]) if c.get("max_queue_size") else None,
                        bind=c.get("publisher_binds") is True)
        publisher.config = {"enable_kv_cache_events": True, "publisher": "zmq", **c,
                            "endpoint": endpoint or DEFAULT_ENDPOINT, "topic": c.get("topic", ""),
                            "block_size": publisher.block_size}
        if endpoint is None:
            publisher.config["publisher_binds"] = True
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
            h = block_hash(parent, ns, tokens, self._key if ns else None)
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
            keys = [namespace_tag(ns, self._key)] if private else None
            last = events[-1] if events else None
            if (last is not None and last.block_hashes[-1] == parent and bool(last.token_ids) == bool(ids)
                    and (last.extra_keys is None) == (not private)):
                last.block_hashes.append(h)
                last.token_ids.extend(ids)
                if last.extra_keys is not None:
                    last.extra_keys.append(keys)
                continue
            events.append(BlockStored([h], parent, ids, self.block_size, None, medium, None,
                                      [keys] if private else None))
        return events
