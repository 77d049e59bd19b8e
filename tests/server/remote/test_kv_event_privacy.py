"""What this engine's KV events say of private blocks (engine/kvcache/kv_events.py): a
subscriber that knows a private block's tokens, its parent's hash and the hash algorithm cannot
reproduce its hash (keyed with the publisher's secret), and no published frame, live or
replayed, holds the namespace's name. Public blocks keep the plain, reproducible hash, so an
independent router matches them; our own subscriber still draws private blocks apart."""

from __future__ import annotations

import hashlib
import struct

import msgspec
import pytest
import zmq

from engine.kvcache.kv_event_format import block_hash
from engine.kvcache.kv_events import KVEventPublisher
from engine.kvcache.radix_tree import RadixTree
from engine.types import PUBLIC, CacheKey
from server.remote.block_tree import BlockTree
from server.remote.block_view import OTHERS, block_snapshot, owners
from server.remote.kv_events import EventSource, KVEventSubscriber
from tests.server.remote.test_kv_event_publisher import BS, Raw, prompts

SECRET_NS = "v-9f3a77c2e1-alice"  # what a visitor's namespace looks like: it must never go out


def unkeyed(parent: int | None, namespaces: tuple[str, ...], tokens: tuple[int, ...]) -> int:
    """The published algorithm without the key: what a guesser computes (the old hash)."""
    h = hashlib.sha256()
    h.update(struct.pack(">q", -1 if parent is None else parent))
    h.update("\x1f".join(namespaces).encode())
    h.update(b"\x00")
    h.update(struct.pack(f">{len(tokens)}I", *tokens))
    return int.from_bytes(h.digest()[:8], "big") >> 1


def replayed(endpoint: str) -> list[list[bytes]]:
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 3000)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    out = []
    try:
        while True:
            frames = dealer.recv_multipart()
            out.append(frames)
            if frames[-2] == (-1).to_bytes(8, "big", signed=True):
                return out
    finally:
        dealer.close(linger=0)
        ctx.term()


def stream(private_tokens: bool) -> tuple[list[int], list[list[bytes]], KVEventPublisher]:
    pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "ours", block_size=BS,
                           private_tokens=private_tokens)
    tree = RadixTree()
    tree.listener = pub
    raw = Raw(pub.endpoint)
    ids = prompts(1, seed=5)[0] + list(range(1000, 1100))
    tree.insert(CacheKey(tuple(ids), SECRET_NS, 64), [None] * len(ids))  # 64 shipped (public) tokens, then hers
    tree.insert(CacheKey(tuple(ids[:64] + [7] * 64), f"{SECRET_NS}/lab-1", 64), [None] * 128)  # a sub-namespace
    tree.evict(len(ids))
    pub.flush()
    raw.close()
    return ids, raw.frames + replayed(pub.replay_endpoint), pub


@pytest.mark.parametrize("private_tokens", [True, False])
def test_no_frame_names_the_namespace_and_no_guess_reproduces_a_private_hash(private_tokens):
    ids, frames, pub = stream(private_tokens)
    try:
        assert len(frames) > 3
        for f in frames:
            for part in f:
                assert SECRET_NS.encode() not in part and b"alice" not in part
        events = [e for f in frames if len(f[-1]) for e in msgspec.msgpack.decode(f[-1])[1]]
        stored = [e for e in events if e["type"] == "BlockStored"]
        public = [e for e in stored if e.get("extra_keys") is None]
        private = [e for e in stored if e.get("extra_keys") is not None]
        assert public and private
        # public blocks: anyone reproduces the hash from the tokens (a router matching shared prefixes)
        parent = None
        for i, h in enumerate(public[0]["block_hashes"]):
            assert h == unkeyed(parent, (), tuple(ids[i * BS:(i + 1) * BS])) == block_hash(
                parent, (), tuple(ids[i * BS:(i + 1) * BS]))
            parent = h
        # private blocks: the guesser knows the tokens, the parent hash and the namespace itself
        first = next(e for e in private if e["parent_block_hash"] == public[0]["block_hashes"][-1])
        tokens = tuple(ids[64:64 + BS])
        guesses = {unkeyed(first["parent_block_hash"], ns, tokens)
                   for ns in [(), (SECRET_NS,), (PUBLIC,), (PUBLIC, SECRET_NS), ("v-bob",)]}
        guesses |= {block_hash(first["parent_block_hash"], (SECRET_NS,), tokens, key)
                    for key in (b"\x00" * 32, b"kv-events", SECRET_NS.encode())}
        assert first["block_hashes"][0] not in guesses
        tags = {k[0] for e in private for k in e["extra_keys"]}
        assert all(t.startswith("ns-") and len(t) == 27 for t in tags) and len(tags) == 2  # hers, her lab's
        if not private_tokens:
            assert all(e["token_ids"] == [] for e in private)
    finally:
        pub.close()


def test_another_process_hashes_public_blocks_alike_and_private_ones_apart():
    def hashes() -> tuple[list[int], list[int]]:
        _, frames, pub = stream(True)
        pub.close()
        stored = [e for f in frames if len(f[-1]) for e in msgspec.msgpack.decode(f[-1])[1]
                  if e["type"] == "BlockStored"]
        return ([h for e in stored if e.get("extra_keys") is None for h in e["block_hashes"]],
                [h for e in stored if e.get("extra_keys") is not None for h in e["block_hashes"]])

    (pub1, priv1), (pub2, priv2) = hashes(), hashes()
    assert pub1 == pub2 and priv1 and not set(priv1) & set(priv2)


def test_our_subscriber_draws_private_blocks_as_others():
    """Remote mode in front of this engine: the private blocks come tagged (a salt nobody here
    knows), so an unsalted walk stops where the public blocks end and they are drawn as others'."""
    pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "ours", block_size=BS, private_tokens=False)
    tree = RadixTree()
    tree.listener = pub
    sub = KVEventSubscriber(EventSource(pub.endpoint, pub.replay_endpoint, "ours"), BlockTree()).start()
    try:
        ids = prompts(1, seed=6)[0] + list(range(2000, 2100))
        tree.insert(CacheKey(tuple(ids), SECRET_NS, 64), [None] * len(ids))
        tree.insert(CacheKey(tuple(ids[:64]), PUBLIC, 0), [None] * 64)
        pub.flush()
        assert sub.wait_for(lambda: sub.tree.num_blocks == pub.num_published > 2)
        assert len(sub.tree.match(ids)) == 2  # the 64 public tokens only
        owner, hits = owners(sub.tree, [(PUBLIC, ids, None)])
        snap = block_snapshot(sub.tree, owner, hits)
        assert {n.namespace for n in snap.nodes} == {PUBLIC, OTHERS}
        assert all(n.token_ids == () for n in snap.nodes if n.namespace == OTHERS)  # no tokens were sent
        sub.tree.check_invariants()
    finally:
        sub.close()
        pub.close()
