"""The ZMQ side of this engine's KV events: a PUB socket, a replay endpoint, and the thread that owns both.

Owns: ``EventStream``, the base of ``engine.kvcache.kv_events.KVEventPublisher``: the bounded
queue the cache's thread puts encoded batches into (``_emit``, which numbers them), the sending
thread, the PUB socket (every message ``[topic, seq 8-byte big-endian from 0, msgpack batch]``),
the last ``buffer_steps`` batches and the ROUTER replay endpoint that serves them (vLLM's replay:
``[client, b"", start_seq]`` answered with the buffered batches from there on, then ``seq -1``).
Knows nothing about trees, blocks or hashes (the publisher's and ``kv_event_format``'s), nor
about HTTP or UI.

Endpoints, as vLLM reads them: ``*``, ``ipc://`` and ``inproc://`` bind (a ``*`` with a one-line
warning that it listens on every interface), a plain host connects unless ``bind`` (ours: a
router connects to each replica's loopback endpoint); the replay endpoint always binds. The
publisher resolves "no endpoint" to its loopback default before it gets here.

Bounds (a slow or hostile subscriber cannot grow this process's memory without bound, nor
block the cache): the cache's thread only encodes and queues (``put_nowait``; the queue holds
at most ``max_queue`` batches, past which a batch is dropped and counted in
``dropped_batches``; its seq is taken all the same, so subscribers see a gap and count it
lost); the PUB socket's SNDHWM is ``hwm`` messages per subscriber (ZMQ drops past it); replay
answers go out a few at a time from the sending thread, at most ``REPLAY_SESSIONS`` at once,
``REPLAY_RATE`` new ones a second (more are not answered: ``replay_refused``), each at most
``REPLAY_MAX_BYTES``, through a ROUTER whose SNDHWM bounds what waits for each client (a client
that does not read within ``REPLAY_SESSION_S`` is dropped: ``replay_abandoned``).

Thread safety: ``_emit`` is called under the publisher's lock (which orders the seqs) and never
waits nor logs. One daemon thread owns both sockets (ZMQ sockets are not thread safe) and logs.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import zmq

from engine.kvcache.kv_event_format import EventBatch

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_HWM = 10_000  # messages waiting per subscriber (vLLM's default is 100,000)
REPLAY_SESSIONS = 4  # replay answers under way at once
REPLAY_RATE = 5.0  # new replay answers a second (a burst of REPLAY_BURST)
REPLAY_BURST = 10
REPLAY_HWM = 1_000  # replayed messages waiting per client (ROUTER's SNDHWM)
REPLAY_MAX_BYTES = 256 << 20  # one answer's payloads (cut there: the END frame follows)
REPLAY_SESSION_S = 60.0  # a client that has not taken its answer by then is dropped
REPLAY_STEP = 256  # messages sent to one client per turn of the sending thread

log = logging.getLogger("engine.kvcache.kv_events")  # the KV events' one log, as before the split


@dataclass
class _ReplayAnswer:
    """One replay request being answered: the batches to send, from ``pos`` on."""

    client: bytes
    items: list[tuple[int, bytes]]
    deadline: float
    pos: int = 0
    ended: bool = False  # the END frame went out


def _warn_if_every_interface(endpoint: str) -> None:
    if endpoint.startswith("tcp://*") or endpoint.startswith("tcp://0.0.0.0") or endpoint.startswith("tcp://[::]"):
        log.warning("KV events: %s listens on every interface (anyone who can reach this host can read the "
                    "stream); name a host such as tcp://127.0.0.1:PORT to keep it local", endpoint)


class EventStream:
    """Numbered batches out over ZMQ, with a bounded replay (see the module docstring)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = DEFAULT_HWM, max_queue: int | None = None,
                 bind: bool = False) -> None:
        """``endpoint``: vLLM's rule (``*``, ``ipc://`` and ``inproc://`` bind, a plain host
        connects) unless ``bind``. ``max_queue``: batches waiting for the sending thread (default
        ``buffer_steps``)."""
        self.topic = topic.encode()
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
        self.binds = bind or "*" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
        if self.binds:
            _warn_if_every_interface(endpoint)
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
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

    # ----------------------------------------------------------- the socket thread
    def _emit(self, events: list) -> None:
        """Encode and queue (under the publisher's lock, which orders the seqs); never waits: a full
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
