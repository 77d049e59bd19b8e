"""This engine's cache as KV events, in vLLM's format, so any KV-event consumer can follow it.

Owns: ``KVEventPublisher``, a ``RadixTree`` listener (``tree.listener = publisher``) that turns
what the tree caches into vLLM's stream, and the ZMQ side (a PUB socket and a ROUTER replay
endpoint with the last ``buffer_steps`` batches), configured by vLLM's own JSON
(``--kv-events-config``: ``enable_kv_cache_events``, ``publisher`` "zmq", ``endpoint``,
``replay_endpoint``, ``topic``, ``buffer_steps``, ``hwm`` (ours defaults to 10,000),
``max_queue_size``; plus ``block_size``, ours, default 32).

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

Hashes: a public block's (every token under ``PUBLIC``) is stable across restarts and
processes: the first 8 bytes (as an unsigned int, top bit cleared) of SHA-256 over the parent's
hash and its token ids, so any subscriber or router can match shared content, as vLLM's hashes
do. A private block's (any token under another namespace) is the same over HMAC-SHA256 keyed
with a secret of this publisher (``secrets.token_bytes(32)``, never sent): the same within the
process, but nobody who guesses its tokens (and knows the parent's hash, which is published)
can confirm the guess by hashing it. Its namespaces never go out: its ``extra_keys`` entry is
``[tag]``, ``tag`` an opaque keyed name of them (``ns-`` and 24 hex digits, the same for the
same namespaces in this process), which a subscriber takes for a salt (``server.remote``
draws such blocks apart, as others' blocks). With ``private_tokens=False`` (isolation), a
private block carries no token ids either (``token_ids`` empty for that event), so a
subscriber sees its shape, not its text.

Endpoints: without ``endpoint`` in the config the PUB socket binds loopback only
(``tcp://127.0.0.1:5557``; the config served then says ``"publisher_binds": true``, as a plain
host otherwise means vLLM connects). vLLM's forms are honoured as vLLM reads them: ``*``
binds every interface (a one-line warning says so), a plain host connects (binds, with our
``"publisher_binds": true``); the replay endpoint always binds.

Bounds (a slow or hostile subscriber cannot grow this process's memory without bound, nor
block the cache): the cache's thread only encodes and queues (``put_nowait``; the queue holds
at most ``max_queue`` batches, past which a batch is dropped and counted in
``dropped_batches``; its seq is taken all the same, so subscribers see a gap and count it
lost); the PUB socket's SNDHWM is ``hwm`` messages per subscriber (ZMQ drops past it); replay
answers go out a few at a time from the sending thread, at most ``REPLAY_SESSIONS`` at once,
``REPLAY_RATE`` new ones a second (more are not answered: ``replay_refused``), each at most
``REPLAY_MAX_BYTES``, through a ROUTER whose SNDHWM bounds what waits for each client (a client
that does not read within ``REPLAY_SESSION_S`` is dropped: ``replay_abandoned``).

Thread safety: the listener calls come under the cache's lock (the tier's drops too, as the cache
is the store's only caller); one lock of the publisher's orders them anyway, and they only
encode and queue, never wait nor log (``tier_kept`` asks the store before taking it). One
daemon thread owns both sockets (ZMQ sockets are not thread safe) and logs. Knows nothing
about HTTP or UI.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import queue
import secrets
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
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
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"  # bound, loopback only, when the config names none
DEFAULT_HWM = 10_000  # messages waiting per subscriber (vLLM's default is 100,000)
REPLAY_SESSIONS = 4  # replay answers under way at once
REPLAY_RATE = 5.0  # new replay answers a second (a burst of REPLAY_BURST)
REPLAY_BURST = 10
REPLAY_HWM = 1_000  # replayed messages waiting per client (ROUTER's SNDHWM)
REPLAY_MAX_BYTES = 256 << 20  # one answer's payloads (cut there: the END frame follows)
REPLAY_SESSION_S = 60.0  # a client that has not taken its answer by then is dropped
REPLAY_STEP = 256  # messages sent to one client per turn of the sending thread

log = logging.getLogger(__name__)


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


@dataclass
class _ReplayAnswer:
    """One replay request being answered: the batches to send, from ``pos`` on."""

    client: bytes
    items: list[tuple[int, bytes]]
    deadline: float
    pos: int = 0
    ended: bool = False  # the END frame went out


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


def _warn_if_every_interface(endpoint: str) -> None:
    if endpoint.startswith("tcp://*") or endpoint.startswith("tcp://0.0.0.0") or endpoint.startswith("tcp://[::]"):
        log.warning("KV events: %s listens on every interface (anyone who can reach this host can read the "
                    "stream); name a host such as tcp://127.0.0.1:PORT to keep it local", endpoint)


class KVEventPublisher:
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
        self.topic = topic.encode()
        self.published: dict[int, set[str]] = {}  # block hash -> the media holding it, as subscribers hold it now
        self._tier_blocks: dict[int, BlockSpec] = {}  # blocks the second tier holds (published again after a clear)
        self._chunk_blocks: dict[str, set[int]] = {}  # tier chunk key -> the tier's blocks that overlap it
        self.tier_medium: str | None = None
        self._key = secrets.token_bytes(32)  # private blocks' hashes and tags; never leaves this object
        self._lock = threading.RLock()
        self._queue: queue.Queue[tuple[int, bytes]] = queue.Queue(maxsize=max(1, max_queue or buffer_steps))
        self._stop = threading.Event()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self.dropped_batches = 0  # batches the full queue refused (their seqs are skipped)
        self._dropped_told, self._tell_at = 0, 0.0  # the last count logged, and when the next may be
        self.replay_served = 0  # replay answers sent to their end
        self.replay_refused = 0  # replay requests not answered (too many at once or too fast, or malformed)
        self.replay_abandoned = 0  # answers dropped: the client did not take them in time, or went away
        self._answers: dict[bytes, _ReplayAnswer] = {}
        self._allowance = float(REPLAY_BURST)  # the replay requests' token bucket
        self._allowance_at = time.monotonic()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.RCVHWM, 1_000)  # subscriptions only
        self._pub.setsockopt(zmq.MAXMSGSIZE, 4096)
        self._pub.setsockopt(zmq.LINGER, 0)
        if endpoint is None:
            self._pub.bind(DEFAULT_ENDPOINT)
        elif bind or "*" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            _warn_if_every_interface(endpoint)
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self.binds = endpoint is None or bind or "*" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint or DEFAULT_ENDPOINT
        self._replay = None
        self.replay_endpoint = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.setsockopt(zmq.SNDHWM, REPLAY_HWM)
            self._replay.setsockopt(zmq.RCVHWM, 100)
            self._replay.setsockopt(zmq.MAXMSGSIZE, 1024)  # a request is [id, b"", 8 bytes]
            self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full pipe says EAGAIN instead of dropping
            _warn_if_every_interface(replay_endpoint)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._seq = 0
        self._thread = threading.Thread(target=self._loop, name="kv-events-publisher", daemon=True)
        self._thread.start()

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

    # ----------------------------------------------------------- the socket thread
    def _emit(self, events: list) -> None:
        """Encode and queue (under ``self._lock``, which orders the seqs); never waits: a full
        queue drops the batch (``dropped_batches``), its seq skipped so subscribers see a gap."""
        if not events:
            return
        seq = self._seq
        self._seq += 1
        try:
            self._queue.put_nowait((seq, self._encoder.encode(EventBatch(time.time(), events, 0))))
        except queue.Full:
            self.dropped_batches += 1  # logged by the sending thread: no I/O under the cache's lock

    def _loop(self) -> None:
        try:
            while not self._stop.is_set() or not self._queue.empty():
                try:
                    item = self._queue.get(timeout=0.005 if self._answers else 0.05)
                except queue.Empty:
                    item = None
                for _ in range(1_000):  # what waits, then the replay side gets its turn
                    if item is None:
                        break
                    self._send(*item)
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        item = None
                if item is not None:
                    self._send(*item)
                if self._replay is not None and not self._stop.is_set():
                    self._replay_turn()
                if self.dropped_batches > self._dropped_told and time.monotonic() >= self._tell_at:
                    self._dropped_told, self._tell_at = self.dropped_batches, time.monotonic() + 60.0
                    log.warning("KV events: the sending thread fell behind; %d batches dropped so far (subscribers "
                                "count them as lost)", self._dropped_told)
        finally:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _send(self, seq: int, payload: bytes) -> None:
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))  # PUB: drops past SNDHWM
        self._buffer.append((seq, payload))

    # ----------------------------------------------------------- the replay endpoint (the socket thread)
    def _replay_turn(self) -> None:
        """Take new requests (within the rate and the sessions allowed), then send each answer
        under way as far as its client's pipe takes it."""
        assert self._replay is not None
        for _ in range(100):
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._take_request(frames)
        now = time.monotonic()
        for client, answer in list(self._answers.items()):
            if now > answer.deadline:
                self.replay_abandoned += 1
                del self._answers[client]
            elif self._advance(answer):
                del self._answers[client]

    def _take_request(self, frames: list[bytes]) -> None:
        """``[client, b"", start_seq]``: answer with the buffered batches from ``start_seq`` on,
        then ``seq -1`` (vLLM's replay); unanswered past the rate or the sessions allowed."""
        now = time.monotonic()
        self._allowance = min(float(REPLAY_BURST), self._allowance + (now - self._allowance_at) * REPLAY_RATE)
        self._allowance_at = now
        if len(frames) != 3 or len(frames[2]) != 8 or self._allowance < 1.0 or (
                frames[0] not in self._answers and len(self._answers) >= REPLAY_SESSIONS):
            self.replay_refused += 1
            return
        self._allowance -= 1.0
        client, _, start = frames
        first = int.from_bytes(start, "big")
        items, size = [], 0
        for seq, payload in list(self._buffer):  # references only: the payloads are not copied
            if seq >= first:
                size += len(payload)
                if size > REPLAY_MAX_BYTES:
                    break
                items.append((seq, payload))
        self._answers[client] = _ReplayAnswer(client, items, now + REPLAY_SESSION_S)

    def _advance(self, answer: _ReplayAnswer) -> bool:
        """Send what the client's pipe takes (at most ``REPLAY_STEP`` messages); True when done."""
        assert self._replay is not None
        try:
            for _ in range(REPLAY_STEP):
                if answer.pos < len(answer.items):
                    seq, payload = answer.items[answer.pos]
                    self._replay.send_multipart((answer.client, b"", self.topic, seq.to_bytes(8, "big"), payload),
                                                zmq.NOBLOCK)
                    answer.pos += 1
                else:
                    self._replay.send_multipart((answer.client, b"", b"", END_SEQ, b""), zmq.NOBLOCK)
                    self.replay_served += 1
                    return True
        except zmq.Again:  # its pipe is full: the next turn goes on
            return False
        except zmq.ZMQError:  # the client went away (ROUTER_MANDATORY: EHOSTUNREACH)
            self.replay_abandoned += 1
            return True
        return False

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until every queued batch is sent (tests, shutdown)."""
        end = time.monotonic() + timeout_s
        while not self._queue.empty() and time.monotonic() < end:
            time.sleep(0.01)
        time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._ctx.term()
