"""The fleet simulator: each policy's choice on hand-made fleets, the caches' arithmetic, the runs' bounds.

Everything here is model-free and runs in seconds.
"""

from __future__ import annotations

import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.replay.fleet_cache import BlockChain, ReplicaCaches, chain_hashes
from analysis.replay.fleet_policies import (
    POLICIES,
    CacheAware,
    ConsistentHash,
    FleetState,
    HashRing,
    KvAware,
    Oracle,
    PowerOfTwo,
    RoundRobin,
)
from analysis.replay.fleet_sim import simulate_fleet
from analysis.replay.fleet_trace import ChatWorkload, chat_workload, requests_from_ids
from analysis.replay.sim_cache import SimCache


def _state(replicas: int, loads: list[int] | None = None, budget_blocks: int | None = None) -> FleetState:
    return FleetState(ReplicaCaches(replicas, budget_blocks), loads or [0] * replicas, random.Random(0))


def _seq(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


# ------------------------------------------------------------------ blocks
def test_chain_extends_as_hashing_the_whole():
    ids = _seq(53)
    grown = BlockChain(4).extend(ids[:10]).extend(ids[10:11]).extend(ids[11:])
    assert list(grown.hashes) == list(chain_hashes(ids, 4))
    assert grown.tail == tuple(ids[52:]) and grown.num_tokens == 53


def test_a_block_names_its_whole_prefix():
    a, b = chain_hashes([1, 2, 3, 4], 2), chain_hashes([9, 9, 3, 4], 2)
    assert a[1] != b[1]  # same tokens in the block, different prefix


# ------------------------------------------------------------------ each policy
def test_round_robin_cycles():
    rr, state = RoundRobin(), _state(3)
    assert [rr.choose([], 0, 1, "", state) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_consistent_hash_keeps_a_user_and_moves_about_one_nth_when_a_replica_joins():
    policy, state = ConsistentHash(), _state(8)
    assert len({policy.choose([], 0, 1, "user-7", state) for _ in range(5)}) == 1
    keys = [f"user-{i}" for i in range(20_000)]
    before, after = HashRing(8), HashRing(9)
    moved = [k for k in keys if before.owner(k) != after.owner(k)]
    assert all(after.owner(k) == 8 for k in moved)  # keys move only to the new replica
    assert 0.5 / 9 < len(moved) / len(keys) < 1.6 / 9


def test_power_of_two_takes_the_less_loaded_of_its_two():
    policy = PowerOfTwo()
    assert {policy.choose([], 0, 1, "", _state(2, [5, 0])) for _ in range(20)} == {1}
    state = _state(4, [3, 9, 0, 9])
    picks = [policy.choose([], 0, 1, "", state) for _ in range(200)]
    assert 1 not in picks or 3 in picks  # a 9 is chosen only over the other 9
    assert picks.count(2) > 50


def _routed(policy: CacheAware, state: FleetState, blocks, prompt_tokens: int) -> int:
    return policy.choose(blocks, len(blocks), prompt_tokens, "", state)


def test_cache_aware_follows_the_longest_match_above_the_threshold_and_the_smallest_tree_below():
    state = _state(3)
    policy = CacheAware(block_tokens=1)
    long_doc, other = chain_hashes(_seq(100), 1), chain_hashes(_seq(30, 1000), 1)
    policy.trees = ReplicaCaches(3, None)
    policy.trees.store(1, long_doc, 0)  # replica 1 was sent the long prompt
    policy.trees.store(0, other, 0)  # replica 0 a short one; replica 2 nothing
    asked = chain_hashes([*_seq(60), *_seq(40, 5000)], 1)  # 60 of 100 tokens match replica 1: 0.6 > 0.3
    assert _routed(policy, state, asked, 100) == 1
    weak = chain_hashes([*_seq(20), *_seq(80, 7000)], 1)  # 20 of 100: below the threshold
    assert _routed(policy, state, weak, 100) == 2  # the smallest tree (empty)
    # Out of balance (most - fewest > 64 and most > 1.5 x fewest): the least loaded, match or not.
    busy = _state(3, [100, 200, 10])
    assert _routed(policy, busy, asked, 100) == 2


def test_kv_aware_weighs_what_each_replica_holds_against_its_load_and_oracle_ignores_load():
    state = _state(3, [0, 1, 0])
    prompt = chain_hashes(_seq(12), 1)
    state.caches.store(0, prompt[:4], 0)
    state.caches.store(1, prompt[:9], 0)
    state.caches.store(2, prompt[:2], 0)
    # costs: (12 - 4) x 1 = 8, (12 - 9) x 2 = 6, (12 - 2) x 1 = 10: the longest, though busier
    assert KvAware().choose(prompt, 12, 12, "", state) == 1
    assert Oracle().choose(prompt, 12, 12, "", state) == 1
    state.loads[1] = 5  # (12 - 9) x 6 = 18 > 8: a shorter match on an idle replica wins
    assert KvAware().choose(prompt, 12, 12, "", state) == 0
    assert Oracle().choose(prompt, 12, 12, "", state) == 1
    state.caches.store(2, prompt[:9], 2)  # now replica 2 holds as much as 1, and is idle: 3 x 1
    assert KvAware().choose(prompt, 12, 12, "", state) == 2
    # the whole prompt held: still the last token to compute, so load decides between full holders
    state.caches.store(0, prompt, 4)
    state.caches.store(2, prompt, 9)
    state.loads[:] = [2, 0, 1]
    assert KvAware().choose(prompt, 12, 12, "", state) == 2  # 1 x 2 < 1 x 3; replica 1 pays 3 x 1
    assert KvAware(block_tokens=4).choose(chain_hashes(_seq(12), 4), 3, 12, "", _state(3, [0, 0, 0])) == 0


# ------------------------------------------------------------------ runs
def _trace(n: int = 1500, seed: int = 3, block_tokens: int = 4):
    w = ChatWorkload(requests=n, system_prompts=5, system_tokens=(40, 120), users=60, user_tokens=(5, 30),
                     answer_tokens=(5, 30), requests_per_s=20.0, think_s=5.0, seed=seed)
    return chat_workload(w, block_tokens)


def test_the_oracle_reaches_at_least_every_policy_when_nothing_is_evicted():
    # Without eviction every sequence sits whole on the replica that ran it, so the replica with
    # the longest match holds the longest prefix any earlier request left: nothing can do better.
    requests = _trace()
    runs = {p: simulate_fleet(requests, 4, p, None, block_tokens=4) for p in POLICIES}
    for name, run in runs.items():
        assert run.hit_rate <= runs["oracle"].hit_rate + 1e-12, name
        assert run.cached_tokens <= run.ceiling_tokens
    assert runs["oracle"].hit_rate == runs["oracle"].ceiling_rate


def test_one_replica_reuses_what_the_single_cache_simulator_reuses():
    rng = random.Random(1)
    stems = [[rng.randrange(50) for _ in range(rng.randint(5, 40))] for _ in range(6)]
    items, expected, cache = [], 0, SimCache(None)
    for i in range(300):
        prompt = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randint(1, 12))]
        answer = [rng.randrange(50) for _ in range(rng.randint(0, 6))]
        if rng.random() < 0.3:
            stems.append(prompt + answer)  # a conversation that goes on
        items.append((prompt, answer, "", float(i)))
        expected += cache.serve(prompt, prompt + answer).cached_tokens
    run = simulate_fleet(requests_from_ids(items, block_tokens=1), 1, "round_robin", None, block_tokens=1)
    assert run.cached_tokens == expected


def test_a_budget_evicts_the_least_recently_used_leaf_blocks():
    # Blocks of 2, a budget of 6 tokens (3 blocks). By hand:
    #   A = 1 2 3 4 (2 blocks)        cached 0; held A1 A2
    #   B = 9 9 8 8 (2 blocks)        cached 0; held A1 A2 B1 B2 -> evict A2 (the oldest leaf)
    #   A again                       A1 held, A2 not: cached 2; A2 back, B2 evicted
    items = [([1, 2, 3, 4], [], "", 0.0), ([9, 9, 8, 8], [], "", 1.0), ([1, 2, 3, 4], [], "", 2.0)]
    run = simulate_fleet(requests_from_ids(items, 2), 1, "round_robin", 6, block_tokens=2)
    assert run.cached_tokens == 2 and run.evicted_tokens == 4


def test_duplication_is_counted_exactly():
    caches = ReplicaCaches(3, None)
    system = chain_hashes(_seq(8), 2)  # 4 blocks
    caches.store(0, system, 0)
    caches.store(1, system[:3], 0)
    caches.store(2, chain_hashes(_seq(4, 100), 2), 0)
    # held 4 + 3 + 2 = 9; distinct 4 + 2 = 6; blocks on two replicas: 3; extra copies 3
    d = caches.duplication()
    assert (d.held_blocks, d.distinct_blocks, d.shared_blocks, d.extra_copies) == (9, 6, 3, 3)
    assert d.share == 3 / 9
    caches.check_invariants()


def test_runs_are_deterministic_under_a_seed():
    requests = _trace(600)
    for policy in ("random", "power_of_two", "cache_aware"):
        a, b = (simulate_fleet(requests, 5, policy, 400, block_tokens=4, seed=7) for _ in range(2))
        assert (a.cached_tokens, a.per_replica, a.duplication) == (b.cached_tokens, b.per_replica, b.duplication)
    assert chat_workload(ChatWorkload(requests=50, seed=2), 16)[-1] == chat_workload(ChatWorkload(requests=50, seed=2), 16)[-1]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), replicas=st.integers(1, 6), budget=st.integers(0, 300),
       block_tokens=st.sampled_from([1, 2, 4, 16]), policy=st.sampled_from(POLICIES))
def test_budgets_hold_and_rates_stay_between_zero_and_one(seed, replicas, budget, block_tokens, policy):
    bytes_per_token = 7
    requests = _trace(120, seed=seed, block_tokens=block_tokens)

    def check(request, replica, cached, caches):
        assert 0 <= cached < request.prompt_tokens
        for r in range(caches.replicas):
            assert caches.held(r) * block_tokens * bytes_per_token <= budget * bytes_per_token
        caches.check_invariants()

    run = simulate_fleet(requests, replicas, policy, budget, block_tokens=block_tokens, seed=seed, on_request=check)
    assert 0.0 <= run.hit_rate <= run.ceiling_rate <= 1.0
    assert sum(run.per_replica) == len(requests) and run.imbalance >= 1.0 - 1e-9
    assert 0.0 <= run.duplication.share < 1.0


def test_a_replay_log_becomes_routable_requests(tokenizer):
    from analysis.replay.fleet_trace import requests_from_log

    system = {"role": "system", "content": "You answer questions about the harbour office. " * 8}
    lines = [json.dumps({"timestamp": 100, "session": "a", "response": "At 7.",
                         "messages": [system, {"role": "user", "content": "When?"}]}),
             json.dumps({"timestamp": 103, "session": "b", "messages": [system, {"role": "user", "content": "Where?"}]}),
             "not json"]
    requests = requests_from_log(lines, tokenizer, block_tokens=4, output_tokens=9)
    assert [(r.key, r.arrival_s) for r in requests] == [("a", 0.0), ("b", 3.0)]
    answered, plain = requests
    assert answered.output_tokens > 0 and plain.output_tokens == 9
    assert len(answered.blocks) == (answered.prompt_tokens + answered.output_tokens) // 4
    assert len(plain.blocks) == plain.prompt_tokens // 4
    run = simulate_fleet(requests, 1, "round_robin", None, block_tokens=4)
    assert 60 <= run.cached_tokens < plain.prompt_tokens  # the shared system prompt, in whole blocks
