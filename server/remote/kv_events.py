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

Bad input never stops the thread (``handle_frames``, the one entry for a live message, never
raises):

- a message that is not ``[topic, 8-byte seq >= 0, payload]`` counts in ``bad_frames``; a payload
  that is not a valid batch (``kv_wire.decode_batch``: every field's type, shape and size
  checked) in ``decode_errors``. Either is **rejected whole** before anything is applied or any
  ordering rule acts (a bad batch can neither change the tree nor pass for a restart), logged
  (one line, no traceback, at most once a minute per kind) and counted in ``rejected``; the
  next batch is handled as usual (a seq it skipped reads as a gap);
- a valid batch the tree fails to apply (a bug, never bad input) counts in ``apply_errors`` (and
  ``rejected``), is logged with its traceback (rate-limited), and, since it may have been half
  applied, the tree is rebuilt from the replay endpoint without that batch (emptied where there
  is none), so the tree's invariants hold;
- a replay answer is bounded (``replay_max_batches``, 10,000 as vLLM's buffer;
  ``replay_max_bytes``; ``replay_deadline_s`` for the whole answer): past a bound the fetch
  stops, logs, counts ``replay_truncated``, and what came is applied as the answer (what it cut
  off comes as a gap with the next live batch, or counts as lost). Each socket refuses messages
  over ``kv_wire.MAX_PAYLOAD_BYTES`` (ZMQ's MAXMSGSIZE drops the connection).

Knows nothing about the UI or HTTP requests.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq

from server.remote.block_tree import BlockTree, Event
from server.remote.kv_wire import (  # noqa: F401 (re-exported: the subscriber's public names)
    END_SEQ,
    MAX_PAYLOAD_BYTES,
    EventSource,
    WireError,
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
    decode_errors: int = 0  # payloads that were not a valid batch (not msgpack; a field's type, shape or size)
    bad_frames: int = 0  # messages that were not [topic, 8-byte seq >= 0, payload] (live or replayed)
    apply_errors: int = 0  # valid batches the tree failed to apply (a bug): the tree was rebuilt without them
    rejected: int = 0  # batches not applied for any of the three reasons above
    replay_truncated: int = 0  # replay answers cut at a bound (batches, bytes or seconds)
    last_seq: int = -1
    last_ts: float = 0.0
    last_event_at: float = 0.0  # wall time of the last applied batch (0: none yet)


Frames = list[tuple[int, bytes]]  # (seq, payload) as the replay endpoint sent them, in order
Batch = tuple[float, list[Event]]  # a decoded, checked payload: (ts, events)
DIGESTS_KEPT = 20_000  # payload digests remembered per seq (twice vLLM's replay buffer)
VERIFY_TRIES = 3  # after a reconnect, batches that ask the replay endpoint before giving up
REPLAY_MAX_BATCHES = 10_000  # vLLM's replay buffer
REPLAY_MAX_BYTES = 512 << 20
REPLAY_DEADLINE_S = 60.0  # for a whole replay answer (each frame also within replay_timeout_s)
POISON_KEPT = 1_000  # digests of batches the tree failed to apply, skipped when replayed
COMPLAIN_EVERY_S = 60.0


class _Complaints:
    """Warnings about bad input, one line each, at most one per kind every ``every_s`` seconds
    (the next one says how many were held back)."""

    def __init__(self, every_s: float = COMPLAIN_EVERY_S) -> None:
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._held: Counter[str] = Counter()

    def __call__(self, kind: str, message: str, *args: object, exc_info: bool = False) -> None:
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self.every_s:
            self._held[kind] += 1
            return
        self._last[kind] = now
        held = self._held.pop(kind, 0)
        if held:
            message, args = message + " (and %d more since the last such warning)", (*args, held)
        log.warning(message, *args, exc_info=exc_info)


class KVEventSubscriber:
    """Follows one event source into ``tree`` on a daemon thread (``start``/``close``)."""

    def __init__(self, source: EventSource, tree: BlockTree | None = None, *, replay_timeout_s: float = 2.0,
                 on_batch: Callable[[], None] | None = None) -> None:
        self.source = source
        self.tree = tree if tree is not None else BlockTree()
        self.stats = SubscriberStats()
        self.replay_timeout_s = replay_timeout_s
        self.replay_max_batches = REPLAY_MAX_BATCHES
        self.replay_max_bytes = REPLAY_MAX_BYTES
        self.replay_deadline_s = REPLAY_DEADLINE_S
        self.on_batch = on_batch
        self.drop_next = 0  # tests: drop this many live batches, as a slow network would
        self.synced = False  # the history the replay endpoint kept has been applied
        self.verify = False  # check the next live batch against the replay buffer (the publisher reconnected)
        self._tries = 0  # replay checks without an answer since the reconnect
        self._digests: OrderedDict[int, int] = OrderedDict()  # seq -> digest of the payload applied under it
        self._poison: OrderedDict[int, None] = OrderedDict()  # digests of payloads the tree failed to apply
        self._rebuilding = False  # rebuilding after an apply error (another error then does not rebuild again)
        self._complain = _Complaints()
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

    def figures(self) -> dict[str, int | float]:
        """The counters (``SubscriberStats``) as one flat dict, for ``kv_event_figures`` and /metrics."""
        return dict(vars(self.stats))

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
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED)
        links = 0  # connections made so far: any after the first is the publisher coming back
        try:
            (sub.bind if self.source.bind else sub.connect)(self.source.endpoint)
            time.sleep(0.2)  # let the subscription reach the publisher before asking for history
            self._guarded("the first replay", self.sync)
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
                        self._guarded("a reconnect", self.reconnected)
                if sub in ready:
                    self.handle_frames(sub.recv_multipart())
        except zmq.ContextTerminated:
            pass
        except Exception:  # the sockets themselves failed (a bad endpoint): nothing to follow
            log.exception("The KV event subscriber stopped")
        finally:
            self._ready.set()
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    def handle_frames(self, frames: Sequence[bytes]) -> bool:
        """One live message as the SUB socket gave it (``[topic, seq, payload]``): checked, then
        ordered and applied (``_on_batch``). Never raises: bad input is counted and logged (the
        module docstring). True when the batch was applied."""
        s = self.stats
        try:
            if len(frames) != 3 or not all(isinstance(f, bytes) for f in frames) or len(frames[1]) != 8:
                self._reject("bad_frames", "Rejected a KV event message of %d frames (want [topic, 8-byte seq, "
                             "payload])", len(frames))
                return False
            seq = int.from_bytes(frames[1], "big", signed=True)
            if seq < 0:
                self._reject("bad_frames", "Rejected a KV event batch with the negative seq %d", seq)
                return False
            if self.drop_next > 0:
                self.drop_next -= 1
                return False
            return self._on_batch(seq, frames[2], live=True)
        except Exception:
            s.apply_errors += 1
            s.rejected += 1
            self._complain("unexpected", "A KV event message could not be handled; going on with the next",
                           exc_info=True)
            return False

    def _guarded(self, what: str, step: Callable[[], None]) -> None:
        try:
            step()
        except zmq.ContextTerminated:
            raise
        except Exception:
            self._complain("unexpected", "The KV event subscriber failed in %s; going on", what, exc_info=True)

    # ----------------------------------------------------------- checking (no socket)
    def _reject(self, kind: str, message: str, *args: object) -> None:
        """Count (in ``kind`` and ``rejected``) and log a batch that is not applied: bad input."""
        s = self.stats
        setattr(s, kind, getattr(s, kind) + 1)
        s.rejected += 1
        self._complain(kind, message, *args)

    def _decode(self, seq: int, payload: bytes) -> Batch | None:
        """The checked batch, or None (rejected: counted, logged)."""
        try:
            return decode_batch(payload)
        except WireError as exc:
            self._reject("decode_errors", "Rejected KV event batch %d from %s: %s", seq, self.source.endpoint,
                         str(exc)[:300])
            return None

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

    def _on_batch(self, seq: int, payload: bytes, live: bool) -> bool:
        """One batch, live (``live``) or replayed, in the order it came; checked before any rule
        acts on it. True when it was applied."""
        s = self.stats
        if seq <= s.last_seq:
            known = self._digests.get(seq)
            if known == hash(payload) or not live:
                return False  # a duplicate: live and replay overlap
        batch = self._decode(seq, payload)
        if batch is None:
            return False
        if seq <= s.last_seq:
            if self._digests.get(seq) is None and batch[0] <= s.last_ts:
                return False  # older than the digests kept: a restart only if it is newer in time
            self._restarted(f"seq {seq} again after {s.last_seq}, another batch")
        elif live and (seq > s.last_seq + 1 or self.verify):
            if seq > s.last_seq + 1:
                s.gaps += 1
            self._fill()
        if seq <= s.last_seq:
            return False  # the replay brought it already
        if seq > s.last_seq + 1:
            s.lost += seq - s.last_seq - 1
        return self._apply(seq, payload, live, batch)

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
        self.stats.restarts += 1
        self._rebuild()

    def _rebuild(self) -> None:
        s = self.stats
        self.tree.reset()
        self._digests.clear()
        s.last_seq, s.last_ts = -1, 0.0
        self.verify = False
        self.sync()

    def _apply(self, seq: int, payload: bytes, live: bool, batch: Batch | None = None) -> bool:
        s = self.stats
        if seq <= s.last_seq:
            return False
        if hash(payload) in self._poison:  # the tree failed on it before: skipped, as if applied
            s.last_seq = seq
            self._digests[seq] = hash(payload)
            return False
        if batch is None:
            batch = self._decode(seq, payload)
            if batch is None:
                return False
        ts, events = batch
        if seq > s.last_seq + 1 and not live:
            s.lost += seq - s.last_seq - 1  # the buffer no longer held them
        try:
            self.tree.apply_all(events, ts)
        except Exception:
            self._apply_failed(seq, payload)
            return False
        s.batches += 1
        s.events += len(events)
        s.last_seq, s.last_ts, s.last_event_at = seq, ts, time.time()
        self._remember(seq, payload)
        if not live:
            s.replayed += 1
        if self.on_batch is not None:
            self.on_batch()
        return True

    def _remember(self, seq: int, payload: bytes) -> None:
        self._digests[seq] = hash(payload)
        while len(self._digests) > DIGESTS_KEPT:
            self._digests.popitem(last=False)

    def _apply_failed(self, seq: int, payload: bytes) -> None:
        """A checked batch the tree failed on (a bug): it may be half applied, so the tree starts
        again from the replay endpoint's buffer without it (empty where there is none)."""
        s = self.stats
        s.apply_errors += 1
        s.rejected += 1
        self._complain("apply", "The block tree failed to apply KV event batch %d; rebuilding it without that "
                       "batch", seq, exc_info=True)
        self._poison[hash(payload)] = None
        while len(self._poison) > POISON_KEPT:
            self._poison.popitem(last=False)
        if self._rebuilding or not self.source.replay_endpoint:
            self.tree.reset()  # empty: every invariant holds; what follows applies on it
            s.last_seq = max(s.last_seq, seq)
            self._remember(seq, payload)
            return
        self._rebuilding = True
        try:
            self._rebuild()
        finally:
            self._rebuilding = False
        s.last_seq = max(s.last_seq, seq)  # no answer: go on after the batch that failed

    def _fetch(self, start: int) -> Frames | None:
        """The buffered batches from ``start`` on, from the replay endpoint; None when there is none
        or it did not answer (``[]``: it answered, holding nothing from ``start``). Bounded: past
        ``replay_max_batches`` batches, ``replay_max_bytes`` bytes or ``replay_deadline_s`` seconds,
        what came so far is the answer (logged, counted in ``replay_truncated``)."""
        if not self.source.replay_endpoint:
            return None
        s = self.stats
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES)
        out: Frames = []
        size = 0
        deadline = time.monotonic() + self.replay_deadline_s
        try:
            dealer.connect(self.source.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0 or len(out) >= self.replay_max_batches or size >= self.replay_max_bytes:
                    s.replay_truncated += 1
                    self._complain("replay_truncated", "The replay endpoint %s sent %d batches (%d bytes) in %.0f s "
                                   "without its end: stopped there, applying what came", self.source.replay_endpoint,
                                   len(out), size, self.replay_deadline_s - max(left, 0.0))
                    return out
                if not dealer.poll(int(min(left, self.replay_timeout_s) * 1000) + 1):
                    if time.monotonic() < deadline:
                        raise zmq.Again()
                    continue
                frames = dealer.recv_multipart()  # vLLM: [b"", topic, seq, payload]; SGLang: no topic
                if len(frames) not in (3, 4) or len(frames[-2]) != 8:
                    self._reject("bad_frames", "Rejected a replayed KV event message of %d frames", len(frames))
                    continue
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == END_SEQ:
                    return out
                if seq >= start:
                    out.append((seq, frames[-1]))
                    size += len(frames[-1])
        except zmq.Again:
            log.info("The replay endpoint %s did not answer within %.0f s", self.source.replay_endpoint,
                     self.replay_timeout_s)
        except zmq.ContextTerminated:
            raise
        except zmq.ZMQError as exc:  # a bad endpoint, a socket error: no answer
            self._complain("replay_error", "The replay endpoint %s failed: %s", self.source.replay_endpoint, exc)
        finally:
            dealer.close(linger=0)
        return None
