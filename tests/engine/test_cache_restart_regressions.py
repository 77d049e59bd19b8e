"""One plain regression test per defect the stateful cache test (``test_cache_stateful``) found,
each named for the defect, each the shortest sequence of operations that showed it. Built with
that file's one factory and checked against its no-cache reference KV (tiny random Llama)."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from engine.kvcache.kv_tier import CHUNK_TOKENS
from engine.kvcache.second_tier import path_of
from engine.types import CacheKey
from tests.engine.test_cache_stateful import _close_cache, _new_cache, _reference, _scratch, _tier_folder, ref_kv

_HEADER = struct.Struct("<6s40s16sIIIIQI")  # the chunk file's header (engine.kvcache.kv_tier)


@pytest.fixture
def caches(tmp_path):
    """``make(budget_tokens, tier_tokens)``: caches over one tier folder, closed at the end."""
    made = []

    def make(budget_tokens, tier_tokens=8 * CHUNK_TOKENS, fair_share=False):
        made.append(_new_cache(tmp_path, budget_tokens, fair_share, tier_tokens))
        return made[-1]

    yield make
    for cache in made:
        _close_cache(cache)


def _insert(cache, ids) -> int:
    kv = _scratch(len(ids))
    k, v = kv.prefill_from(len(ids))
    rk, rv = ref_kv(ids)
    k.copy_(rk)
    v.copy_(rv)
    return cache.insert(CacheKey(tuple(ids)), kv)


def _assert_tree_is_reference(cache) -> None:
    """Every slot of the tree is in range and holds the reference KV of its token."""
    cache.check_invariants()
    for node in cache.tree.nodes():
        path, slots = path_of(node, cache.tree.root)
        assert all(0 <= s < cache.pool.capacity for s in slots), f"node {node.id} holds slots {slots}"
        idx = torch.tensor(slots, dtype=torch.long)
        k = torch.stack([layer.index_select(1, idx) for layer in cache.pool.k])
        rk, _ = ref_kv(path.ids)
        assert torch.equal(k, rk), f"node {node.id} holds wrong KV"


def _seq(i: int) -> tuple[int, ...]:
    return _reference()[0][i]


def test_load_prefix_keeps_the_match_it_extends(caches):
    """load_prefix matched, then made room with the match unlocked: eviction took the matched
    leaf and the loaded chunks went in behind slot -1 (fixed on main by holding the match)."""
    cache = caches(2 * CHUNK_TOKENS + 12)
    prompt = _seq(0)[:2 * CHUNK_TOKENS + 2]
    _insert(cache, prompt)
    cache.offload()  # both whole chunks in the tier only
    _insert(cache, prompt[:10])  # the short match, now the least recently used leaf
    _insert(cache, _seq(7)[:2 * CHUNK_TOKENS])  # fills the pool
    cache.load_prefix(CacheKey(prompt), len(prompt) - 1)
    _assert_tree_is_reference(cache)


def test_failed_acquire_changes_no_access_time(caches):
    """acquire without room must change nothing (its contract), but holding the match goes through
    ``tree.insert``, which stamps the matched nodes' access time: a refused request reorders LRU."""
    cache = caches(CHUNK_TOKENS, tier_tokens=0)
    _insert(cache, _seq(0)[:10])
    before = [(n.id, n.last_access, n.hits) for n in cache.tree.nodes()]
    key = CacheKey(_seq(0)[:CHUNK_TOKENS + 1])
    assert cache.acquire(key, len(key.ids), len(key.ids)) is None  # 65 positions in 64 slots
    assert [(n.id, n.last_access, n.hits) for n in cache.tree.nodes()] == before


def _one_chunk_on_disk(caches, tmp_path):
    """A cache whose tier holds the first chunk of sequence 0 (and nothing in the pool), and that file."""
    cache = caches(2 * CHUNK_TOKENS)
    _insert(cache, _seq(0)[:CHUNK_TOKENS])
    cache.offload()
    (path,) = _tier_folder(tmp_path, False).glob("*.kv")
    return cache, path


def _rewrite_header(path, **fields) -> None:
    data = bytearray(path.read_bytes())
    names = ("magic", "key", "dtype", "layers", "heads", "tokens", "dim", "size", "crc")
    head = dict(zip(names, _HEADER.unpack_from(data), strict=True)) | fields
    data[:_HEADER.size] = _HEADER.pack(*(head[n] for n in names))
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("fields", [
    {"dtype": b"Tensor"},  # not a dtype: getattr(torch, ...) gave a class, view() raised TypeError
    {"dtype": b"int32"},  # same element size: read as int32, index_copy_ into the fp32 pool raised
    {"tokens": 2 * CHUNK_TOKENS, "dim": 8},  # same element count, another shape: the load raised
    {"layers": 1, "heads": 4},
], ids=["dtype-Tensor", "dtype-int32", "tokens-dim", "layers-heads"])
def test_chunk_whose_header_lies_is_dropped_not_raised(caches, tmp_path, fields):
    """Header fields were only checked by the payload's view: a header rewritten to another dtype or
    shape (the payload and its CRC intact) crashed the load instead of being skipped."""
    cache, path = _one_chunk_on_disk(caches, tmp_path)
    _rewrite_header(path, **fields)
    key = CacheKey(_seq(0)[:CHUNK_TOKENS + 1])
    assert cache.load_prefix(key, CHUNK_TOKENS) == 0  # skipped with one log line, not raised
    rs = cache.acquire(key, CHUNK_TOKENS, CHUNK_TOKENS + 1)
    assert rs is not None and rs.cached_tokens == 0
    cache.release(rs)
    _assert_tree_is_reference(cache)


def test_paths_file_with_a_token_id_past_int64_does_not_stop_the_start(caches, tmp_path):
    """A spilled-paths file is read at start; an id >= 2**63 parsed as a Python int, then hashing it
    as int64 raised outside the parse's try: the cache (and the engine) could not start."""
    first = caches(2 * CHUNK_TOKENS)
    _insert(first, _seq(0)[:2 * CHUNK_TOKENS])
    first.persist()
    _close_cache(first)
    paths = _tier_folder(tmp_path, False) / "spilled-paths.json"
    doc = json.loads(paths.read_text())
    doc["paths"].append({"ids": [2**63] * CHUNK_TOKENS, "namespace": "", "public_len": 0})
    paths.write_text(json.dumps(doc))
    again = caches(2 * CHUNK_TOKENS)  # raised ValueError: Overflow when unpacking long long
    again.check_invariants()
    assert again.load_prefix(CacheKey(_seq(0)[:2 * CHUNK_TOKENS]), 2 * CHUNK_TOKENS) == 2 * CHUNK_TOKENS
    _assert_tree_is_reference(again)


def test_a_refused_acquire_tells_the_kv_event_listener_nothing(tiny_runner):
    """A refused admission tries an eviction and undoes it: subscribers of KV events must not
    see blocks leave and come back (they would be told of an eviction that never happened)."""
    from engine.kvcache.kv_pool import KVPool
    from engine.kvcache.radix_cache import RadixCache
    from engine.types import CacheKey

    heard: list[tuple[str, int]] = []

    class Recorder:  # the listener's interface (engine.kvcache.kv_events.KVEventPublisher)
        def cached(self, node):
            heard.append(("cached", node.id))

        def removed(self, node):
            heard.append(("removed", node.id))

        def cleared(self):
            heard.append(("cleared", 0))

    r = tiny_runner
    cache = RadixCache(KVPool(r.num_layers, r.num_kv_heads, r.head_dim, r.dtype, r.device, 64 * r.kv_bytes_per_token))
    cache.publish_to(Recorder())
    kv = r.new_request_kv(10)
    r.forward(list(range(20, 30)), kv)
    cache.insert(CacheKey(tuple(range(20, 30))), kv)
    heard.clear()
    assert cache.acquire(CacheKey(tuple(range(40, 105))), 65, 65) is None  # needs 65 of 64 slots: refused
    assert heard == []
    cache.clear()
    assert heard == [("cleared", 0)]
