"""A model-based test of the whole prefix cache (issue #27 item 2): random sequences of every
verb of ``RadixCache`` (insert, acquire, write, adopt, release, cancel, budget changes, clear,
offload, load, persist, copy, restart over the same tier folder, files corrupted on disk),
checked after every step against a plain reference (tiny random Llama, real tensors).

The reference is the KV a no-cache prefill gives: the KV at position ``i`` depends only on
``ids[:i + 1]``, so a small universe of token sequences with shared prefixes is run through
the model once, each position's KV kept from the first sequence that reaches it (a prefix
shared by several sequences has one canonical KV, so every copy compares exactly in fp32).
A running request "computes" its KV by copying the reference into its own slots (what the
model would write); a few writes go through the real paged forward too.

Three machines: ``TestCache`` (every verb, running requests included), ``TestCacheTier`` (no
running requests, shipped content only, long runs: each step stores, evicts, spills, loads or
restarts, which is where a match lost while making room shows) and ``TestCacheWithCorruptFiles``
(chunk headers, payloads and the spilled-paths file damaged on disk). Each is bounded for CI;
``RADIX_STATEFUL_SCALE=10`` hunts ten times longer. Every construction of pools, tiers and
caches is in ``_new_cache`` (one place to adapt when the constructors change).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import tempfile
from functools import cache
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.kvcache.kv_pool import KVPool
from engine.kvcache.kv_tier import CHUNK_TOKENS, ChunkGeometry, DiskStore
from engine.kvcache.radix_cache import RadixCache
from engine.kvcache.request_kv import RequestKV
from engine.kvcache.request_slots import RequestSlots
from engine.kvcache.second_tier import SecondTier
from engine.model.paged_attention import PagedSegment
from engine.types import PUBLIC, CacheKey, EngineError
from tests.engines import machine_runner

FINGERPRINT = "stateful-test"
NAMESPACES = (PUBLIC, "v1", "v2", "v1/chat")  # a sub-namespace counts as its owner's (fair share)
ALPHABET = (11, 12, 13)  # few letters: prefixes are shared by accident too
MAX_BUDGET_TOKENS = 400
MAX_TIER_TOKENS = 8 * CHUNK_TOKENS
SPECS = [(0, 0, 0), (1, 0, 0), (2, 0, 0), (3, 1, 0), (0, 1, 64), (4, 0, 0), (5, 2, 30), (0, 2, 150),
         (6, 0, 0), (7, 1, 0), (1, 3, 64), (2, 3, 0)]  # (sequence, namespace, public length)
# budgets mostly under two sequences' worth, so eviction (and spilling to the tier) is common
BUDGETS = st.one_of(st.sampled_from([64, 100, 128, 140, 160, 200]), st.integers(0, MAX_BUDGET_TOKENS))


# ---------------------------------------------------------------- reference

def _universe() -> list[tuple[int, ...]]:
    """Token sequences with deliberately shared prefixes (several 64-token chunks each)."""
    rnd = random.Random(27)

    def fresh(n: int) -> list[int]:
        return [rnd.choice(ALPHABET) for _ in range(n)]

    s0 = fresh(200)
    s1 = s0[:130] + fresh(70)
    s4 = fresh(180)
    return [tuple(s) for s in (s0, s1, s0[:64] + fresh(100), s0[:20] + fresh(120), s4, s4[:70] + fresh(60),
                               s1[:150] + fresh(40), fresh(90))]


def _common(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@cache
def _reference() -> tuple[list[tuple[int, ...]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The universe and, per sequence, K and V ``[layer, head, position, dim]`` of a no-cache
    prefill, positions shared with an earlier sequence taken from it (one KV per prefix)."""
    runner = machine_runner()
    seqs, kvs = _universe(), []
    for s in seqs:
        buf = runner.new_request_kv(len(s))
        runner.forward(list(s), buf)
        k, v = buf.k[:, :, :len(s)].clone(), buf.v[:, :, :len(s)].clone()
        best = max(((_common(s, t), j) for j, t in enumerate(seqs[:len(kvs)])), default=(0, -1))
        if best[0]:
            k[:, :, :best[0]] = kvs[best[1]][0][:, :, :best[0]]
            v[:, :, :best[0]] = kvs[best[1]][1][:, :, :best[0]]
        kvs.append((k, v))
    return seqs, kvs


_seq_of: dict[tuple[int, ...], int] = {}


def ref_kv(ids) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[layer, head, len(ids), dim]`` a no-cache prefill of ``ids`` gives."""
    ids = tuple(ids)
    seqs, kvs = _reference()
    j = _seq_of.get(ids)
    if j is None:
        j = next(i for i, s in enumerate(seqs) if s[:len(ids)] == ids)
        _seq_of[ids] = j
    k, v = kvs[j]
    return k[:, :, :len(ids)], v[:, :, :len(ids)]


# ---------------------------------------------------------------- construction (one place)
def _tier_folder(folder: Path, fair_share: bool) -> Path:
    """As ``engine.tier_setup.make_tier`` names it: one folder per fingerprint and mode."""
    return Path(folder) / f"{FINGERPRINT}-{'isolated' if fair_share else 'shared'}"


def _new_cache(folder: Path, budget_tokens: int, fair_share: bool, tier_tokens: int) -> RadixCache:
    """The cache under test: a pool of ``budget_tokens`` slots, a disk tier of ``tier_tokens``
    (none when 0) under ``folder``, isolation mode when ``fair_share``."""
    r = machine_runner()
    pool = KVPool(r.num_layers, r.num_kv_heads, r.head_dim, torch.float32, torch.device("cpu"),
                  budget_tokens * r.kv_bytes_per_token)
    tier = None
    if tier_tokens > 0:
        geometry = ChunkGeometry(r.num_layers, r.num_kv_heads, r.head_dim, torch.float32)
        store = DiskStore(_tier_folder(folder, fair_share), tier_tokens * r.kv_bytes_per_token, geometry)
        tier = SecondTier(store, FINGERPRINT, public_only=fair_share)
    return RadixCache(pool, fair_share=fair_share, tier=tier)


def _close_cache(cache: RadixCache) -> None:
    """What a process's exit does: the tier's folder lock goes (the files stay)."""
    if cache.tier is not None:
        cache.tier.store.close()


def _scratch(n: int) -> RequestKV:
    r = machine_runner()
    return RequestKV(r.num_layers, r.num_kv_heads, r.head_dim, n, torch.float32, torch.device("cpu"))


# ---------------------------------------------------------------- checks
def _gather(pool: KVPool, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.tensor(slots, dtype=torch.long)
    return (torch.stack([layer.index_select(1, idx) for layer in pool.k]),
            torch.stack([layer.index_select(1, idx) for layer in pool.v]))


def _assert_kv(pool: KVPool, slots: list[int], ids, start: int, what: str) -> None:
    """The pool's KV at ``slots`` is the reference KV of ``ids`` at positions ``[start, start + len(slots))``."""
    if not slots:
        return
    k, v = _gather(pool, slots)
    rk, rv = ref_kv(ids)
    end = start + len(slots)
    assert torch.equal(k, rk[:, :, start:end]) and torch.equal(v, rv[:, :, start:end]), (
        f"{what}: pool KV at positions [{start}, {end}) is not the reference KV of its tokens")


def _digest(cache: RadixCache):
    """What a no-op must leave as it found: the tree (shape, slots, locks, hits, times), the pool's
    free slots and budget, the tier's chunks and the spilled tree."""
    nodes = sorted((n.id, n.parent.id, n.key, tuple(n.value), n.namespace, n.lock_ref, n.hits, n.last_access)
                   for n in cache.tree.nodes())
    tier = cache.tier
    spilled = sorted((n.id, n.key, tuple(n.value)) for n in tier.spilled.tree.nodes()) if tier is not None else []
    files = sorted(p.name for p in tier.store.folder.iterdir()) if tier is not None else []
    return (nodes, cache.pool.num_free, cache.pool.capacity, cache.pool.budget_bytes, cache.tree.evicted_tokens,
            spilled, files, tier.store.num_chunks if tier is not None else 0)


def _public_tokens(cache: RadixCache) -> int:
    return sum(len(n.key) for n in cache.tree.nodes() if n.namespace == PUBLIC)


class Live:
    """A running request as the test sees it: its slots, the sequence it runs and its key."""

    def __init__(self, rs: RequestSlots, seq: int, key: CacheKey, total: int) -> None:
        self.rs, self.seq, self.key, self.total = rs, seq, key, total

    @property
    def ids(self) -> tuple[int, ...]:
        return _reference()[0][self.seq][:self.total]


# ---------------------------------------------------------------- the machine
class CacheMachine(RuleBasedStateMachine):
    """Random operations on one ``RadixCache`` (restarted now and then over its tier folder)."""

    corrupt_files = False  # subclasses turn on the rules that damage the tier's files
    requests = True  # False: no running requests (more of the steps move KV between the tree and the tier)
    specs = SPECS  # the keys operations draw from

    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="radix-stateful-"))
        self.live: list[Live] = []
        self.cache: RadixCache | None = None
        self.fair = False  # isolation mode of the cache now (``start``, ``restart``)

    def teardown(self) -> None:
        if self.cache is not None:
            _close_cache(self.cache)
        shutil.rmtree(self.folder, ignore_errors=True)

    @initialize(budget=BUDGETS, fair=st.booleans(),
                tier=st.sampled_from([MAX_TIER_TOKENS, 0, CHUNK_TOKENS, 3 * CHUNK_TOKENS, MAX_TIER_TOKENS]))
    def start(self, budget, fair, tier):
        self.cache = _new_cache(self.folder, budget, fair, tier)
        self.fair = fair

    # ------------------------------------------------------------ helpers
    def _key(self, spec: int, length: int) -> CacheKey:
        seq, ns, public = self.specs[spec % len(self.specs)]
        ids = _reference()[0][seq][:length]
        namespace = NAMESPACES[ns]
        return CacheKey(ids, namespace, 0 if namespace == PUBLIC else min(public, length))

    def _visitor_keeps_public(self, key: CacheKey, public_before: int) -> None:
        """In isolation mode a visitor never evicts shipped (``PUBLIC``) content."""
        if self.fair and key.namespace != PUBLIC:
            assert _public_tokens(self.cache) >= public_before, "a visitor evicted shipped content"

    def _pick(self, i: int) -> Live:
        return self.live[i % len(self.live)]

    @property
    def bpt(self) -> int:
        return self.cache.pool.bytes_per_token

    # ------------------------------------------------------------ rules
    # lengths and budgets near chunk boundaries come up often: that is where the tier's edges are
    lengths = st.one_of(st.sampled_from([10, 30, 63, 64, 65, 100, 128, 129, 130, 150, 192, 200]), st.integers(1, 200))
    # Keys come from a few specs (sequence, namespace, public length), cut to a length: the same
    # prefixes come back (as a conversation's turns do) and the tier's chunks get hit.
    keys = dict(spec=st.integers(0, len(SPECS) - 1), length=lengths)  # an index into ``specs``

    @rule(**keys, short=st.integers(0, 200))
    def insert(self, spec, length, short):
        key = self._key(spec, length)
        n = max(0, len(key.ids) - short % (len(key.ids) + 1))  # a scratch buffer may hold less than the key
        kv = _scratch(len(key.ids))
        k, v = kv.prefill_from(n)
        rk, rv = ref_kv(key.ids[:n])
        k.copy_(rk)
        v.copy_(rv)
        before = self.cache.match_len(key.prefix(n))
        public = _public_tokens(self.cache)
        stored = self.cache.insert(key, kv)
        self._visitor_keeps_public(key, public)
        assert 0 <= stored <= n - before
        if stored:
            assert self.cache.match_len(key.prefix(n)) == before + stored

    @rule(**keys)
    def prefill(self, spec, length):
        """The engine's scratch-buffer prefill (warm start, timings): what the tier holds comes
        back, the cached prefix is copied out, the rest computed, the prompt cached."""
        key = self._key(spec, length)
        n = len(key.ids)
        public = _public_tokens(self.cache)
        self.cache.load_prefix(key, n - 1)
        kv = _scratch(n)
        cached = self.cache.copy_prefix(key, n - 1, kv, touch=True)
        rk, rv = ref_kv(key.ids)
        assert torch.equal(kv.k[:, :, :cached], rk[:, :, :cached]), "copied prefix KV"
        assert torch.equal(kv.v[:, :, :cached], rv[:, :, :cached]), "copied prefix KV"
        k, v = kv.prefill_from(n)
        k[:, :, cached:] = rk[:, :, cached:]
        v[:, :, cached:] = rv[:, :, cached:]
        self.cache.insert(key, kv)
        self._visitor_keeps_public(key, public)

    @precondition(lambda self: self.requests)
    @rule(**keys, cut=st.integers(0, 200), extra=st.integers(0, 200))
    def acquire(self, spec, length, cut, extra):
        key = self._key(spec, length)
        max_len = len(key.ids) - cut % (len(key.ids) + 1)
        seq = self.specs[spec % len(self.specs)][0]
        total = min(len(_reference()[0][seq]), len(key.ids) + extra)
        before = _digest(self.cache)
        matched = self.cache.match_len(key.prefix(max_len))
        public = _public_tokens(self.cache)
        rs = self.cache.acquire(key, max_len, total)
        self._visitor_keeps_public(key, public)
        if rs is None:
            assert _digest(self.cache) == before, "an acquire without room changed the cache"
            return
        self.live.append(Live(rs, seq, key, total))
        assert matched <= rs.cached_tokens <= max_len
        assert rs.tree_len == rs.length == rs.cached_tokens
        assert len(rs.slots) == max(total, rs.cached_tokens)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 50), n=st.integers(1, 200), real=st.integers(0, 9))
    def write(self, i, n, real):
        """Compute the next ``n`` positions of a running request (the reference KV; one write in
        ten through the real paged forward, compared with the reference, then set to it)."""
        r = self._pick(i)
        rs = r.rs
        n = min(n, len(rs.slots) - rs.length)
        if n <= 0:
            return
        start, stop = rs.length, rs.length + n
        if real == 0:
            seg = PagedSegment(list(r.ids[start:stop]), start, rs.slots, rs.runs())
            machine_runner().forward_paged(self.cache.pool, [seg])
            k, v = _gather(self.cache.pool, rs.slots[start:stop])
            rk, rv = ref_kv(r.ids[:stop])
            assert torch.allclose(k, rk[:, :, start:stop], atol=1e-4), "paged forward over the cached prefix"
            assert torch.allclose(v, rv[:, :, start:stop], atol=1e-4), "paged forward over the cached prefix"
        rk, rv = ref_kv(r.ids[:stop])
        self.cache.pool.write_from(rs.slots[start:stop], rk[:, :, start:stop], rv[:, :, start:stop])
        rs.length = stop

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 50), length=st.integers(1, 200))
    def adopt(self, i, length):
        r = self._pick(i)
        rs = r.rs
        key = CacheKey(r.ids[:length], r.key.namespace, r.key.public_len)
        n = min(len(key.ids), rs.length)
        before = self.cache.match_len(key.prefix(n))
        tree_len = rs.tree_len
        stored = self.cache.adopt(rs, key)
        if n > tree_len:
            assert stored == n - max(before, tree_len)
            assert rs.tree_len == n and self.cache.match_len(key.prefix(n)) == n
        else:
            assert stored == 0

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 50))
    def release(self, i):
        r = self._pick(i)
        free = self.cache.pool.num_free
        own = r.rs.own_tokens
        self.cache.release(r.rs)
        self.live.remove(r)
        assert self.cache.pool.num_free == free + own
        self.cache.release(r.rs)  # a second release is a no-op
        assert self.cache.pool.num_free == free + own

    @precondition(lambda self: self.requests)
    @rule(**keys, written=st.integers(0, 200))
    def cancel(self, spec, length, written):
        """A request cancelled mid-prefill: acquired, part written, released without adopting."""
        key = self._key(spec, length)
        rs = self.cache.acquire(key, len(key.ids) - 1, len(key.ids))
        if rs is None:
            return
        stop = min(len(rs.slots), rs.length + written)
        rk, rv = ref_kv(key.ids[:stop])
        self.cache.pool.write_from(rs.slots[rs.length:stop], rk[:, :, rs.length:stop], rv[:, :, rs.length:stop])
        rs.length = stop
        self.cache.release(rs)  # what it loaded from the tier stays cached; its own slots are free (invariant)

    @rule(tokens=BUDGETS, extra_bytes=st.integers(0, 600))
    def set_budget(self, tokens, extra_bytes):
        before = _digest(self.cache)
        held = self.cache.tree.locked_tokens + sum(r.rs.own_tokens for r in self.live)
        try:
            self.cache.set_budget(tokens * self.bpt + extra_bytes)
        except EngineError:
            assert held > tokens + extra_bytes // self.bpt, "refused a budget that holds what is running"
            assert _digest(self.cache) == before, "a refused budget change changed the cache"
            return
        assert self.cache.pool.capacity == tokens + extra_bytes // self.bpt

    @rule(ns=st.integers(-1, len(NAMESPACES) - 1))
    def clear(self, ns):
        self.cache.clear(None if ns < 0 else NAMESPACES[ns])
        if ns < 0:
            assert self.cache.num_tokens == self.cache.locked_tokens()

    @rule()
    def offload(self):
        self.cache.offload()
        assert self.cache.num_tokens == self.cache.locked_tokens()

    @rule(**keys, cut=st.integers(0, 200))
    def load_prefix(self, spec, length, cut):
        key = self._key(spec, length)
        max_len = len(key.ids) - cut % (len(key.ids) + 1)
        before = self.cache.match_len(key.prefix(max_len))
        public = _public_tokens(self.cache)
        loaded = self.cache.load_prefix(key, max_len)
        self._visitor_keeps_public(key, public)
        if loaded:
            assert self.cache.match_len(key.prefix(max_len)) >= before + loaded

    @rule()
    def persist(self):
        self.cache.persist()

    @rule(**keys, cut=st.integers(0, 200), touch=st.booleans())
    def copy_prefix(self, spec, length, cut, touch):
        key = self._key(spec, length)
        max_len = len(key.ids) - cut % (len(key.ids) + 1)
        expect = self.cache.match_len(key.prefix(max_len))
        kv = _scratch(max_len)
        n = self.cache.copy_prefix(key, max_len, kv, touch=touch)
        assert n == expect
        if n:
            rk, rv = ref_kv(key.ids[:n])
            assert torch.equal(kv.k[:, :, :n], rk) and torch.equal(kv.v[:, :, :n], rv), "copy_prefix KV"

    @rule(budget=BUDGETS, fair=st.booleans(),
          tier=st.sampled_from([CHUNK_TOKENS, 3 * CHUNK_TOKENS, MAX_TIER_TOKENS]), adopt=st.booleans(),
          clean=st.booleans())
    def restart(self, budget, fair, tier, adopt, clean):
        """A new process: a new cache over the same tier folder. Running requests end first
        (adopted or not); a clean stop persists, a crash leaves the folder as it was."""
        for r in list(self.live):
            if adopt:
                self.cache.adopt(r.rs, CacheKey(r.ids, r.key.namespace, r.key.public_len))
            self.cache.release(r.rs)
        self.live.clear()
        if clean:
            self.cache.persist()
        same_folder = fair == self.fair and self.cache.tier is not None
        on_disk = {p.stem for p in self._chunk_files()}
        drawn = _reachable_from_disk(self.cache.tier) if self.cache.tier is not None else set()
        old_bytes = self.cache.tier.store.bytes_in_use if self.cache.tier is not None else 0
        _close_cache(self.cache)
        self.cache = _new_cache(self.folder, budget, fair, tier)
        self.fair = fair
        if clean and same_folder and old_bytes <= tier * self.bpt and not self.corrupt_files:
            # a clean stop and room for all of it: every chunk is found again
            assert {p.stem for p in self._chunk_files()} == on_disk, "a restart lost chunk files"
            assert all(k in self.cache.tier.store for k in on_disk), "a restart did not index its chunk files"
            assert set(self.cache.tier.spilled.leaf_paths()) == drawn, "a restart draws other spilled paths"

    # ------------------------------------------------------------ corruption (subclass only)
    def _chunk_files(self) -> list[Path]:
        return sorted(_tier_folder(self.folder, self.fair).glob("*.kv"))

    @precondition(lambda self: self.corrupt_files)
    @rule(i=st.integers(0, 50), how=st.sampled_from(
        ["flip", "truncate", "empty", "delete", "key", "dtype-float64", "dtype-bfloat16", "dtype-int32",
         "dtype-Tensor", "layers", "tokens", "heads-dim"]))
    def corrupt_chunk(self, i, how):
        files = self._chunk_files()
        if not files:
            return
        path = files[i % len(files)]
        _damage(path, how)

    @precondition(lambda self: self.corrupt_files)
    @rule(how=st.sampled_from(["huge-id", "negative-id", "not-json", "no-paths", "ids-string", "ns-list",
                               "public-str", "stale"]))
    def corrupt_paths(self, how):
        folder = _tier_folder(self.folder, self.fair)
        if not folder.exists():
            return
        _bad_paths(folder / "spilled-paths.json", how)

    # ------------------------------------------------------------ invariants
    @invariant()
    def consistent(self):
        if self.cache is None:
            return
        cache, pool = self.cache, self.cache.pool
        values = cache.tree.all_values()
        own = [s for r in self.live for s in r.rs.slots[r.rs.tree_len:]]
        assert all(isinstance(s, int) and 0 <= s < pool.capacity for s in values), "a tree slot out of range"
        assert all(0 <= s < pool.capacity for s in own), "a running request's slot out of range"
        assert len(set(values)) == len(values), "a slot held twice by the tree"
        assert len(set(own)) == len(own) and not set(own) & set(values), "a slot held twice"
        assert pool.num_free + len(values) + len(own) == pool.capacity, (
            f"free {pool.num_free} + tree {len(values)} + running {len(own)} != capacity {pool.capacity}")
        assert pool.bytes_in_use <= pool.budget_bytes
        cache.check_invariants()
        snap = cache.snapshot()
        resident = [n for n in snap.nodes if not n.spilled]
        assert sum(n.num_tokens for n in resident) == cache.num_tokens == snap.num_tokens
        depth = {0: 0} | {n.node_id: n.depth_tokens for n in resident}
        assert all(depth[n.parent_id] + n.num_tokens == n.depth_tokens for n in resident), "snapshot depths"
        assert all(n.parent_id in depth or n.parent_id in {m.node_id for m in snap.nodes} for n in snap.nodes)
        cache.snapshot(viewer="v1")
        # every tree slot holds the KV of its token at its position
        stack = [(child, ()) for child in cache.tree.root.children.values()]
        while stack:
            node, above = stack.pop()
            ids = above + tuple(node.key)
            _assert_kv(pool, list(node.value), ids, len(above), f"tree node {node.id}")
            stack.extend((c, ids) for c in node.children.values())
        # every running request's written positions hold the reference KV of its ids
        for r in self.live:
            rs = r.rs
            assert set(rs.slots[:rs.tree_len]) <= set(values), "a running request reads slots the tree lost"
            _assert_kv(pool, rs.slots[:rs.length], r.ids[:rs.length], 0, "running request")


def _damage(path: Path, how: str) -> None:
    """Corrupt one chunk file as a crash, a bad disk or another program might."""
    data = bytearray(path.read_bytes())
    head = struct.Struct("<6s40s16sIIIIQI")
    if len(data) < head.size:
        return
    magic, key, dtype, layers, heads, tokens, dim, size, crc = head.unpack_from(data)
    if how == "flip":
        data[head.size + (len(data) - head.size) // 2] ^= 0x40
    elif how == "truncate":
        data = data[:len(data) - 7]
    elif how == "empty":
        data = bytearray()
    elif how == "delete":
        path.unlink()
        return
    elif how == "key":
        key = b"0" * 40
    elif how.startswith("dtype-"):
        dtype = how.removeprefix("dtype-").encode()
    elif how == "layers":
        layers, heads = layers * 2, max(1, heads // 2)  # same element count, another shape
    elif how == "tokens":
        tokens, dim = tokens * 2, max(1, dim // 2)
    elif how == "heads-dim":
        heads, dim = heads * 2, max(1, dim // 2)
    if how in ("key", "layers", "tokens", "heads-dim") or how.startswith("dtype-"):
        data[:head.size] = head.pack(magic, key, dtype, layers, heads, tokens, dim, size, crc)
    path.write_bytes(bytes(data))


def _bad_paths(path: Path, how: str) -> None:
    """A spilled-paths file that does not describe the tier (or does not parse)."""
    good = [{"ids": list(_reference()[0][0][:128]), "namespace": PUBLIC, "public_len": 0}]
    if how == "huge-id":
        doc = {"version": 1, "paths": [{"ids": [2**63] * 64, "namespace": PUBLIC, "public_len": 0}] + good}
    elif how == "negative-id":
        doc = {"version": 1, "paths": [{"ids": [-5] * 64, "namespace": "v1", "public_len": 3}]}
    elif how == "not-json":
        path.write_text("{not json")
        return
    elif how == "no-paths":
        doc = {"version": 1}
    elif how == "ids-string":
        doc = {"version": 1, "paths": [{"ids": "abc", "namespace": PUBLIC, "public_len": 0}]}
    elif how == "ns-list":
        doc = {"version": 1, "paths": [{"ids": list(range(64)), "namespace": ["x"], "public_len": 0}]}
    elif how == "public-str":
        doc = {"version": 1, "paths": [{"ids": list(range(64)), "namespace": "v1", "public_len": "Tensor"}]}
    else:  # stale: paths of chunks the tier does not hold
        doc = {"version": 1, "paths": good + [{"ids": list(_reference()[0][4][:192]), "namespace": "v2",
                                               "public_len": 70}]}
    path.write_text(json.dumps(doc))


class TierCacheMachine(CacheMachine):
    """The same without running requests: every step stores, evicts, spills, loads or restarts."""

    requests = False
    specs = [(0, 0, 0), (1, 0, 0), (2, 0, 0), (3, 0, 0)]  # shipped content only, sharing prefixes


class CorruptingCacheMachine(CacheMachine):
    """The same, with the tier's files damaged on disk now and then."""

    corrupt_files = True


def _reachable_from_disk(tier) -> set[CacheKey]:
    """The spilled paths as a new process can draw them: each cut before its first chunk the store
    lacks (a chunk drawn while the pool held the part above it is unreachable once the pool is
    gone: ``clear`` drops pool KV without spilling it), and those that became a prefix of another
    (same tokens, same namespaces) left out. What a clean restart must draw again."""
    cut = set()
    for path in tier.spilled.leaf_paths():
        end = 0
        while end + CHUNK_TOKENS <= len(path.ids) and tier.key_of(path, end + CHUNK_TOKENS) in tier.store:
            end += CHUNK_TOKENS
        if end:
            cut.add(CacheKey(path.ids[:end], path.namespace, min(path.public_len, end)))
    return {p for p in cut if not any(len(q.ids) > len(p.ids) and _is_prefix(p, q) for q in cut)}


def _is_prefix(p: CacheKey, q: CacheKey) -> bool:
    """``p`` is where ``q`` starts: the same tokens under the same namespaces (the tree keys a
    child by namespace and token, so the same tokens under another namespace are another path)."""
    return q.ids[:len(p.ids)] == p.ids and all(p.ns_at(i) == q.ns_at(i) for i in range(len(p.ids)))


def _settings(examples: int, steps: int) -> settings:
    """Bounded for CI (the file runs in well under a minute on two busy cores); for a longer hunt
    set RADIX_STATEFUL_SCALE (examples times that)."""
    scale = float(os.environ.get("RADIX_STATEFUL_SCALE", "1"))
    return settings(max_examples=max(1, int(examples * scale)), stateful_step_count=steps, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


TestCache = CacheMachine.TestCase
TestCache.settings = _settings(25, 60)
# Long runs: a slot lost between a match and its extension needs several evictions in a row
# (in 40 runs of up to 100 steps it came up within the first few, every time we tried).
TestCacheTier = TierCacheMachine.TestCase
TestCacheTier.settings = _settings(40, 100)
TestCacheWithCorruptFiles = CorruptingCacheMachine.TestCase
TestCacheWithCorruptFiles.settings = _settings(20, 60)
