"""This engine's own KV events (engine/kvcache/kv_events.py): a radix tree with the publisher as
its listener, followed over real ZMQ sockets by our subscriber and by a raw one, and decoded by
vLLM's own ``vllm.distributed.kv_events.KVEventBatch`` in vLLM's venv (``vllm`` marker)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import threading
import time

import msgspec
import pytest
import zmq

from engine.kvcache.kv_event_format import block_hash
from engine.kvcache.kv_events import KVEventPublisher
from engine.kvcache.radix_tree import RadixTree
from engine.types import PUBLIC, CacheKey
from server.remote.block_tree import BlockTree
from server.remote.kv_events import EventSource, KVEventSubscriber

BS = 32


def prompts(n: int = 4, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(300, 40000) for _ in range(70)]
    return [system + [rng.randrange(300, 40000) for _ in range(rng.randrange(10, 80))] for _ in range(n)]


def published_tree(private_tokens: bool = True):
    pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "ours", block_size=BS,
                           private_tokens=private_tokens)
    tree = RadixTree()
    tree.listener = pub
    return pub, tree


class Raw:
    """A plain SUB socket that keeps every message's frames (no code of ours decodes them)."""

    def __init__(self, endpoint: str, topic: bytes = b"ours") -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.frames: list[list[bytes]] = []
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.loop, daemon=True)
        self.t.start()
        time.sleep(0.3)

    def loop(self) -> None:
        while not self.stop.is_set():
            if self.sub.poll(50):
                self.frames.append(self.sub.recv_multipart())

    def close(self) -> None:
        self.stop.set()
        self.t.join()
        self.sub.close(linger=0)
        self.ctx.term()


def test_hashes_are_stable_and_namespaced():
    ids = tuple(range(BS))
    assert block_hash(None, (), ids) == 5381774573828011315  # the same in every process, every run
    key = b"k" * 32
    assert block_hash(None, (), ids) != block_hash(None, ("v-alice",), ids, key) != block_hash(7, (), ids)
    assert block_hash(None, ("v-alice",), ids, key) != block_hash(None, ("v-alice",), ids, b"j" * 32)
    assert 0 <= block_hash(None, (), ids) < 2**63
    with pytest.raises(ValueError):  # a private block's hash is never the guessable one
        block_hash(None, ("v-alice",), ids)


def test_our_subscriber_follows_our_publisher():
    pub, tree = published_tree()
    sub = KVEventSubscriber(EventSource(pub.endpoint, pub.replay_endpoint, "ours"), BlockTree()).start()
    try:
        ps = prompts()
        for p in ps:
            tree.insert(CacheKey(tuple(p), PUBLIC, 0), [None] * len(p))
        pub.flush()
        assert sub.wait_for(lambda: sub.tree.num_blocks == pub.num_published)
        for p in ps:
            assert [t for b in sub.tree.match(p) for t in b.token_ids] == p[:len(p) // BS * BS]
        tree.evict(60)  # least recently used leaves: each takes the blocks its tokens were part of
        pub.flush()
        assert sub.wait_for(lambda: sub.tree.num_blocks == pub.num_published)
        assert sub.tree.counts()["GPU"]["evicted"] > 0
        late = KVEventSubscriber(EventSource(pub.endpoint, pub.replay_endpoint, "ours"), BlockTree()).start()
        assert late.wait_for(lambda: late.tree.num_blocks == pub.num_published) and late.stats.replayed > 0
        late.close()
        tree.clear()
        pub.flush()
        assert sub.wait_for(lambda: sub.tree.num_blocks == 0 == pub.num_published)
    finally:
        sub.close()
        pub.close()


def test_private_blocks_carry_no_tokens_under_isolation():
    pub, tree = published_tree(private_tokens=False)
    raw = Raw(pub.endpoint)
    try:
        p = prompts(1)[0]
        tree.insert(CacheKey(tuple(p), "v-alice", 64), [None] * len(p))  # 64 shipped tokens, then hers
        pub.flush()
        time.sleep(0.2)
        events = [e for f in raw.frames for e in msgspec.msgpack.decode(f[2])[1]]
        stored = [e for e in events if e["type"] == "BlockStored"]
        assert [len(e["block_hashes"]) for e in stored] == [2, len(p) // BS - 2]
        assert len(stored[0]["token_ids"]) == 2 * BS and stored[0]["extra_keys"] is None  # shipped: public
        assert stored[1]["token_ids"] == []
        tags = {tuple(k) for k in stored[1]["extra_keys"]}  # one opaque tag for her blocks, not her name
        assert len(tags) == 1 and next(iter(tags))[0].startswith("ns-") and "alice" not in next(iter(tags))[0]
    finally:
        raw.close()
        pub.close()


VLLM_DECODE = """
import json, sys, msgspec
from vllm.distributed.kv_events import KVEventBatch
dec = msgspec.msgpack.Decoder(type=KVEventBatch)
out = []
for payload in msgspec.msgpack.decode(open(sys.argv[1], "rb").read()):
    b = dec.decode(payload)
    out.append([[type(e).__name__, list(getattr(e, "block_hashes", [])), getattr(e, "parent_block_hash", None),
                 list(getattr(e, "token_ids", [])), getattr(e, "block_size", 0), getattr(e, "medium", None)]
                for e in b.events])
print(json.dumps(out))
"""


def vllm_decode(frames: list[list[bytes]], tmp_path) -> list[list[list]]:
    """Our payloads decoded by vLLM's own ``KVEventBatch`` in vLLM's venv: per batch, per event,
    ``[type, hashes, parent, tokens, block_size, medium]``. Skips without vLLM (fails with
    ``RADIX_REQUIRE_VLLM=1``)."""
    from tools.vllm_server import venv_path, vllm_available

    venv = venv_path()
    if not vllm_available(venv):
        if os.environ.get("RADIX_REQUIRE_VLLM") == "1":
            pytest.fail(f"vLLM is required (RADIX_REQUIRE_VLLM=1) but {venv} has none")
        pytest.skip(f"no vLLM in {venv}")
    stream = tmp_path / "stream.msgpack"
    stream.write_bytes(msgspec.msgpack.encode([f[2] for f in frames]))
    done = subprocess.run([str(venv / "bin" / "python"), "-c", VLLM_DECODE, str(stream)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.vllm
def test_vllms_own_decoder_reads_our_stream_and_its_chains_rebuild_the_prompts(tmp_path):
    pub, tree = published_tree()
    raw = Raw(pub.endpoint)
    try:
        ps = prompts(5, seed=1)
        for p in ps:
            tree.insert(CacheKey(tuple(p), PUBLIC, 0), [None] * len(p))
        tree.evict(40)
        pub.flush()
        time.sleep(0.2)
    finally:
        raw.close()
        pub.close()
    batches = vllm_decode(raw.frames, tmp_path)
    blocks: dict[int, tuple[int | None, list[int]]] = {}
    for batch in batches:
        for kind, hashes, parent, tokens, size, medium in batch:
            assert medium == "GPU"
            if kind == "BlockStored":
                assert size == BS and len(tokens) == len(hashes) * BS
                for i, h in enumerate(hashes):
                    blocks[h] = (parent, tokens[i * BS:(i + 1) * BS])
                    parent = h
            else:
                for h in hashes:
                    del blocks[h]
    # every prompt the tree still holds is spelled by a chain of blocks from a first block
    children = {}
    for h, (parent, tokens) in blocks.items():
        children[(parent, tuple(tokens))] = h
    for p in ps:
        held = tree.match(CacheKey(tuple(p), PUBLIC, 0), touch=False).length
        parent, n = None, 0
        while (parent, tuple(p[n:n + BS])) in children and n + BS <= len(p):
            parent, n = children[(parent, tuple(p[n:n + BS]))], n + BS
        assert n == held // BS * BS


def test_the_app_flag_publishes_the_engines_own_cache(tiny_runner):
    import app
    from engine.types import GenerationRequest, SamplingParams
    from tests.helpers_app import free_port

    port, replay = free_port(), free_port()
    config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
                         "replay_endpoint": f"tcp://*:{replay}", "topic": "kv-events"})
    args = app.parse_args(["--kv-events-config", config, "--max-new-tokens", "4"])
    engine = app.build_engine(args, runner=tiny_runner)
    pub = engine.cache.tree.listener
    sub = KVEventSubscriber(EventSource(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}", "kv-events"),
                            BlockTree()).start()
    try:
        ids = prompts(1, seed=2)[0]
        m = engine.run(GenerationRequest(prompt_ids=tuple(ids), sampling=SamplingParams(max_new_tokens=4)))
        pub.flush()
        assert sub.wait_for(lambda: sub.tree.num_blocks == pub.num_published > 0)
        cached = ids + list(m.output_ids)
        assert len(sub.tree.match(cached)) == engine.cache.match_len(
            engine.cache_key(cached, GenerationRequest(prompt_ids=tuple(ids)))) // BS
        engine.clear_cache()  # the whole cache, as vLLM's reset: one AllBlocksCleared, not a removal per block
        pub.flush()
        assert sub.wait_for(lambda: sub.tree.cleared == 1 and sub.tree.num_blocks == 0 == pub.num_published)
    finally:
        sub.close()
        engine.close()
        pub.close()


def test_a_restarted_publisher_is_found_over_real_sockets():
    """A new publisher process on the same ports (here: a new publisher in this one) whose seq goes
    on right after ours: no gap and no seq going back, only ZMQ's reconnect tells; the tree is
    rebuilt from the new one's replay buffer, with nothing of the old one's left."""
    from tests.helpers_app import free_port

    port, replay = free_port(), free_port()

    def publisher() -> tuple[KVEventPublisher, RadixTree]:
        pub = KVEventPublisher(f"tcp://*:{port}", f"tcp://*:{replay}", "ours", block_size=BS)
        tree = RadixTree()
        tree.listener = pub
        return pub, tree

    pub, tree = publisher()
    sub = KVEventSubscriber(EventSource(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}", "ours"),
                            BlockTree()).start()
    try:
        old = prompts(3, seed=3)
        for p in old:  # seqs 0..2
            tree.insert(CacheKey(tuple(p), PUBLIC, 0), [None] * len(p))
        pub.flush()
        assert sub.wait_for(lambda: sub.stats.last_seq == 2)
        pub.close()
        pub, tree = publisher()
        new = [prompts(1, seed=10 + i)[0] for i in range(4)]  # no shared prefix: one batch each
        for p in new:  # its seqs 0..3: at least seq 3 is "next" after our 2
            tree.insert(CacheKey(tuple(p), PUBLIC, 0), [None] * len(p))
        pub.flush()
        ok = sub.wait_for(lambda: sub.stats.restarts >= 1 and sub.stats.last_seq == 3
                          and sub.tree.num_blocks == pub.num_published)
        assert ok, (sub.stats, sub.tree.num_blocks, pub.num_published)
        assert all(sub.tree.match(p) == [] for p in old) and all(sub.tree.match(p) for p in new)
    finally:
        sub.close()
        pub.close()


def test_a_dashboard_finds_this_apps_own_stream_by_asking_it(tiny_runner):
    """``GET /kv_event_sources`` on this app serves its publisher's config as vLLM does
    (``{"0": {...}}``), so a dashboard in front of this app discovers the stream with no flag;
    without ``--kv-events-config`` the route answers a clear 404."""
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    import app
    from server.remote.kv_wire import discover
    from tests.helpers_app import free_port

    port, replay = free_port(), free_port()
    config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
                         "replay_endpoint": f"tcp://*:{replay}", "topic": "kv-events"})
    engine = app.build_engine(app.parse_args(["--kv-events-config", config, "--max-new-tokens", "4"]),
                              runner=tiny_runner)
    plain = app.build_engine(app.parse_args(["--max-new-tokens", "4"]), runner=tiny_runner)
    try:
        client = TestClient(FastAPI(routes=app.server_routes(engine)))
        body = client.get("/kv_event_sources").json()
        assert body["0"]["endpoint"] == f"tcp://*:{port}" and body["0"]["topic"] == "kv-events"
        source = discover(lambda path: client.get(path).json(), "http://127.0.0.1:7860")
        assert source.endpoint == f"tcp://127.0.0.1:{port}" and source.replay_endpoint == f"tcp://127.0.0.1:{replay}"
        sub = KVEventSubscriber(source, BlockTree()).start()
        try:
            from engine.types import GenerationRequest, SamplingParams
            engine.run(GenerationRequest(prompt_ids=tuple(prompts(1, seed=3)[0]),
                                         sampling=SamplingParams(max_new_tokens=4)))
            pub = engine.cache.tree.listener
            pub.flush()
            assert sub.wait_for(lambda: sub.tree.num_blocks == pub.num_published > 0)
        finally:
            sub.close()
        missing = TestClient(FastAPI(routes=app.server_routes(plain))).get("/kv_event_sources")
        assert missing.status_code == 404 and "--kv-events-config" in missing.json()["error"]["message"]
    finally:
        engine.close()
        plain.close()


# ------------------------------------------------------------------ where it listens, and its bounds
def test_the_default_endpoint_binds_loopback_and_a_star_warns(monkeypatch, caplog):
    from engine.kvcache import kv_events
    from server.remote.kv_wire import source_from_config
    from tests.helpers_app import free_port

    monkeypatch.setattr(kv_events, "DEFAULT_ENDPOINT", f"tcp://127.0.0.1:{free_port()}")
    pub = KVEventPublisher.from_config({"enable_kv_cache_events": True, "topic": "ours", "block_size": BS})
    try:
        assert pub.endpoint == kv_events.DEFAULT_ENDPOINT and pub.binds  # loopback only, not every interface
        assert pub.config["endpoint"] == pub.endpoint and pub.config["publisher_binds"] is True
        source = source_from_config(pub.config, "http://127.0.0.1:7860")
        assert source.endpoint == pub.endpoint and not source.bind  # the served config says: connect to it
        sub = KVEventSubscriber(source, BlockTree()).start()
        try:
            tree = RadixTree()
            tree.listener = pub
            p = prompts(1)[0]
            tree.insert(CacheKey(tuple(p), PUBLIC, 0), [None] * len(p))
            pub.flush()
            assert sub.wait_for(lambda: sub.tree.num_blocks == pub.num_published > 0)
        finally:
            sub.close()
    finally:
        pub.close()
    port = free_port()
    with caplog.at_level("WARNING", logger="engine.kvcache.kv_events"):
        star = KVEventPublisher.from_config({"endpoint": f"tcp://*:{port}", "topic": "ours"})
    try:
        assert star.config["endpoint"] == f"tcp://*:{port}" and "publisher_binds" not in star.config
        assert source_from_config(star.config, "http://10.1.2.3:7860").endpoint == f"tcp://10.1.2.3:{port}"
        assert any("every interface" in r.getMessage() for r in caplog.records)
    finally:
        star.close()


def test_publisher_binds_binds_a_plain_loopback_host_for_a_router_to_connect():
    """A fleet's replica (``tools.fleet``): vLLM's router connects to each replica's endpoint, so
    ``"publisher_binds": true`` binds the plain host given (loopback), where vLLM's rule connects."""
    from server.remote.kv_wire import source_from_config
    from tests.helpers_app import free_port

    port, replay = free_port(), free_port()
    pub = KVEventPublisher.from_config({"endpoint": f"tcp://127.0.0.1:{port}", "replay_endpoint":
                                        f"tcp://127.0.0.1:{replay}", "topic": "kv-events", "publisher_binds": True,
                                        "block_size": BS})
    try:
        assert pub.binds and pub.endpoint == f"tcp://127.0.0.1:{port}" and pub.config["publisher_binds"] is True
        source = source_from_config(pub.config, "http://127.0.0.1:7860")
        assert source.endpoint == pub.endpoint and not source.bind  # a subscriber connects, as the router does
        sub = KVEventSubscriber(source, BlockTree()).start()
        try:
            tree = RadixTree()
            tree.listener = pub
            p = prompts(1)[0]
            tree.insert(CacheKey(tuple(p), PUBLIC, 0), [None] * len(p))
            pub.flush()
            assert sub.wait_for(lambda: sub.tree.num_blocks == pub.num_published > 0)
        finally:
            sub.close()
    finally:
        pub.close()


def test_a_stalled_sending_thread_never_blocks_the_cache_and_drops_are_counted():
    pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "ours", block_size=BS, max_queue=2)
    sub = KVEventSubscriber(EventSource(pub.endpoint, pub.replay_endpoint, "ours"), BlockTree()).start()
    gate = threading.Event()
    real = pub._send

    def stalled(seq: int, payload: bytes) -> None:
        gate.wait(10)
        real(seq, payload)

    pub._send = stalled
    tree = RadixTree()
    tree.listener = pub
    try:
        t0 = time.monotonic()
        for i in range(20):  # no shared prefix: one batch each
            p = prompts(1, seed=100 + i)[0]
            tree.insert(CacheKey(tuple(p), PUBLIC, 0), [None] * len(p))
        assert time.monotonic() - t0 < 1.0  # the cache's thread did not wait
        assert pub.dropped_batches >= 15 and pub._queue.qsize() <= 2
        pub._send = real
        gate.set()
        pub.flush()
        dropped = pub.dropped_batches
        p = prompts(1, seed=999)[0]  # one more batch after the drops: the subscriber sees the seqs they took
        tree.insert(CacheKey(tuple(p), PUBLIC, 0), [None] * len(p))
        pub.flush()
        assert sub.wait_for(lambda: sub.stats.last_seq == 20), sub.stats
        assert pub.dropped_batches == dropped and sub.stats.lost == dropped and sub.alive
    finally:
        gate.set()
        sub.close()
        pub.close()


def test_replay_requests_are_rate_limited_and_a_client_that_never_reads_is_dropped(monkeypatch):
    from engine.kvcache import kv_event_stream

    monkeypatch.setattr(kv_event_stream, "REPLAY_SESSION_S", 0.5)
    pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "ours", block_size=BS)
    tree = RadixTree()
    tree.listener = pub
    ctx = zmq.Context()
    try:
        for i in range(30):
            p = prompts(1, seed=200 + i)[0]
            tree.insert(CacheKey(tuple(p), PUBLIC, 0), [None] * len(p))
        pub.flush()
        spam = ctx.socket(zmq.DEALER)
        spam.setsockopt(zmq.LINGER, 0)
        spam.connect(pub.replay_endpoint)
        for _ in range(200):  # one client asking again and again, never reading
            spam.send_multipart([b"", (0).to_bytes(8, "big")])
        silent = [ctx.socket(zmq.DEALER) for _ in range(8)]  # clients that ask once and never read
        for s in silent:
            s.setsockopt(zmq.LINGER, 0)
            s.connect(pub.replay_endpoint)
            s.send_multipart([b"", (0).to_bytes(8, "big")])
        time.sleep(0.5)
        assert pub.replay_refused > 150 and len(pub._answers) <= kv_event_stream.REPLAY_SESSIONS
        ends = 0
        while spam.poll(100):
            ends += spam.recv_multipart()[-2] == (-1).to_bytes(8, "big", signed=True)
        assert ends <= kv_event_stream.REPLAY_BURST + 5  # answers, not 200 copies of the buffer
        for s in silent:
            s.close(linger=0)
        spam.close(linger=0)
        time.sleep(1.5)  # the sessions time out (or their clients are gone), and the bucket refills
        assert not pub._answers
        late = KVEventSubscriber(EventSource(pub.endpoint, pub.replay_endpoint, "ours"), BlockTree()).start()
        try:  # an honest subscriber still gets the whole history
            assert late.wait_for(lambda: late.tree.num_blocks == pub.num_published > 0)
            assert late.stats.replayed == 30
        finally:
            late.close()
    finally:
        ctx.destroy(linger=0)
        pub.close()


def test_a_replay_client_that_never_reads_holds_a_bounded_answer_and_is_dropped(monkeypatch):
    """What waits for a client is bounded by the ROUTER's SNDHWM (the answer goes out a few
    messages at a time as its pipe takes them), and a client that does not take it in time is dropped."""
    import random as _random

    from engine.kvcache import kv_event_stream

    monkeypatch.setattr(kv_event_stream, "REPLAY_SESSION_S", 1.0)
    monkeypatch.setattr(kv_event_stream, "REPLAY_HWM", 4)
    pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "ours", block_size=BS)
    tree = RadixTree()
    tree.listener = pub
    ctx = zmq.Context()
    try:
        rng = _random.Random(7)
        for _ in range(40):  # about 160 KB a batch, 6.4 MB in all: more than the kernel's socket buffers take
            p = [rng.randrange(70_000, 2**31) for _ in range(32_000)]
            tree.insert(CacheKey(tuple(p), PUBLIC, 0), [None] * len(p))
        pub.flush()
        silent = ctx.socket(zmq.DEALER)
        silent.setsockopt(zmq.LINGER, 0)
        silent.setsockopt(zmq.RCVHWM, 1)
        silent.setsockopt(zmq.RCVBUF, 1024)
        silent.connect(pub.replay_endpoint)
        silent.send_multipart([b"", (0).to_bytes(8, "big")])
        time.sleep(0.4)
        answers = list(pub._answers.values())
        assert len(answers) == 1 and answers[0].pos < len(answers[0].items) == 40  # held back, not all queued
        time.sleep(1.2)
        assert not pub._answers and pub.replay_abandoned == 1 and pub.replay_served == 0
    finally:
        ctx.destroy(linger=0)
        pub.close()
