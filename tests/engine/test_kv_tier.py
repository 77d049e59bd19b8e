"""The second tier: evicted KV goes to chunk files and comes back bit-identical instead of being
recomputed; corrupt or foreign files are skipped; a restart finds the chunks; private
namespaces never reach the disk on a public deployment (tiny random Llama)."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from engine.engine import Engine
from engine.kvcache import kv_tier
from engine.kvcache.kv_tier import CHUNK_TOKENS, ChunkGeometry, DiskStore, HostStore
from engine.types import CacheKey, GenerationRequest, SamplingParams
from tests.engines import rand_ids
from tests.helpers_app import assert_clean, wait_idle

C = CHUNK_TOKENS


def chunk(seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(2, 2, 2, C, 16, generator=torch.Generator().manual_seed(seed)).to(dtype)


def geometry(dtype=torch.float32) -> ChunkGeometry:
    """What ``chunk`` makes: 2 layers, 2 KV heads, head_dim 16."""
    return ChunkGeometry(num_layers=2, num_kv_heads=2, head_dim=16, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_disk_round_trip_is_bit_identical_and_survives_a_new_store(tmp_path, dtype):
    store = DiskStore(tmp_path, 10 * 2**20, geometry(dtype))
    kv = chunk(1, dtype)
    assert store.put("a" * 40, kv)
    assert torch.equal(store.get("a" * 40), kv)
    store.close()
    again = DiskStore(tmp_path, 10 * 2**20, geometry(dtype))  # a restart
    assert "a" * 40 in again and torch.equal(again.get("a" * 40), kv)


def test_budget_drops_least_recently_used_chunks(tmp_path):
    size = chunk(0).numel() * 4
    store = DiskStore(tmp_path, 2 * size, geometry())
    for i, key in enumerate(["a" * 40, "b" * 40]):
        store.put(key, chunk(i))
    store.get("a" * 40)  # a is now the most recently used
    store.put("c" * 40, chunk(2))
    assert "a" * 40 in store and "b" * 40 not in store and "c" * 40 in store
    assert store.bytes_in_use == 2 * size and len(list(tmp_path.glob("*.kv"))) == 2


def test_corrupt_truncated_and_foreign_files_are_skipped_with_one_line(tmp_path, caplog):
    store = DiskStore(tmp_path, 10 * 2**20, geometry())
    for key in ("a" * 40, "b" * 40, "c" * 40):
        store.put(key, chunk(3))
    data = bytearray((tmp_path / ("a" * 40 + ".kv")).read_bytes())
    data[-5] ^= 0xFF  # one flipped byte in the payload
    (tmp_path / ("a" * 40 + ".kv")).write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="engine.kvcache.kv_tier"):
        assert store.get("a" * 40) is None
    assert "checksum" in caplog.text and "a" * 40 not in store
    store.close()
    path = tmp_path / ("b" * 40 + ".kv")
    path.write_bytes(path.read_bytes()[:-100])  # truncated
    (tmp_path / ("d" * 40 + ".kv")).write_bytes(b"not a chunk at all")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="engine.kvcache.kv_tier"):
        again = DiskStore(tmp_path, 10 * 2**20, geometry())
    assert "c" * 40 in again and "b" * 40 not in again and "d" * 40 not in again
    assert caplog.text.count("skipping") == 2


def test_host_store_is_the_same_lru(tmp_path):
    store = HostStore(chunk(0).numel() * 4, geometry())
    store.put("a" * 40, chunk(5))
    store.put("b" * 40, chunk(6))
    assert "a" * 40 not in store and torch.equal(store.get("b" * 40), chunk(6))


# ------------------------------------------------------------------- through the engine
def tier_engine(make_engine, runner, tmp_path, budget_tokens=300, **kw) -> Engine:
    return make_engine(runner, budget_bytes=budget_tokens * runner.kv_bytes_per_token, tier_bytes=64 * 2**20,
                       tier_dir=str(tmp_path), **kw)


def req(ids, n=6, **kw) -> GenerationRequest:
    return GenerationRequest(prompt_ids=tuple(ids), sampling=SamplingParams(max_new_tokens=n), **kw)


def test_an_evicted_prefix_comes_back_from_the_tier_bit_identical(tiny_runner, tmp_path, make_engine):
    vocab = len(tiny_runner.text.tokenizer)
    engine = tier_engine(make_engine, tiny_runner, tmp_path)
    cache = engine.cache
    doc = rand_ids(1, 3 * C + 10, vocab)
    engine.prefill_in_pool(CacheKey(tuple(doc)))
    slots = cache.tree.match(CacheKey(tuple(doc))).values[: 3 * C]
    before = torch.stack([torch.stack([layer[:, slots] for layer in half]) for half in (cache.pool.k, cache.pool.v)])
    for i in range(3):  # other prompts push the document out of the pool
        engine.run(req(rand_ids(10 + i, 200, vocab), 1))
    assert cache.match_len(CacheKey(tuple(doc))) < C and engine.stats().tier_chunks >= 3
    question = doc + rand_ids(2, 5, vocab)
    m = engine.run(req(question, 8))
    assert m.cached_tokens >= 3 * C and m.tier_tokens > 0 and m.tier_load_ms > 0
    slots = cache.tree.match(CacheKey(tuple(doc))).values[: 3 * C]
    after = torch.stack([torch.stack([layer[:, slots] for layer in half]) for half in (cache.pool.k, cache.pool.v)])
    assert torch.equal(before, after)  # the KV came back bit for bit
    plain = make_engine(enable_cache=False)
    assert m.output_ids == plain.run(req(question, 8)).output_ids
    wait_idle(engine)
    assert_clean(engine)
    assert engine.stats().tier_loaded_tokens >= m.tier_tokens


def test_a_restart_finds_the_cache_on_disk(tiny_runner, tmp_path, make_engine):
    vocab = len(tiny_runner.text.tokenizer)
    doc = rand_ids(3, 2 * C + 7, vocab)
    first = tier_engine(make_engine, tiny_runner, tmp_path, budget_tokens=1000)
    first.run(req(doc, 4))
    first.close()  # writes what the cache holds
    second = tier_engine(make_engine, tiny_runner, tmp_path, budget_tokens=1000)
    assert second.stats().tier_chunks >= 2
    m = second.run(req(doc + [5, 6, 7], 4))
    assert m.cached_tokens == 2 * C and m.tier_tokens == 2 * C
    assert m.output_ids == make_engine(enable_cache=False).run(req(doc + [5, 6, 7], 4)).output_ids
    assert_clean(second)


def test_another_dtype_never_reads_the_chunks(tiny_runner, tiny_runner_bf16, tmp_path, make_engine):
    vocab = len(tiny_runner.text.tokenizer)
    doc = rand_ids(4, 2 * C + 1, vocab)
    first = tier_engine(make_engine, tiny_runner, tmp_path, budget_tokens=1000)
    first.run(req(doc, 2))
    first.close()
    other = tier_engine(make_engine, tiny_runner_bf16, tmp_path, budget_tokens=1000)
    assert other.stats().tier_chunks == 0
    assert other.run(req(doc + [9], 2)).tier_tokens == 0


def test_isolation_writes_shipped_content_only(tiny_runner, tmp_path, make_engine):
    vocab = len(tiny_runner.text.tokenizer)
    engine = tier_engine(make_engine, tiny_runner, tmp_path, budget_tokens=1000, isolation=True)
    shipped = rand_ids(5, 2 * C, vocab)
    private = rand_ids(6, 3 * C, vocab)
    engine.run(req(shipped + private, 2, namespace="v-alice", public_len=len(shipped)))
    engine.run(req(rand_ids(7, 2 * C, vocab), 2, namespace="salt-abc"))
    written = engine.persist_cache()
    assert written == 2 and engine.stats().tier_chunks == 2  # the shipped prefix's two chunks, nothing else
    private_key = kv_tier.chunk_key(engine.cache.tier.fingerprint, "v-alice", len(shipped), shipped + private[:C])
    assert private_key not in engine.tier


def test_concurrent_loads_and_evictions_stay_consistent_and_exact(tiny_runner, tmp_path, make_engine):
    vocab = len(tiny_runner.text.tokenizer)
    engine = tier_engine(make_engine, tiny_runner, tmp_path, budget_tokens=400, max_batch=4)
    docs = [rand_ids(20 + i, 2 * C + 3, vocab) for i in range(4)]
    requests = [req(docs[i % 4] + rand_ids(40 + i, 4, vocab), 5) for i in range(16)]
    results: list = [None] * len(requests)
    errors: list = []

    def client(i: int) -> None:
        try:
            results[i] = engine.run(requests[i])
        except Exception as exc:  # a finding
            errors.append(exc)

    def burst() -> None:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
            engine.check_invariants()
        for t in threads:
            t.join()

    burst()  # loads and evictions interleave as the scheduler orders them (loads may or may not happen)
    first = list(results)
    engine.offload_cache()  # then everything is in the tier: the second burst's first request per document loads
    burst()
    results = first + results
    assert not errors
    plain = make_engine(enable_cache=False)
    assert [m.output_ids for m in results] == [plain.run(r).output_ids for r in requests + requests]
    assert sum(m.tier_tokens for m in results) > 0 and engine.stats().tier_spilled_tokens > 0
    wait_idle(engine)
    assert_clean(engine)


def test_an_admission_without_room_reads_no_chunk_file(tiny_runner, tmp_path, monkeypatch, make_engine):
    """A request waiting for room retries its admission every step: the tier's files are read
    only once room is made, never by an attempt that fails."""
    vocab = len(tiny_runner.text.tokenizer)
    engine = tier_engine(make_engine, tiny_runner, tmp_path, budget_tokens=400)
    doc = rand_ids(8, 3 * C, vocab)
    engine.run(req(doc, 1))
    engine.offload_cache()
    cache = engine.cache
    reads = []
    real = engine.tier.get
    monkeypatch.setattr(engine.tier, "get", lambda key: reads.append(key) or real(key))
    with cache._lock:
        held = cache.acquire(CacheKey(tuple(rand_ids(9, 300, vocab))), 299, 390)  # nearly the whole pool
        assert held is not None
        assert cache.acquire(CacheKey(tuple(doc + [1])), 3 * C, 3 * C + 5) is None
        assert reads == []
        cache.release(held)
        rs = cache.acquire(CacheKey(tuple(doc + [1])), 3 * C, 3 * C + 5)
        assert rs is not None and rs.tier_tokens == 3 * C and len(reads) == 3
        cache.release(rs)
    assert_clean(engine)


def test_a_host_memory_tier_promises_nothing_for_the_next_start(tiny_runner, monkeypatch, make_engine):
    """A GPU's second tier is host memory, gone at exit: persisting writes nothing and says so
    (None), so the app does not print "written to the second tier for the next start"."""
    import engine.engine as engine_module

    geometry = kv_tier.ChunkGeometry(tiny_runner.num_layers, tiny_runner.num_kv_heads, tiny_runner.head_dim,
                                     tiny_runner.dtype)
    monkeypatch.setattr(engine_module, "make_tier", lambda *a, **k: kv_tier.HostStore(2**24, geometry))
    engine = make_engine(budget_bytes=300 * tiny_runner.kv_bytes_per_token, tier_bytes=2**24)
    assert engine.capabilities.second_tier and engine.stats().tier_kind == "host memory"
    assert engine.persist_cache() is None
    engine.close()
    assert make_engine(budget_bytes=2**20).persist_cache() is None  # no tier at all
