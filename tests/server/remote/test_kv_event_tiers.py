"""The second tier in this engine's own KV events: a real engine (tiny Llama) with a disk tier
publishes, a dashboard (a ``RemoteEngine`` in front of it, as in front of another instance of
this app) follows over real ZMQ sockets. What the dashboard holds per medium is checked against
the store itself (its chunk keys, recomputed from the token paths), not the publisher's books:
spilled blocks under "STORAGE", loaded back under "GPU" too, dropped ones gone, a clear that
keeps the tier, a restart that finds the tier again; host memory as "CPU". With the ``vllm``
marker, vLLM's own ``KVEventBatch`` decodes that stream."""

from __future__ import annotations

import json
import random

import pytest

from components.panels.memory_panel import memory_markdown
from engine.engine import Engine
from engine.kvcache.kv_event_format import MEDIUM_STORAGE, block_hash
from engine.kvcache.kv_tier import CHUNK_TOKENS
from engine.types import PUBLIC, CacheKey, GenerationRequest, SamplingParams
from server.remote.engine import RemoteEngine
from tests.helpers_app import free_port
from tests.server.remote.test_kv_event_publisher import Raw, vllm_decode

BS = 32
C = CHUNK_TOKENS


def ids_of(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, vocab - 1) for _ in range(n)]


def events_engine(make_engine, runner, tmp_path, budget_tokens: int = 300, **kw) -> tuple[Engine, int, int]:
    port, replay = free_port(), free_port()
    config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
                         "replay_endpoint": f"tcp://*:{replay}", "topic": "kv-events"})
    engine = make_engine(runner, budget_bytes=budget_tokens * runner.kv_bytes_per_token, tier_bytes=64 * 2**20,
                         tier_dir=str(tmp_path), kv_events_config=config, **kw)
    return engine, port, replay


def dashboard(tokenizer, port: int, replay: int) -> RemoteEngine:
    remote = RemoteEngine("http://127.0.0.1:9", "tiny", tokenizer)
    assert remote.follow_kv_events(f"tcp://127.0.0.1:{port},tcp://127.0.0.1:{replay},topic=kv-events")
    return remote


def run(engine: Engine, ids: list[int], n: int = 1) -> list[int]:
    m = engine.run(GenerationRequest(prompt_ids=tuple(ids), sampling=SamplingParams(max_new_tokens=n)))
    return ids + list(m.output_ids)


def chain(ids: list[int]) -> list[int]:
    """The block hashes of a public token path (the documented hash, computed here)."""
    out, parent = [], None
    for i in range(len(ids) // BS):
        parent = block_hash(parent, (), tuple(ids[i * BS:(i + 1) * BS]))
        out.append(parent)
    return out


def in_store(engine: Engine, paths: list[list[int]]) -> set[int]:
    """Blocks the store holds, from the store: a block is there when its chunk's key is."""
    tier = engine.cache.tier
    out = set()
    for ids in paths:
        hashes = chain(ids)
        for stop in range(C, len(ids) + 1, C):
            if tier.key_of(CacheKey(tuple(ids), PUBLIC, len(ids)), stop) in tier.store:
                out.update(hashes[(stop - C) // BS:stop // BS])
    return out


def in_pool(engine: Engine, paths: list[list[int]]) -> set[int]:
    out = set()
    for ids in paths:
        n = engine.cache.match_len(CacheKey(tuple(ids), PUBLIC, len(ids)))
        out.update(chain(ids)[:n // BS])
    return out


def held(remote: RemoteEngine, medium: str) -> set[int]:
    with remote.blocks.lock:
        return {h for h, b in remote.blocks.blocks.items() if b.media.get(medium)}


def follows(remote: RemoteEngine, engine: Engine) -> bool:
    engine.kv_events.flush()
    pub = engine.kv_events
    return remote.events.wait_for(lambda: {(h, m) for h in remote.blocks.blocks for m in remote.blocks.blocks[h].media}
                                  == {(h, m) for h, media in pub.published.items() for m in media})


def test_the_disk_tier_is_its_own_medium_on_a_dashboard_in_front_of_this_engine(tiny_runner, tmp_path, make_engine):
    vocab = len(tiny_runner.text.tokenizer)
    engine, port, replay = events_engine(make_engine, tiny_runner, tmp_path)
    remote = dashboard(tiny_runner.text.tokenizer, port, replay)
    try:
        doc = ids_of(1, 3 * C + 10, vocab)
        paths = [run(engine, doc)]
        paths += [run(engine, ids_of(10 + i, 200, vocab)) for i in range(3)]  # push the document out
        assert follows(remote, engine)
        storage = held(remote, MEDIUM_STORAGE)
        assert storage == in_store(engine, paths) and set(chain(doc)[:6]) <= storage
        assert held(remote, "GPU") == in_pool(engine, paths)
        assert len(remote.blocks.match(doc, medium=MEDIUM_STORAGE)) == 6  # its chain, in the tier, spells it
        # the dashboard's two tabs: blocks per medium in Cache memory, the tier drawn apart in the tree
        table = memory_markdown(remote)
        assert f"blocks in {MEDIUM_STORAGE} | **{len(storage)}** held now" in table and "blocks in GPU" in table
        snap = remote.snapshot()
        assert snap.origin == "events" and MEDIUM_STORAGE in snap.tier_kind
        assert sum(n.num_tokens for n in snap.nodes if n.spilled) > 0

        paths.append(run(engine, doc + ids_of(2, 5, vocab)))  # loads the document back from the tier
        assert follows(remote, engine)
        both = [remote.blocks.blocks[h].media for h in chain(doc)[:6]]
        assert all(m.get("GPU") == 1 and m.get(MEDIUM_STORAGE) == 1 for m in both)  # the tier keeps its copy

        engine.cache.tier.store.budget_bytes = 2 * engine.cache.tier.store.geometry.nbytes  # room for 2 chunks
        paths += [run(engine, ids_of(20 + i, 250, vocab)) for i in range(3)]  # spills drop older chunks
        assert follows(remote, engine)
        assert held(remote, MEDIUM_STORAGE) == in_store(engine, paths) and len(in_store(engine, paths)) <= 4
        assert remote.blocks.counts()[MEDIUM_STORAGE]["evicted"] > 0

        engine.clear_cache()  # the pool only: AllBlocksCleared, then the tier's blocks again
        assert follows(remote, engine)
        assert remote.blocks.cleared == 1 and held(remote, "GPU") == set()
        assert held(remote, MEDIUM_STORAGE) == in_store(engine, paths) != set()
        remote.blocks.check_invariants()
        engine.cache.tier.store.budget_bytes = 2**24
        paths.append(run(engine, doc))
        engine.persist_cache()  # the document's chunks and its path, for the next start
    finally:
        remote.close()
        engine.close()

    again, port, replay = events_engine(make_engine, tiny_runner, tmp_path)  # a restart finds the tier's chunks again
    late = dashboard(tiny_runner.text.tokenizer, port, replay)
    try:
        assert follows(late, again)
        # what the saved paths reach is published at once (chunks no saved path reaches have no known tokens)
        assert set(chain(doc)[:6]) <= held(late, MEDIUM_STORAGE) <= in_store(again, paths)
        assert held(late, "GPU") == set()
    finally:
        late.close()
        again.close()


def test_a_host_memory_tier_is_published_as_cpu(tiny_runner, monkeypatch, make_engine):
    import engine.engine as engine_module
    from engine.kvcache import kv_tier

    geometry = kv_tier.ChunkGeometry(tiny_runner.num_layers, tiny_runner.num_kv_heads, tiny_runner.head_dim,
                                     tiny_runner.dtype)
    monkeypatch.setattr(engine_module, "make_tier", lambda *a, **k: kv_tier.HostStore(2**24, geometry))
    port = free_port()
    engine = make_engine(budget_bytes=300 * tiny_runner.kv_bytes_per_token, tier_bytes=2**24,
                         kv_events_config=json.dumps({"endpoint": f"tcp://*:{port}"}))
    vocab = len(tiny_runner.text.tokenizer)
    for i in range(4):
        run(engine, ids_of(30 + i, 200, vocab))
    assert engine.kv_events.held("CPU") > 0 and engine.kv_events.held(MEDIUM_STORAGE) == 0


@pytest.mark.vllm
def test_vllms_own_decoder_reads_the_tier_media_and_rebuilds_the_served_prompts(tiny_runner, tmp_path,
                                                                                 make_engine):
    vocab = len(tiny_runner.text.tokenizer)
    engine, port, _ = events_engine(make_engine, tiny_runner, tmp_path / "tier")
    raw = Raw(f"tcp://127.0.0.1:{port}", b"kv-events")
    try:
        doc = ids_of(1, 3 * C + 10, vocab)
        served = [run(engine, doc)] + [run(engine, ids_of(10 + i, 200, vocab)) for i in range(3)]
        served.append(run(engine, doc + [400]))  # loads the document back from the tier
        engine.kv_events.flush()
        expected = {(h, m) for h, media in engine.kv_events.published.items() for m in media}
        cached = [engine.cache.match_len(CacheKey(tuple(ids), PUBLIC, len(ids))) // BS * BS for ids in served]
        spilled = []  # how far from the root the store holds each served path, chunk after chunk
        for ids in served:
            stop = 0
            while stop + C <= len(ids) and engine.cache.tier.key_of(CacheKey(tuple(ids)), stop + C) in \
                    engine.cache.tier.store:
                stop += C
            spilled.append(stop)
    finally:
        raw.close()
        engine.close()
    held_now: dict[tuple[int, str], tuple[int | None, tuple[int, ...]]] = {}
    for batch in vllm_decode(raw.frames, tmp_path):
        for kind, hashes, parent, tokens, size, medium in batch:
            for i, h in enumerate(hashes):
                if kind == "BlockStored":
                    assert size == BS and len(tokens) == len(hashes) * BS
                    held_now[(h, medium)] = (parent, tuple(tokens[i * BS:(i + 1) * BS]))
                    parent = h
                else:
                    del held_now[(h, medium)]
    assert {m for _, m in held_now} == {"GPU", MEDIUM_STORAGE} and set(held_now) == expected
    for medium, lengths in (("GPU", cached), (MEDIUM_STORAGE, spilled)):
        children = {(parent, tokens): h for (h, m), (parent, tokens) in held_now.items() if m == medium}
        for ids, length in zip(served, lengths, strict=True):  # each served prompt, spelled by its chain
            parent, n = None, 0
            while n + BS <= len(ids) and (parent, tuple(ids[n:n + BS])) in children:
                parent, n = children[(parent, tuple(ids[n:n + BS]))], n + BS
            assert n == length, (medium, n, length)
    assert spilled[0] == 3 * C and cached[-1] >= 3 * C  # the document: in the tier, and back in the pool
