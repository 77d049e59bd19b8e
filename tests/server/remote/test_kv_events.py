"""KV events without a server: real vLLM 0.32 streams recorded by tools/record_kv_events.py
(tests/server/remote/fixtures/), SGLang's array form built from its struct definitions, the block
tree's counts and walks, the subscriber's ordering rules, and what a visitor may see."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest

from engine.snapshot_view import for_viewer
from server.remote.block_tree import BlockTree, ClearedEvent, RemovedEvent, StoredEvent
from server.remote.block_view import OTHERS, block_snapshot, owners
from server.remote.kv_events import (
    EventSource,
    KVEventSubscriber,
    decode_batch,
    parse_override,
    source_from_config,
)

FIXTURES = Path(__file__).parent / "fixtures"
BS = 32


def recorded(name: str) -> dict:
    return msgspec.msgpack.decode((FIXTURES / f"{name}.msgpack").read_bytes())


def tree_of(data: dict) -> BlockTree:
    tree = BlockTree()
    for _, payload in data["batches"]:
        ts, events = decode_batch(payload)
        tree.apply_all(events, ts)
    tree.check_invariants()
    return tree


def raw_count(data: dict) -> int:
    """Blocks held, counted from the raw msgpack with no code of ours: stored minus removed."""
    held = 0
    for _, payload in data["batches"]:
        for e in msgspec.msgpack.decode(payload)[1]:
            held = 0 if e["type"] == "AllBlocksCleared" else held + len(e["block_hashes"]) * (
                1 if e["type"] == "BlockStored" else -1)
    return held


# ------------------------------------------------------------------ decoding vLLM's real stream
def test_vllm_stream_rebuilds_the_prompts_it_served():
    data = recorded("vllm_basic")
    tree = tree_of(data)
    assert tree.block_size == BS and tree.num_blocks == raw_count(data) == 12
    for ids, salt in zip(data["prompts"], data["salts"], strict=True):
        path = tree.match(ids, salt)
        assert len(path) == len(ids) // BS  # every full block of the prompt is cached
        assert [t for b in path for t in b.token_ids] == ids[:len(path) * BS]  # the chain spells the prompt
        assert path[0].parent is None and all(b.parent == a.hash for a, b in zip(path, path[1:], strict=False))
    salted = tree.match(data["prompts"][3], "fixture-salt")
    assert salted[0].salt == "fixture-salt"  # vLLM publishes the salt among the first block's extra keys
    unsalted = tree.match(data["prompts"][3])  # the same system prompt, unsalted: another chain
    assert unsalted and unsalted[0].hash != salted[0].hash and unsalted[0].salt is None
    assert tree.match(data["prompts"][0], "a salt nobody used") == []
    assert tree.match(data["prompts"][3], "another salt") == []  # vLLM mixes the salt in: no unsalted fallback
    assert tree.counts() == {"GPU": {"held": 12, "stored": 12, "evicted": 0}}


def test_vllm_eviction_stream_counts_per_medium():
    data = recorded("vllm_evict")  # five 1,400-token prompts into 150 blocks
    tree = tree_of(data)
    c = tree.counts()["GPU"]
    # recorded from seq 8 on: the 12 blocks of the earlier recording were stored before it, so their
    # removals name blocks this tree never saw (counted apart, as a late subscriber without replay would)
    assert data["batches"][0][0] == 8 and tree.unknown_removed == 12
    assert c["held"] == raw_count(data) + 12 == c["stored"] - c["evicted"] and c["evicted"] > 0 and c["held"] <= 150
    nodes = tree.draw_nodes()
    assert sum(len(n.blocks) for n in nodes) == len(tree.blocks)
    # vLLM frees a request's blocks tail first: the oldest prompt went whole, the next lost its tail
    assert tree.match(data["prompts"][0]) == [] and 0 < len(tree.match(data["prompts"][1])) < 1400 // BS
    assert not any(n.detached for n in nodes)
    assert tree.match(data["prompts"][-1]) and len(tree.match(data["prompts"][-1])) == 1400 // BS


def test_vllm_clear_event_empties_the_tree():
    data = recorded("vllm_clear")  # POST /reset_prefix_cache, then one more request
    tree = tree_of(data)
    assert tree.cleared == 1 and tree.num_blocks == raw_count(data) == 2


def test_unknown_fields_and_event_types_are_ignored():
    batch = [1.0, [{"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": [1, 2],
                    "block_size": 2, "medium": "CPU", "a_field_from_the_future": {"x": 1}},
                   {"type": "BlockMovedToTheMoon", "block_hashes": [7]}], 0]
    ts, events = decode_batch(msgspec.msgpack.encode(batch))
    assert ts == 1.0 and events == [StoredEvent([7], None, [1, 2], 2, "CPU", None)]
    with pytest.raises(msgspec.DecodeError):
        decode_batch(b"\xc1 not msgpack")


# ------------------------------------------------------------------ SGLang's array form
def sglang_batch(events: list, ts: float = 2.0) -> bytes:
    """As SGLang's publisher encodes its structs (array_like, tag=True: the class name first;
    its batch is [ts, events], no data-parallel rank)."""
    return msgspec.msgpack.encode([ts, events])


def test_sglang_array_form_without_medium():
    tokens = list(range(100, 108))
    payload = sglang_batch([["BlockStored", [11, 12], None, tokens, 4, None],
                            ["BlockStored", [13], 12, [200, 201, 202, 203], 4, None, "CPU"],  # a newer one's medium
                            ["BlockRemoved", [12]], ["AllBlocksCleared"]])
    ts, events = decode_batch(payload)
    assert events[0] == StoredEvent([11, 12], None, tokens, 4, None, None)
    assert events[1].medium == "CPU" and events[2] == RemovedEvent([12], None) and events[3] == ClearedEvent()
    tree = BlockTree()
    tree.apply_all(events[:3], ts)
    assert tree.counts() == {"CPU": {"held": 1, "stored": 1, "evicted": 0}, "GPU": {"held": 1, "stored": 2,
                                                                                     "evicted": 1}}
    assert [b.hash for b in tree.match(tokens + [200, 201, 202, 203], medium="GPU")] == [11]
    assert tree.match(tokens, salt="any") == tree.match(tokens) != []  # no extra keys: salts not in its hashes
    tree.apply(events[3])
    assert tree.num_blocks == 0 and tree.counts()["GPU"]["evicted"] == 2
    tree.check_invariants()


def test_a_block_in_two_media_leaves_when_the_last_copy_goes():
    tree = BlockTree()
    tree.apply(StoredEvent([1, 2], None, [5, 6, 7, 8], 2, "GPU"))
    tree.apply(StoredEvent([1], None, [5, 6], 2, "CPU"))  # offloaded: the same hash in host memory
    tree.apply(RemovedEvent([1], "GPU"))
    assert tree.num_blocks == 2 and [b.hash for b in tree.match([5, 6, 7, 8])] == [1, 2]
    nodes = tree.draw_nodes()  # the CPU copy is a node of its own (another tier), its GPU child after it
    assert [(n.medium, len(n.blocks)) for n in nodes] == [("CPU", 1), ("GPU", 1)]
    tree.apply(RemovedEvent([1], "CPU"))
    assert tree.match([5, 6, 7, 8]) == [] and tree.draw_nodes()[0].detached
    tree.apply(StoredEvent([1], None, [5, 6], 2, "GPU"))  # stored again: its child is found again
    assert len(tree.match([5, 6, 7, 8])) == 2 and not any(n.detached for n in tree.draw_nodes())
    tree.check_invariants()


# ------------------------------------------------------------------ endpoints
def test_endpoint_discovery_and_the_override():
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
              "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}
    assert source_from_config(config, "http://10.0.0.7:8000/v1") == EventSource(
        "tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558", "kv-events", bind=False)
    connect = dict(config, endpoint="tcp://10.0.0.9:5557")  # the server connects: we bind
    assert source_from_config(connect, "http://h:1").bind
    assert source_from_config(dict(config, enable_kv_cache_events=False), "http://h:1") is None
    assert source_from_config(dict(config, publisher="null"), "http://h:1") is None
    assert parse_override("") is True and parse_override("off") is None
    assert parse_override("tcp://h:1,tcp://h:2,topic=t") == EventSource("tcp://h:1", "tcp://h:2", "t")
    with pytest.raises(ValueError):
        parse_override("h:1")


# ------------------------------------------------------------------ ordering: gaps, duplicates, restarts
def test_sequence_rules_without_a_replay_endpoint():
    data = recorded("vllm_basic")
    sub = KVEventSubscriber(EventSource("tcp://127.0.0.1:1"))  # never started: no socket is opened
    try:
        (s0, p0), (s1, p1), (s2, p2), (s3, p3) = [(i, p) for i, (_, p) in enumerate(data["batches"][:4])]
        sub._on_batch(s0, p0, live=True)
        sub._on_batch(s1, p1, live=True)
        sub._on_batch(s1, p1, live=True)  # a duplicate (live and replay overlap): ignored
        assert sub.stats.batches == 2 and sub.stats.last_seq == 1
        sub._on_batch(s3, p3, live=True)  # seq 2 never came and nothing can replay it
        assert sub.stats.gaps == 1 and sub.stats.lost == 1 and sub.stats.last_seq == 3
        # the server restarted: seq 0 again, newer than anything applied -> the tree starts over
        restarted = msgspec.msgpack.encode([time.time() + 10, msgspec.msgpack.decode(p2)[1], 0])
        sub._on_batch(0, restarted, live=True)
        assert sub.stats.restarts == 1 and sub.stats.last_seq == 0
        assert sub.tree.num_blocks == raw_count({"batches": [[0, p2]]})
        sub._on_batch(0, b"garbage", live=True)
        assert sub.stats.decode_errors == 1
    finally:
        sub._ctx.term()


# ------------------------------------------------------------------ what is drawn, and for whom
def test_block_snapshot_owners_and_isolation():
    data = recorded("vllm_basic")
    tree = tree_of(data)
    p = data["prompts"]
    owner, hits = owners(tree, [("alice", p[0], None), ("bob", p[3], "fixture-salt")])
    full = block_snapshot(tree, owner, hits)
    assert full.origin == "events" and full.num_tokens == tree.num_blocks * BS and full.tier_kind == ""
    assert sum(n.num_tokens for n in full.nodes) == tree.num_blocks * BS
    by_ns = {}
    for n in full.nodes:
        by_ns[n.namespace] = by_ns.get(n.namespace, 0) + n.num_tokens
    assert by_ns == {"alice": len(p[0]) // BS * BS, "bob": len(p[3]) // BS * BS,
                     OTHERS: (12 - len(p[0]) // BS - len(p[3]) // BS) * BS}
    alice = for_viewer(full, "alice")
    seen = [n for n in alice.nodes if not n.hidden]
    assert {n.namespace for n in seen} == {"alice"} and sum(n.num_tokens for n in seen) == len(p[0]) // BS * BS
    hidden = [n for n in alice.nodes if n.hidden]
    assert hidden and all(n.token_ids == () and n.text == "" for n in hidden)  # others' blocks: no tokens
    # a stranger sees shape only; nothing of alice's or bob's text
    assert all(n.hidden for n in for_viewer(full, "carol").nodes)
