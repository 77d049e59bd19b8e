"""The eviction seam (``engine.kvcache.eviction``, issue #31 item 1): one policy object drives
the pure tree, the engine's cache (real pool tensors, tiny random Llama) and the replay's
simulator the same way; the lazy leaf heap gives exactly the order a fresh sort would; fair share
holds in a budget shrink and an offload; the registry and the flag pick a policy by name."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from analysis.replay.sim_cache import SimCache
from engine.kvcache.eviction import LFU, LRU, POLICIES, EvictionPolicy, make_policy
from engine.kvcache.kv_pool import KVPool
from engine.kvcache.radix_cache import RadixCache
from engine.kvcache.radix_tree import RadixTree
from engine.types import PUBLIC, CacheKey

ALL = sorted(POLICIES)


# ---------------------------------------------------------------- registry
def test_the_registry_picks_a_policy_by_name_and_refuses_an_unknown_one():
    assert isinstance(make_policy(), LRU) and isinstance(make_policy(None), LRU)
    assert isinstance(make_policy("lru"), LRU) and isinstance(make_policy(" LFU "), LFU)
    mine = LFU()
    assert make_policy(mine) is mine
    for name in ALL:
        policy = make_policy(name)
        assert policy.name == name and policy.describe()
        assert isinstance(policy, EvictionPolicy)
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'.*lfu, lru"):
        make_policy("mru")
    with pytest.raises(ValueError, match="unknown eviction policy"):
        RadixTree(policy="random")
    with pytest.raises(ValueError, match="unknown eviction policy"):
        SimCache(100, policy="random")


def test_the_flag_and_its_env_var_reach_the_engine(tiny_runner, monkeypatch, make_engine):
    import app

    assert app.parse_args([]).eviction_policy == "lru"
    assert app.parse_args(["--eviction-policy", "lfu"]).eviction_policy == "lfu"
    monkeypatch.setenv("RADIX_EVICTION_POLICY", "lfu")
    args = app.parse_args(["--disk-cache-mb", "0", "--cache-budget-mb", "4"])
    engine = app.build_engine(args, runner=tiny_runner)
    try:
        assert isinstance(engine.cache.tree.policy, LFU)
        assert engine.info().eviction == LFU().describe()  # what the UI states, from the policy
        small = engine.spawn(64 * tiny_runner.kv_bytes_per_token)
        assert isinstance(small.cache.tree.policy, LFU)  # a spawned engine evicts the same way
        small.close()
    finally:
        engine.close()
    with pytest.raises(ValueError, match="unknown eviction policy 'nope'"):
        make_engine(budget_bytes=64 * tiny_runner.kv_bytes_per_token, eviction_policy="nope")


def test_the_ui_states_the_policy_it_reads_from_the_engine(tiny_runner, make_engine):
    from components.panels.info_panel import eviction_sentence
    from components.panels.memory_panel import budget_note

    for name in ALL:
        engine = make_engine(budget_bytes=64 * tiny_runner.kv_bytes_per_token, eviction_policy=name)
        said = make_policy(name).describe()
        assert said in eviction_sentence(engine) and said in budget_note(engine)
    off = make_engine(budget_bytes=64 * tiny_runner.kv_bytes_per_token, enable_cache=False)
    assert off.info().eviction == "" and eviction_sentence(off) == ""


# ---------------------------------------------------------------- the one heap
def _fresh_order(tree: RadixTree, n: int) -> list[int]:
    """Node ids a plain eviction of ``n`` tokens should take: the lowest (priority, id) among
    the unlocked leaves, again and again, computed from scratch on a copy of the facts."""
    leaves = {id(x): x for x in tree.nodes()}
    children = {id(x): len(x.children) for x in leaves.values()}
    taken, freed = [], 0
    while freed < n:
        ready = [x for x in leaves.values() if children[id(x)] == 0 and x.lock_ref == 0]
        if not ready:
            break
        x = min(ready, key=lambda x: (tree.policy.priority(x), x.id))
        taken.append(x.id)
        freed += len(x.key)
        del leaves[id(x)]
        if x.parent is not tree.root:
            children[id(x.parent)] -= 1
    return taken


@pytest.mark.parametrize("name", ALL)
def test_the_lazy_leaf_heap_evicts_in_exactly_the_policys_order(name):
    rng = random.Random(31)
    tree = RadixTree(clock=itertools.count().__next__, policy=name)
    stems = [tuple(rng.randrange(9) for _ in range(rng.randint(2, 12))) for _ in range(6)]
    held = []
    for step in range(600):
        ids = rng.choice(stems)[:rng.randint(1, 12)] + tuple(rng.randrange(9) for _ in range(rng.randint(0, 4)))
        ns = rng.choice([PUBLIC, "v-a", "v-b"])
        key = CacheKey(ids, ns)
        op = rng.random()
        if op < 0.45:
            tree.insert(key, [None] * len(ids))
        elif op < 0.7:
            tree.match(key)  # touches: access times and hits move, heap entries go stale
        elif op < 0.8:
            m = tree.match(key, touch=False)
            if m.length:
                tree.lock(m.node)
                held.append(m.node)
        elif op < 0.88 and held:
            tree.unlock(held.pop(rng.randrange(len(held))))
        else:
            k = rng.randint(1, 15)
            want = _fresh_order(tree, k)
            removed: list = []
            tree.evict(k, removed=removed)
            assert [x.id for x in removed] == want, step
            if rng.random() < 0.3:  # a trial eviction undone, as admission does
                tree.restore(removed)
        tree.check_invariants()  # includes: every unlocked leaf has a heap entry no later than its priority


# ---------------------------------------------------------------- tree, cache and simulator
SEQS = [(1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 10), (1, 2, 11, 12, 13), (20, 21, 22, 23, 24, 25),
        (20, 21, 26, 27), (30, 31, 32, 33, 34, 35, 36), (1, 2, 3, 4, 5, 6, 40, 41), (30, 31, 50)]


def _paths(tree: RadixTree) -> set[tuple[tuple[int, ...], str]]:
    out = set()
    for node in tree.nodes():
        ids, n = [], node
        while n is not tree.root:
            ids[:0] = n.key
            n = n.parent
        out.add((tuple(ids), node.namespace))
    return out


def _reference_kv(runner, ids):
    kv = runner.new_request_kv(len(ids))
    runner.forward(list(ids), kv)
    return kv


@pytest.mark.parametrize("name", ALL)
def test_one_policy_drives_the_tree_the_cache_and_the_simulator_identically(tiny_runner, name):
    """The same touches and inserts in all three (no eviction yet), then the budget shrinks in
    steps: each takes the same nodes, and the cache's remaining KV is still the model's."""
    clock = itertools.count(1)
    now = [0.0]

    def tick() -> float:
        now[0] = float(next(clock))
        return now[0]

    tree = RadixTree(clock=lambda: now[0], policy=name)
    sim = SimCache(None, policy=name)
    r = tiny_runner
    pool = KVPool(r.num_layers, r.num_kv_heads, r.head_dim, torch.float32, torch.device("cpu"),
                  200 * r.kv_bytes_per_token)
    cache = RadixCache(pool, policy=name)
    cache.tree._clock = lambda: now[0]  # the test's clock, shared with the other two
    kvs = {s: _reference_kv(r, s) for s in SEQS}
    rng = random.Random(7)
    for _ in range(40):
        seq = rng.choice(SEQS)
        n = rng.randint(2, len(seq))
        key = CacheKey(seq[:n])
        if tree.match(key, touch=False).length == n:
            continue  # all cached: the cache stores nothing (and touches nothing) for it
        t = tick()
        # a request: its cached prefix is matched (a hit), then the prompt is stored
        tree.match(key, max_len=n - 1)
        tree.insert(key, [None] * n)
        sim.serve(seq[:n], now=t)
        cache.copy_prefix(key, n - 1, r.new_request_kv(n), touch=True)
        assert cache.insert(key, kvs[seq]) >= 0
        assert _paths(tree) == _paths(sim.tree) == _paths(cache.tree)
        cache.check_invariants()
    total = tree.num_tokens
    for target in (total - 5, total - 12, total // 2, 3, 0):
        tick()
        tree.evict(tree.num_tokens - target)
        sim.budget_tokens = target
        sim.record([], now=now[0])  # evicts down to the budget
        cache.set_budget(target * r.kv_bytes_per_token)
        assert _paths(tree) == _paths(sim.tree) == _paths(cache.tree), target
        cache.check_invariants()
        for ids, _ in _paths(cache.tree):  # the KV kept is still what the model computes
            got = r.new_request_kv(len(ids))
            assert cache.copy_prefix(CacheKey(ids), len(ids), got) == len(ids)
            want = kvs[next(s for s in SEQS if s[:len(ids)] == ids)]  # a shared prefix: to float error
            assert torch.allclose(got.k[:, :, :len(ids)], want.k[:, :, :len(ids)], atol=1e-5)
            assert torch.allclose(got.v[:, :, :len(ids)], want.v[:, :, :len(ids)], atol=1e-5)


# ---------------------------------------------------------------- fair share, the operator's evictions
class _Removals:
    """A tree listener that records the namespace of every node that leaves."""

    def __init__(self) -> None:
        self.order: list[str] = []

    def cached(self, node) -> None:
        pass

    def removed(self, node) -> None:
        self.order.append(node.namespace)


def _isolated_cache(runner, capacity: int) -> RadixCache:
    pool = KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, torch.float32, torch.device("cpu"),
                  capacity * runner.kv_bytes_per_token)
    cache = RadixCache(pool, fair_share=True)
    rng = random.Random(5)
    # Oldest first: shipped content, then visitor b (small), then visitor a (most of the pool).
    for ns, length, count in ((PUBLIC, 10, 1), ("v-b", 12, 1), ("v-a", 20, 4)):
        for _ in range(count):
            ids = tuple(rng.randrange(3, 500) for _ in range(length))
            assert cache.insert(CacheKey(ids, ns), _reference_kv(runner, ids)) == length
    return cache


def _owner_tokens(cache: RadixCache) -> dict[str, int]:
    return dict(cache.tree.owner_tokens())


def test_a_budget_shrink_takes_from_owners_over_their_share_first(tiny_runner):
    cache = _isolated_cache(tiny_runner, 120)
    assert _owner_tokens(cache) == {PUBLIC: 10, "v-b": 12, "v-a": 80}
    # 100 slots: a share of (100 - 10) / 2 = 45 each. Plain LRU would drop the shipped content
    # and b (the oldest); fair share takes a's entries, over its share, and nothing else.
    assert cache.set_budget(100 * tiny_runner.kv_bytes_per_token) == 20
    assert _owner_tokens(cache) == {PUBLIC: 10, "v-b": 12, "v-a": 60}
    cache.check_invariants()
    # Shrinking to nothing still works: shipped content goes too, last.
    listener = _Removals()
    cache.publish_to(listener)
    cache.set_budget(0)
    assert cache.tree.num_tokens == 0 and listener.order[-1] == PUBLIC
    cache.check_invariants()


def test_an_offload_goes_in_the_fair_order_with_shipped_content_last(tiny_runner):
    cache = _isolated_cache(tiny_runner, 120)
    listener = _Removals()
    cache.publish_to(listener)
    assert cache.offload() == 102
    # a (over its share of (120 - 10) / 2) first, then the policy's order, shipped content last
    assert listener.order[0] == "v-a" and listener.order[-1] == PUBLIC
    assert listener.order.index("v-b") > listener.order.index("v-a")
    cache.check_invariants()


def test_without_isolation_a_shrink_is_the_policys_order_alone(tiny_runner):
    cache = _isolated_cache(tiny_runner, 120)
    cache.fair_share = False
    cache.set_budget(100 * tiny_runner.kv_bytes_per_token)
    assert PUBLIC not in _owner_tokens(cache)  # the oldest goes first, shipped or not
    cache.check_invariants()


def test_the_replay_simulates_the_policy_it_is_given(tokenizer):
    """``tools/replay.py --eviction-policy`` reaches the simulated cache."""
    import json

    from analysis.replay.simulate import model_geometry, simulate_lines

    geometry = model_geometry(dtype="float32", device="cpu")
    system = "You are a helpful assistant who answers questions about the radix cache. " * 3
    items = [{"prompt": system + f"Question {i % 3}?", "timestamp": 10 * i} for i in range(12)]
    lines = [json.dumps(x) for x in items]
    reports = {name: simulate_lines(lines, tokenizer, geometry, 80, ttl_s=45.0, eviction_policy=name)
               for name in ALL}
    assert all(r.requests == 12 for r in reports.values())
    with pytest.raises(ValueError, match="unknown eviction policy"):
        simulate_lines(lines, tokenizer, geometry, 80, eviction_policy="nope")


@pytest.mark.parametrize("name", ALL)
def test_a_ttl_expires_exactly_the_stale_entries_whatever_the_policy(name):
    sim = SimCache(None, ttl_s=60.0, policy=name)
    often, once = (1, 2, 3, 4, 5), (9, 8, 7)
    for t in (0.0, 1.0, 2.0):  # many hits, long ago
        sim.serve(often, now=t)
    sim.serve(once, now=50.0)  # one use, recent: the first to go by LFU, but not stale
    assert sim.serve((40, 41), now=70.0).expired_tokens == len(often)
    assert sim.tree.match(CacheKey(once), touch=False).length == len(once)
    sim.tree.check_invariants()
