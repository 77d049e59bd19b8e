"""A replica's state on the Fleet tab (issue 45, item 6): what its tree here is worth."""

from __future__ import annotations

from components.views.fleet_tables import replica_title, replicas_table
from engine.types import FleetView, ReplicaView, TreeSnapshot
from server.remote.fleet import DOWN, LIVE, NONE, STALE, STALE_S, STALE_TOKENS, STOPPED, replica_state


def test_each_state_from_what_is_known():
    assert replica_state(False, False, True, None, 0.0) == NONE
    assert replica_state(True, True, False, 500, 60.0) == DOWN  # down wins: its health does not answer
    assert replica_state(True, False, True, None, 0.0) == STOPPED
    assert replica_state(True, True, True, STALE_TOKENS, STALE_S) == STALE
    assert replica_state(True, True, True, STALE_TOKENS - 1, 600.0) == LIVE  # under two blocks: no event was due
    assert replica_state(True, True, True, 10_000, STALE_S - 0.1) == LIVE  # events may still be on their way
    assert replica_state(True, True, True, None, 600.0) == LIVE  # its /metrics do not say: nothing to hold against


def test_the_page_says_down_and_stale_and_shows_the_last_known_tree_as_such():
    snap = TreeSnapshot((), 0, 0, 0, 0, 0, 0)
    live = ReplicaView("http://127.0.0.1:8001", snap, 32, 2, 64, True, 1, 0.5, 0.0)
    down = ReplicaView("http://127.0.0.1:8002", snap, 32, 3, 96, True, 1, None, None, state=DOWN, since=1.7e9)
    stale = ReplicaView("http://127.0.0.1:8003", snap, 32, 1, 32, True, 0, 0.2, 1.0, state=STALE, since=1.7e9)
    assert "64 tokens in 2 blocks" in replica_title(0, live)
    assert "**down** since" in replica_title(1, down) and "96 tokens" in replica_title(1, down)
    assert "unknown, not empty" in replica_title(2, stale)
    table = replicas_table(FleetView((live, down, stale), (), 0, 0, 0, 0, None, None))
    rows = table.splitlines()[2:]
    assert "| live |" in rows[0] and "| 64 |" in rows[0]
    assert "| down since" in rows[1] and "(96, last known)" in rows[1]
    assert "| events stopped since" in rows[2] and "(32, last known)" in rows[2]
