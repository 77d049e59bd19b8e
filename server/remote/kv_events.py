"""Following a remote engine's KV events: ``KVEventSubscriber`` (pyzmq), one background thread
that owns the SUB and DEALER sockets and applies batches, in sequence order, to a
``server.remote.block_tree.BlockTree``. The wire format and the endpoints are
``server.remote.kv_wire`` (re-exported here).

Ordering, as the publishers promise it (three frames ``[topic, seq 8-byte big-endian,
payload]``, seq from 0 per server process, the last 10,000 batches kept for replay, and a
replayed batch is the very payload that was sent live):

- **start**: everything the replay endpoint keeps is applied (DEALER: ``[b"", start_seq]`` ->
  ``[b"", topic, seq, payload]`` (vLLM; SGLang sends no topic) ... then seq -1);
- **duplicate**: a batch at or below the last applied seq whose payload is the one applied
  under that seq (live and replay overlap) is dropped;
- **restart, seq back**: a batch at or below the last applied seq with another payload (or,
  past the digests kept, a newer time) comes from a new server process: the tree is reset and
  rebuilt from that server's replay buffer (its seq starts again from 0, at 0 or not);
- **gap or restart, seq ahead**: a batch past the next seq asks the replay endpoint from the
  last applied seq. If the buffer holds our last batch (same payload), it is a gap: what
  follows fills it. If it holds another payload there, or nothing (a new server that has not
  published that far), the server restarted: rebuild. If it does not answer, or its buffer
  begins later, nothing can be checked: the missing batches count as ``lost`` and the tree
  goes on (``unverified``);
- **reconnect**: when the publisher's socket connects again (ZMQ's monitor), the same check
  runs at once and with the next batch, so a restart whose seq happens to go on from ours
  (we saw 0..4 of the old server, 5 is the new one's first seen) is still found.

Knows nothing about the UI or HTTP requests.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

from server.remote.block_tree import BlockTree
from server.remote.kv_wire import (  # noqa: F401 (re-exported: the subscriber's public names)
    END_SEQ,
    EventSource,
    _batch_decoder,
    decode_batch,
    decode_event,
    discover,
    parse_override,
    source_from_config,
)

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- the subscriber
@dataclass
class SubscriberStats:
    batches: int = 0  # applied, live or replayed
    events: int = 0
    replayed: int = 0  # batches applied from the replay endpoint
    gaps: int = 0  # times a seq skipped ahead
    lost: int = 0  # batches neither live nor in the replay buffer
    restarts: int = 0  # a new server process was found: the tree was rebuilt
    unverified: int = 0  # times the replay endpoint could not say whether the server restarted
    decode_errors: int = 0
    last_seq: int = -1
    last_ts: float = 0.0
    last_event_at: float = 0.0  # wall time of the last applied batch (0: none yet)


Frames = list[tuple[int, bytes]]  # (seq, payload) as the replay endpoint sent them, in order
DIGESTS_KEPT = 20_000  # payload digests remembered per seq (twice vLLM's replay buffer)
VERIFY_TRIES = 3  # after a reconnect, batches that ask the replay endpoint before giving up


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
        self.verify = False  # check the next live batch against the replay buffer (the publisher reconnected)
        self._tries = 0  # replay checks without an answer since the reconnect
        self._digests: OrderedDict[int, int] = OrderedDict()  # seq -> digest of the payload applied under it
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
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED)
        links = 0  # connections made so far: any after the first is the publisher coming back
        try:
            (sub.bind if self.source.bind else sub.connect)(self.source.endpoint)
            time.sleep(0.2)  # let the subscription reach the publisher before asking for history
            self.sync()
            self.synced = True
            self._ready.set()
            poller = zmq.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            while not self._stop.is_set():
                ready = dict(poller.poll(200))
                if monitor in ready:
                    monitor.recv_multipart()
                    links += 1
                    if links > 1:
                        self.reconnected()
                if sub not in ready:
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
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    # ----------------------------------------------------------- ordering (no socket but _fetch)
    def sync(self) -> None:
        """Apply everything the replay endpoint keeps (at start, and after a restart)."""
        for seq, payload in self._fetch(0) or []:
            self._apply(seq, payload, live=False)

    def reconnected(self) -> None:
        """The publisher's socket came back (a network blip, or a new server process): check at once
        whether the server behind it is the one the tree follows, and again with the next batch."""
        self.verify, self._tries = True, 0
        if self.stats.last_seq >= 0:
            self._fill()

    def _on_batch(self, seq: int, payload: bytes, live: bool) -> None:
        """One batch, live (``live``) or replayed, in the order it came."""
        s = self.stats
        if seq <= s.last_seq:
            known = self._digests.get(seq)
            if known == hash(payload) or not live:
                return  # a duplicate: live and replay overlap
            if known is None:  # older than the digests kept: a restart only if it is newer in time
                try:
                    if _batch_decoder.decode(payload).ts <= s.last_ts:
                        return
                except (msgspec.DecodeError, msgspec.ValidationError):
                    s.decode_errors += 1
                    return
            self._restarted(f"seq {seq} again after {s.last_seq}, another batch")
        elif live and (seq > s.last_seq + 1 or self.verify):
            if seq > s.last_seq + 1:
                s.gaps += 1
            self._fill()
        if seq <= s.last_seq:
            return  # the replay brought it already
        if seq > s.last_seq + 1:
            s.lost += seq - s.last_seq - 1
        self._apply(seq, payload, live)

    def _fill(self) -> None:
        """Ask the replay endpoint from the last applied seq on: the batch it keeps under that seq
        tells the same server (the payload we applied) from a new one (another payload, or none:
        a new server has not published that far). Same server: apply what follows (a gap filled).
        New server: rebuild. No answer, or a buffer that begins later: nothing can be checked."""
        s = self.stats
        start = max(s.last_seq, 0)
        frames = self._fetch(start)
        if frames is None or (s.last_seq >= 0 and frames and frames[0][0] > s.last_seq):
            s.unverified += 1
            self._tries += 1  # no answer: ask again with the next batches (the endpoint may be starting)
            self.verify = frames is None and bool(self.source.replay_endpoint) and self._tries < VERIFY_TRIES
            for seq, payload in frames or []:
                self._apply(seq, payload, live=False)
            return
        self.verify = False
        if s.last_seq >= 0 and (not frames or hash(frames[0][1]) != self._digests.get(s.last_seq)):
            self._restarted(f"its replay buffer does not hold our batch {s.last_seq}")
            return
        for seq, payload in frames:
            if seq > s.last_seq:
                self._apply(seq, payload, live=False)

    def _restarted(self, why: str) -> None:
        """A new server process: its cache started empty, its seq from 0. Rebuild from its buffer."""
        log.info("The backend's KV events come from a new server process (%s): rebuilding the tree", why)
        s = self.stats
        s.restarts += 1
        self.tree.reset()
        self._digests.clear()
        s.last_seq, s.last_ts = -1, 0.0
        self.verify = False
        self.sync()

    def _apply(self, seq: int, payload: bytes, live: bool) -> None:
        s = self.stats
        if seq <= s.last_seq:
            return
        try:
            ts, events = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            s.decode_errors += 1
            return
        if seq > s.last_seq + 1 and not live:
            s.lost += seq - s.last_seq - 1  # the buffer no longer held them
        self.tree.apply_all(events, ts)
        s.batches += 1
        s.events += len(events)
        s.last_seq, s.last_ts, s.last_event_at = seq, ts, time.time()
        self._digests[seq] = hash(payload)
        while len(self._digests) > DIGESTS_KEPT:
            self._digests.popitem(last=False)
        if not live:
            s.replayed += 1
        if self.on_batch is not None:
            self.on_batch()

    def _fetch(self, start: int) -> Frames | None:
        """The buffered batches from ``start`` on, from the replay endpoint; None when there is none
        or it did not answer (``[]``: it answered, holding nothing from ``start``)."""
        if not self.source.replay_endpoint:
            return None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVTIMEO, int(self.replay_timeout_s * 1000))
        out: Frames = []
        try:
            dealer.connect(self.source.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while not self._stop.is_set():
                frames = dealer.recv_multipart()  # vLLM: [b"", topic, seq, payload]; SGLang: no topic
                if len(frames) not in (3, 4):
                    continue
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == END_SEQ:
                    return out
                if seq >= start:
                    out.append((seq, frames[-1]))
        except zmq.Again:
            log.info("The replay endpoint %s did not answer within %.0f s", self.source.replay_endpoint,
                     self.replay_timeout_s)
        finally:
            dealer.close(linger=0)
        return None
