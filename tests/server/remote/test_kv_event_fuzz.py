"""Bad input to the KV event subscriber (server/remote/kv_events.py, kv_wire.py): a malformed
batch is rejected whole, counted and logged, the tree stays as it was and keeps its
invariants, and the next valid batch is applied. Over a real ZMQ PUB socket (garbage, then a
valid batch), through ``handle_frames`` (the thread's one entry for a live message) under
hypothesis, and the replay fetch's bounds against a replay endpoint that never ends."""

from __future__ import annotations

import itertools
import logging
import threading
import time

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.remote import kv_wire
from server.remote.block_tree import BlockTree
from server.remote.kv_events import EventSource, KVEventSubscriber
from tests.helpers_app import free_port

TOPIC = b"t"


def stored(h: int, ts: float = 1.0, **fields: object) -> bytes:
    """A valid vLLM-form batch storing one 4-token block ``h`` (``fields`` override the event's)."""
    event = {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None, "token_ids": [h % 1000] * 4,
             "block_size": 4, "medium": "GPU", **fields}
    return msgspec.msgpack.encode([ts, [event], 0])


def seq8(n: int) -> bytes:
    return n.to_bytes(8, "big", signed=True)


def state(tree: BlockTree) -> list:
    return sorted((repr(h), sorted(b.media.items())) for h, b in tree.blocks.items())


# ------------------------------------------------------------------ over a real socket
class Pub:
    """A bare PUB socket on loopback: frames go out exactly as given (no code of ours encodes them)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.sock.bind(self.endpoint)

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(frames)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def test_a_bad_extra_key_over_a_real_socket_no_longer_stops_the_subscriber(caplog):
    """Issue 43: ``"extra_keys": [7]`` raised TypeError in the tree, the thread died, and nothing
    was ever applied again. Now it is rejected, counted, logged once, and the stream goes on."""
    pub = Pub()
    sub = KVEventSubscriber(EventSource(pub.endpoint, None, TOPIC.decode())).start()
    try:
        first = stored(1)
        deadline = time.monotonic() + 10  # until the subscription has reached the PUB socket
        while sub.stats.batches == 0 and time.monotonic() < deadline:
            pub.send(TOPIC, seq8(0), first)  # the same payload again: a duplicate, dropped
            time.sleep(0.05)
        assert sub.stats.batches == 1
        before = state(sub.tree)
        with caplog.at_level(logging.WARNING, logger="server.remote.kv_events"):
            pub.send(TOPIC, seq8(1), stored(2, extra_keys=[7]))  # the batch
            pub.send(TOPIC, seq8(1), stored(3, extra_keys=[[{"nested": "map"}]]))
            pub.send(TOPIC, seq8(1), b"\xc1 not msgpack at all")
            pub.send(TOPIC, seq8(1))  # two frames
            pub.send(TOPIC, b"\x01", stored(4))  # a one-byte seq
            pub.send(TOPIC, seq8(-5), stored(5))  # a negative seq: never a restart
            pub.send(TOPIC, seq8(1), stored(6, block_size=0))
            pub.send(TOPIC, seq8(1), stored(7, token_ids=[-1, 2, 3, 4]))
            assert sub.wait_for(lambda: sub.stats.rejected == 8), sub.stats
            assert sub.alive and state(sub.tree) == before and sub.stats.restarts == 0
            pub.send(TOPIC, seq8(1), stored(8))
            assert sub.wait_for(lambda: 8 in sub.tree.blocks)
        s = sub.stats
        assert sub.alive and (s.batches, s.last_seq, s.decode_errors, s.bad_frames, s.apply_errors) == (2, 1, 5, 3, 0)
        f = sub.figures()
        assert f["rejected"] == 8 and f["decode_errors"] == 5 and f["bad_frames"] == 3
        sub.tree.check_invariants()
        lines = [r for r in caplog.records if r.name == "server.remote.kv_events"]
        assert lines and not any(r.exc_info for r in lines)  # bad input: one line, no traceback
        assert len([r for r in lines if "Rejected KV event batch" in r.getMessage()]) == 1  # once a minute
    finally:
        sub.close()
        pub.close()


# ------------------------------------------------------------------ whole or nothing
def bare() -> KVEventSubscriber:
    """A subscriber never started: no socket; ``handle_frames`` is what its thread would call."""
    return KVEventSubscriber(EventSource("tcp://127.0.0.1:1"))


def test_a_batch_is_applied_whole_or_not_at_all():
    sub = bare()
    try:
        assert sub.handle_frames([TOPIC, seq8(0), stored(1)])
        before = state(sub.tree)
        good = {"type": "BlockStored", "block_hashes": [2], "token_ids": [1] * 4, "block_size": 4}
        bad = dict(good, block_hashes=[3], extra_keys=[7])
        for events in ([good, bad], [{"type": "BlockRemoved", "block_hashes": [1]}, bad],
                       [{"type": "AllBlocksCleared"}, {"type": 5}], [good, 17]):
            assert not sub.handle_frames([TOPIC, seq8(1), msgspec.msgpack.encode([2.0, events, 0])])
            assert state(sub.tree) == before
        assert sub.stats.rejected == 4 and sub.stats.last_seq == 0
        assert sub.handle_frames([TOPIC, seq8(1), msgspec.msgpack.encode([2.0, [good], 0])])
        sub.tree.check_invariants()
    finally:
        sub._ctx.term()


def test_a_failure_inside_the_tree_rebuilds_it_and_goes_on(monkeypatch, caplog):
    """A checked batch the tree fails on (a bug) may be half applied: the tree is rebuilt from
    the replay buffer without it, its invariants hold, and the batches after it apply."""
    buffer = [(0, stored(1)), (1, stored(2)), (2, stored(3))]
    sub = KVEventSubscriber(EventSource("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"))
    sub._fetch = lambda start: [(s, p) for s, p in buffer if s >= start]
    tree = sub.tree
    real = tree._store

    def half_then_boom(e, ts):
        real(e, ts)
        if 2 in e.block_hashes:
            tree.held["GPU"] += 5  # a half-done change: the counts no longer match the blocks
            raise RuntimeError("a bug in the tree")

    monkeypatch.setattr(tree, "_store", half_then_boom)
    try:
        with caplog.at_level(logging.WARNING):
            for seq, payload in buffer:
                sub.handle_frames([TOPIC, seq8(seq), payload])
        tree.check_invariants()
        assert sub.stats.apply_errors == 1 and sub.stats.rejected == 1 and sub.stats.last_seq == 2
        assert set(tree.blocks) == {1, 3}  # rebuilt from the buffer without the batch that failed
        buffer.append((3, stored(4)))
        assert sub.handle_frames([TOPIC, seq8(3), buffer[-1][1]]) and 4 in tree.blocks
    finally:
        sub._ctx.term()


def test_huge_lists_and_deep_nesting_are_rejected():
    sub = bare()
    try:
        too_many = stored(1, block_hashes=list(range(kv_wire.MAX_BLOCKS + 1)))
        # [1.0, [[[...100,000 deep...]]], 0]
        deep = b"\x93\xcb" + msgspec.msgpack.encode(1.0)[1:] + b"\x91" + b"\x91" * 100_000 + b"\xc0" + b"\x00"
        long_salt = stored(1, extra_keys=[["s" * (kv_wire.MAX_KEY_BYTES + 1)]])
        big_hash = stored(1, block_hashes=[b"x" * 65])
        for payload in (too_many, deep, long_salt, big_hash, b"\x00" * (kv_wire.MAX_PAYLOAD_BYTES + 1)):
            assert not sub.handle_frames([TOPIC, seq8(0), payload])
        assert sub.stats.decode_errors == 5 and sub.stats.apply_errors == 0 and not sub.tree.blocks
        assert sub.handle_frames([TOPIC, seq8(0), stored(1, extra_keys=[["salt", 3, b"\x01", ["mm", 0]]])])
    finally:
        sub._ctx.term()


# ------------------------------------------------------------------ hypothesis
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True),
                    st.text(max_size=8), st.binary(max_size=8))
anything = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                        max_leaves=12)
FIELDS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "lora_id", "lora_name",
          "extra_keys", "group_idx"]
TEMPLATES = [
    {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None, "token_ids": [1] * 8,
     "block_size": 4, "medium": "GPU", "extra_keys": [["salt"], None]},
    {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"},
    {"type": "AllBlocksCleared"},
]
ARRAYS = [["BlockStored", [21], None, [2] * 4, 4, None], ["BlockRemoved", [21]], ["AllBlocksCleared"]]


@st.composite
def events(draw: st.DrawFn) -> object:
    kind = draw(st.integers(0, 5))
    if kind == 0:
        return draw(anything)  # anything at all in an event's place
    if kind in (1, 2):  # a real event with one field replaced (valid types in wrong places, wrong tags)
        e = dict(draw(st.sampled_from(TEMPLATES)))
        e[draw(st.sampled_from(FIELDS))] = draw(anything)
        return e
    if kind == 3:  # an array event cut short, padded, or with a field replaced (wrong array lengths)
        a = list(draw(st.sampled_from(ARRAYS)))
        cut = draw(st.integers(0, len(a) + 2))
        a = a[:cut] + [draw(anything) for _ in range(max(0, cut - len(a)))]
        if a and draw(st.booleans()):
            a[draw(st.integers(0, len(a) - 1))] = draw(anything)
        return a
    return dict(draw(st.sampled_from(TEMPLATES)))  # valid


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 5))
    if kind == 0:
        return draw(st.binary(max_size=64))  # not msgpack (mostly)
    if kind == 1:
        return msgspec.msgpack.encode(draw(anything))
    if kind == 2:  # a batch of the wrong shape
        return msgspec.msgpack.encode(draw(st.lists(anything, max_size=5)))
    if kind == 3:  # deep nesting in an event's place
        depth = draw(st.integers(1, 3000))
        return b"\x93\xcb" + msgspec.msgpack.encode(2.0)[1:] + b"\x91" + b"\x91" * depth + b"\xc0" + b"\x00"
    ts = draw(st.one_of(st.floats(0, 2e9), anything))
    return msgspec.msgpack.encode([ts, draw(st.lists(events(), max_size=4)), draw(st.one_of(st.just(0), anything))])


@st.composite
def messages(draw: st.DrawFn) -> list[bytes]:
    n = draw(st.sampled_from([3, 3, 3, 3, 0, 1, 2, 4, 6]))
    seq = draw(st.one_of(st.integers(0, 8), st.integers(-(2**63), 2**63 - 1)))
    frames = [TOPIC, seq.to_bytes(8, "big", signed=True) if draw(st.booleans()) or seq < 0 else
              draw(st.binary(max_size=12)), draw(payloads())]
    return (frames + [b"x"] * n)[:n]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(messages(), min_size=1, max_size=6), st.one_of(st.none(), st.lists(payloads(), max_size=3)))
def test_no_input_stops_the_subscriber_or_breaks_the_tree(stream, replayed):
    sub = KVEventSubscriber(EventSource("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"))
    # the replay endpoint (asked on gaps and restarts) answers garbage too, or nothing
    sub._fetch = lambda start: None if replayed is None else [(start + i, p) for i, p in enumerate(replayed)]
    fresh = itertools.count(10**12)
    try:
        for frames in stream:
            assert sub.handle_frames(frames) in (True, False)
            sub.tree.check_invariants()
            assert sub.stats.apply_errors == 0  # every bad input was refused by the checks, none by the catch-all
            h = next(fresh)
            assert sub.handle_frames([TOPIC, seq8(sub.stats.last_seq + 1), stored(h, ts=3e9)])
            assert h in sub.tree.blocks
            sub.tree.check_invariants()
    finally:
        sub._ctx.term()


# ------------------------------------------------------------------ the replay fetch's bounds
class EndlessReplay:
    """A ROUTER that answers every replay request with batches and never the end frame."""

    def __init__(self, every_s: float = 0.0) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.sock.bind(self.endpoint)
        self.every_s = every_s
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.loop, daemon=True)
        self.t.start()

    def loop(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            client, _, _ = self.sock.recv_multipart()
            for seq in itertools.count():
                if self.stop.is_set() or self.sock.poll(0):  # a new request: answer that one (endlessly)
                    break
                try:
                    self.sock.send_multipart([client, b"", TOPIC, seq8(seq), stored(seq + 1)], zmq.NOBLOCK)
                except zmq.Again:
                    time.sleep(0.001)
                if self.every_s:
                    time.sleep(self.every_s)

    def close(self) -> None:
        self.stop.set()
        self.t.join()
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.mark.parametrize("bound", ["batches", "bytes", "deadline"])
def test_a_replay_that_never_ends_is_cut_at_a_bound(bound):
    server = EndlessReplay(every_s=0.01 if bound == "deadline" else 0.0)
    sub = KVEventSubscriber(EventSource("tcp://127.0.0.1:1", server.endpoint), replay_timeout_s=2.0)
    sub.replay_max_batches = 300 if bound == "batches" else 10**9
    sub.replay_max_bytes = 20_000 if bound == "bytes" else 10**12
    sub.replay_deadline_s = 0.5 if bound == "deadline" else 30.0
    try:
        t0 = time.monotonic()
        frames = sub._fetch(0)
        took = time.monotonic() - t0
        assert frames is not None and sub.stats.replay_truncated == 1 and took < 5
        if bound == "batches":
            assert len(frames) == 300
        elif bound == "bytes":
            assert sum(len(p) for _, p in frames) >= 20_000 > sum(len(p) for _, p in frames[:-1])
        else:
            assert 0 < len(frames) < 500 and took >= 0.5
        sub.sync()  # what came is applied as the answer
        assert sub.tree.num_blocks > 0
        sub.tree.check_invariants()
    finally:
        sub._ctx.term()
        server.close()
