"""Following a remote engine's KV events: decoding (msgspec) and the subscriber (pyzmq).

Owns: the wire format (our own msgspec Structs mirroring vLLM's ``KVEventBatch``: an array
``[ts, events, data_parallel_rank]`` whose events are maps tagged by ``"type"``, unknown
fields ignored; and SGLang's older array form, ``["BlockStored", hashes, parent, tokens,
block_size, lora_id]`` without a medium), finding the endpoints (``GET /kv_event_sources``
on the backend, ``*`` replaced by the backend's host), and ``KVEventSubscriber``: one
background thread that owns the SUB and DEALER sockets and applies batches, in sequence
order, to a ``server.remote.block_tree.BlockTree``.

Ordering, as the publishers promise it (three frames ``[topic, seq 8-byte big-endian,
payload]``, seq from 0 per server process, the last 10,000 batches kept for replay):

- at start, and whenever a batch's seq skips ahead, the missing batches are asked from the
  replay endpoint (DEALER: ``[b"", start_seq]`` -> ``[b"", topic, seq, payload]`` (vLLM;
  SGLang sends no topic) ... then seq -1);
- a batch at or below the last applied seq is a duplicate (live and replay overlap) unless it
  is newer in time than the last applied batch: then the server restarted (its seq starts
  again from 0), so the tree is reset and rebuilt from that server's replay buffer.

Knows nothing about the UI or HTTP requests.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec
import zmq

from server.remote.block_tree import BlockTree, ClearedEvent, Event, RemovedEvent, StoredEvent

log = logging.getLogger(__name__)

END_SEQ = -1


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


# ---------------------------------------------------------------- the subscriber
@dataclass
class SubscriberStats:
    batches: int = 0  # applied, live or replayed
    events: int = 0
    replayed: int = 0  # batches applied from the replay endpoint
    gaps: int = 0  # times a seq skipped ahead
    lost: int = 0  # batches neither live nor in the replay buffer
    restarts: int = 0  # the server's seq went back: the tree was rebuilt
    decode_errors: int = 0
    last_seq: int = -1
    last_ts: float = 0.0
    last_event_at: float = 0.0  # wall time of the last applied batch (0: none yet)


class KVEventSubscriber:
    """Follows one event source into ``tree`` on a daemon thread (``start``/``close``)."""

    def __init__(self, source: EventSource, tree: BlockTree | None = None, *, replay_timeout_s: float = 2.0,
                 on_batch: Callable[[], None] | None = None) -> None:
        self.source = source
        self.tree = tree if tree is not None else BlockTree()
        self.stats = SubscriberStats()
        self.replay_timeout_s = replay_timeout_s
        self.on_batch = on_batch
        self.drop_next = 0  # tests: drop this many live batches, as a slow network would
        self.synced = False  # the history the replay endpoint kept has been applied
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx = zmq.Context()

    # ----------------------------------------------------------- lifecycle
    def start(self, wait_s: float = 5.0) -> KVEventSubscriber:
        self._thread = threading.Thread(target=self._loop, name="kv-events", daemon=True)
        self._thread.start()
        self._ready.wait(wait_s)
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._ctx.term()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
        """Poll ``predicate`` until it holds (tests and tools)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if predicate():
                return True
            time.sleep(0.05)
        return predicate()

    # ----------------------------------------------------------- the thread
    def _loop(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        try:
            (sub.bind if self.source.bind else sub.connect)(self.source.endpoint)
            time.sleep(0.2)  # let the subscription reach the publisher before asking for history
            self._replay_from(0)
            self.synced = True
            self._ready.set()
            poller = zmq.Poller()
            poller.register(sub, zmq.POLLIN)
            while not self._stop.is_set():
                if not dict(poller.poll(200)):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3:
                    continue
                if self.drop_next > 0:
                    self.drop_next -= 1
                    continue
                self._on_batch(int.from_bytes(frames[1], "big", signed=True), frames[2], live=True)
        except Exception:
            log.exception("The KV event subscriber stopped")
        finally:
            self._ready.set()
            sub.close(linger=0)

    def _on_batch(self, seq: int, payload: bytes, live: bool) -> None:
        try:
            ts, events = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.stats.decode_errors += 1
            return
        s = self.stats
        if seq <= s.last_seq:
            if ts <= s.last_ts or not live:
                return  # a duplicate: live and replay overlap
            log.info("The backend's KV event sequence restarted (%d after %d): rebuilding the tree", seq, s.last_seq)
            s.restarts += 1
            self.tree.reset()
            s.last_seq, s.last_ts = -1, 0.0
            self._replay_from(0)
            if seq <= s.last_seq:
                return
        if seq > s.last_seq + 1 and live:
            s.gaps += 1
            self._replay_from(s.last_seq + 1, until=seq)
        if seq > s.last_seq + 1:
            s.lost += seq - s.last_seq - 1
        self.tree.apply_all(events, ts)
        s.batches += 1
        s.events += len(events)
        s.last_seq, s.last_ts, s.last_event_at = seq, ts, time.time()
        if not live:
            s.replayed += 1
        if self.on_batch is not None:
            self.on_batch()

    def _replay_from(self, start: int, until: int | None = None) -> None:
        """Apply the buffered batches from ``start`` (below ``until``) from the replay endpoint."""
        if not self.source.replay_endpoint:
            return
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVTIMEO, int(self.replay_timeout_s * 1000))
        try:
            dealer.connect(self.source.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while not self._stop.is_set():
                frames = dealer.recv_multipart()  # vLLM: [b"", topic, seq, payload]; SGLang: no topic
                if len(frames) not in (3, 4):
                    continue
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == END_SEQ:
                    break
                if until is not None and seq >= until:
                    continue
                self._on_batch(seq, frames[-1], live=False)
        except zmq.Again:
            log.info("The replay endpoint %s did not answer within %.0f s", self.source.replay_endpoint,
                     self.replay_timeout_s)
        finally:
            dealer.close(linger=0)
