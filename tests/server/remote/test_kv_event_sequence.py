"""The subscriber's ordering rules (server/remote/kv_events.py): a server restart (seq from 0
again, the cache empty) against a gap (batches missed, filled from the replay endpoint), with
hand-built vLLM-form batches from a model of vLLM's publisher (seq from 0 per process, a replay
buffer holding the very payloads it sent). No socket: live batches go to ``_on_batch``, a
publisher reconnect to ``reconnected`` (what ZMQ's monitor reports), and ``_fetch`` asks the
model's buffer. The named cases first, then a model-based test over random runs."""

from __future__ import annotations

import random
from collections import deque

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.remote import kv_events
from server.remote.block_tree import BlockTree
from server.remote.kv_events import EventSource, KVEventSubscriber
from server.remote.kv_wire import decode_batch

CLOCK = [1_000.0]  # time goes on across server processes


class Server:
    """One vLLM process's publisher: batches of BlockStored / BlockRemoved / AllBlocksCleared over a
    small set of hashes (a new process stores the same hashes again, as vLLM's do across restarts)."""

    def __init__(self, seed: int = 0, buffer: int = 10_000) -> None:
        self.rng = random.Random(seed)
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self.log: list[bytes] = []  # every payload, for the expected tree
        self.held: set[int] = set()
        self.answers = True  # the replay endpoint answers

    def publish(self) -> tuple[int, bytes]:
        r = self.rng
        events = []
        for _ in range(r.randrange(1, 4)):
            free = [h for h in range(1, 40) if h not in self.held]
            if self.held and r.random() < 0.35:
                h = r.choice(sorted(self.held))
                self.held.discard(h)
                events.append({"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"})
            elif r.random() < 0.04:
                self.held.clear()
                events.append({"type": "AllBlocksCleared"})
            elif free:
                h = r.choice(free)
                self.held.add(h)
                events.append({"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None,
                               "token_ids": [h] * 4, "block_size": 4, "medium": "GPU"})
        CLOCK[0] += 1.0
        payload = msgspec.msgpack.encode([CLOCK[0], events, 0])
        item = (self.seq, payload)
        self.buffer.append(item)
        self.log.append(payload)
        self.seq += 1
        return item

    def replay(self, start: int) -> list[tuple[int, bytes]] | None:
        return [(s, p) for s, p in self.buffer if s >= start] if self.answers else None

    def expected(self) -> list:
        tree = BlockTree()
        for payload in self.log:
            ts, events = decode_batch(payload)
            tree.apply_all(events, ts)
        return state(tree)


def state(tree: BlockTree) -> list:
    return sorted((h, sorted(b.media.items())) for h, b in tree.blocks.items())


class Rig:
    """A subscriber (never started: no socket) in front of whichever server runs now."""

    def __init__(self, replay: bool = True) -> None:
        self.server = Server()
        self.sub = KVEventSubscriber(EventSource("tcp://127.0.0.1:1", "tcp://127.0.0.1:2" if replay else None))
        self.sub._fetch = lambda start: self.server.replay(start) if replay else None

    def live(self, n: int = 1, deliver: bool = True) -> None:
        for _ in range(n):
            seq, payload = self.server.publish()
            if deliver:
                self.sub._on_batch(seq, payload, live=True)

    def restart(self, seed: int, signal: bool = True) -> None:
        answers = self.server.answers
        self.server = Server(seed)
        self.server.answers = answers
        if signal:
            self.sub.reconnected()

    @property
    def right(self) -> bool:
        self.sub.tree.check_invariants()
        return state(self.sub.tree) == self.server.expected()

    def close(self) -> None:
        self.sub._ctx.term()


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()


# ------------------------------------------------------------------ the named cases
def test_a_gap_is_filled_from_the_replay_buffer(rig):
    rig.live(2)
    rig.live(2, deliver=False)
    rig.live(1)
    s = rig.sub.stats
    # the two missed, and the live one itself (the buffer holds it too; live it is then a duplicate)
    assert rig.right and (s.gaps, s.restarts, s.replayed, s.lost, s.last_seq) == (1, 0, 3, 0, 4)


def test_live_and_replay_overlap_is_no_restart(rig):
    rig.live(3)
    for seq, payload in rig.server.replay(0):  # the same payloads again, as at start-up
        rig.sub._on_batch(seq, payload, live=True)
    assert rig.right and rig.sub.stats.restarts == 0 and rig.sub.stats.batches == 3


def test_a_restart_seen_from_its_first_batch(rig):
    rig.live(4)
    rig.restart(1, signal=False)
    rig.live(1)  # seq 0 again, another payload
    assert rig.right and rig.sub.stats.restarts == 1 and rig.sub.stats.last_seq == 0


def test_a_restart_whose_first_batches_were_lost_seq_back_but_not_to_zero(rig):
    rig.live(6)
    rig.restart(2, signal=False)
    rig.live(2, deliver=False)
    rig.live(1)  # seq 2 < 5: its payload is not the one we applied under 2
    assert rig.right and rig.sub.stats.restarts == 1 and rig.sub.stats.replayed == 3  # 0..2 from its buffer


def test_a_restart_whose_first_seen_batch_is_past_our_last_seq(rig):
    rig.live(3)
    rig.restart(3, signal=False)
    rig.live(6, deliver=False)
    rig.live(1)  # seq 6 > 3: looks like a gap; the buffer holds another batch under our last seq 2
    s = rig.sub.stats
    assert rig.right and s.restarts == 1 and s.gaps == 1 and s.last_seq == 6


def test_a_restart_that_goes_on_from_our_seq_is_found_by_the_reconnect(rig):
    rig.live(3)
    rig.restart(4, signal=False)
    rig.live(3, deliver=False)
    rig.sub.reconnected()  # ZMQ's monitor: the publisher's socket came back (here after 0..2 went by)
    rig.live(1)  # seq 3, right after our 2: no gap, yet another server
    assert rig.right and rig.sub.stats.restarts == 1 and rig.sub.stats.gaps == 0


def test_a_reconnect_to_a_new_server_that_published_nothing_empties_the_tree(rig):
    rig.live(5)
    rig.restart(5)  # the buffer answers with nothing from our seq 4 on: it never got that far
    assert rig.sub.tree.num_blocks == 0 and rig.right and rig.sub.stats.restarts == 1
    rig.live(2)
    assert rig.right


def test_a_reconnect_to_the_same_server_fills_what_it_missed(rig):
    rig.live(2)
    rig.live(3, deliver=False)
    rig.sub.reconnected()  # a network blip: the same server, our last batch still in its buffer
    assert rig.right and rig.sub.stats.restarts == 0 and rig.sub.stats.replayed == 3


def test_replay_that_does_not_answer(rig):
    rig.live(2)
    rig.server.answers = False
    rig.live(2, deliver=False)
    rig.live(1)  # a gap nobody can fill or check: counted lost, the tree goes on
    s = rig.sub.stats
    assert (s.gaps, s.lost, s.unverified, s.restarts, s.last_seq) == (1, 2, 1, 0, 4)
    rig.restart(6)  # a restart behind a silent endpoint: the reconnect cannot check it...
    assert rig.sub.verify and s.restarts == 0
    rig.server.answers = True
    rig.live(1)  # ...the next batch does (seq 0 < 4 would tell anyway); the tree is the new server's
    assert rig.right and s.restarts == 1 and not rig.sub.verify


def test_a_restart_seq_back_while_the_replay_is_silent_keeps_only_what_came(rig):
    rig.live(4)
    rig.server.answers = False
    rig.restart(7, signal=False)
    rig.live(2, deliver=False)
    rig.live(1)
    s = rig.sub.stats
    assert s.restarts == 1 and s.lost == 2 and s.last_seq == 2
    assert state(rig.sub.tree) == state(tree_of(rig.server.log[2:]))  # only batch 2 is known


def test_a_buffer_that_begins_after_our_last_seq_cannot_be_checked():
    r = Rig()
    r.server = Server(8, buffer=3)
    try:
        r.live(2)
        r.live(5, deliver=False)  # seqs 2..6
        r.live(1)  # seq 7: the buffer keeps 5..7, not our last seq 1
        s = r.sub.stats
        assert (s.restarts, s.unverified, s.lost, s.last_seq) == (0, 1, 3, 7) and s.replayed == 3
    finally:
        r.close()


def test_past_the_digests_kept_a_newer_time_tells_the_restart(rig, monkeypatch):
    monkeypatch.setattr(kv_events, "DIGESTS_KEPT", 2)
    rig.live(6)
    old = rig.server.buffer[1]
    rig.sub._on_batch(*old, live=True)  # seq 1, older than the digests kept, not newer: a duplicate
    assert rig.sub.stats.restarts == 0
    rig.restart(9, signal=False)
    rig.live(2)  # seq 0 and 1: no digest kept for them, newer in time: a restart
    assert rig.right and rig.sub.stats.restarts == 1


def tree_of(payloads: list[bytes]) -> BlockTree:
    tree = BlockTree()
    for p in payloads:
        ts, events = decode_batch(p)
        tree.apply_all(events, ts)
    return tree


# ------------------------------------------------------------------ model-based: random runs
ACTIONS = st.lists(st.sampled_from(["live", "live", "live", "drop", "drop", "restart", "quiet restart",
                                    "blip"]), max_size=40)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=ACTIONS, seed=st.integers(0, 10_000))
def test_after_any_run_the_tree_is_the_current_servers(actions, seed):
    """Lost batches, restarts with or without a reconnect seen, network blips: after the next
    batch that comes through, the tree is exactly what the current server's batches built.
    One run the subscriber cannot tell is left out: a restart with no reconnect seen whose first
    batch seen carries exactly our next seq (nothing in the stream differs from a plain batch)."""
    r = Rig()
    quiet = False  # a restart without a reconnect seen, and no batch of it seen yet
    try:
        for i, action in enumerate(actions + ["live"]):
            if action in ("restart", "quiet restart"):
                r.restart(seed + i + 1, signal=action == "restart")
                quiet = action == "quiet restart"
            elif action == "blip":
                r.sub.reconnected()
                quiet = False
            else:
                unseen = quiet and r.sub.stats.last_seq >= 0 and r.server.seq == r.sub.stats.last_seq + 1
                if unseen and i == len(actions):
                    r.live(1, deliver=False)  # the last batch must come through: one later
                    unseen = False
                deliver = action == "live" and not unseen
                r.live(1, deliver=deliver)
                quiet = quiet and not deliver
        assert r.right, (actions, r.sub.stats)
    finally:
        r.close()
