"""The KV pool's free runs: contiguous allocation, coalescing frees, rebuilds layer by layer."""

from __future__ import annotations

import random

import torch

from engine.kvcache.kv_pool import KVPool, contiguous_runs


def pool(slots: int = 100) -> KVPool:
    p = KVPool(2, 2, 4, torch.float32, torch.device("cpu"), 0)
    return KVPool(2, 2, 4, torch.float32, torch.device("cpu"), slots * p.bytes_per_token)


def test_contiguous_when_a_run_fits_and_frees_coalesce():
    p = pool(100)
    a, b, c = p.alloc(10), p.alloc(20), p.alloc(30)
    assert a == list(range(10)) and b == list(range(10, 30)) and c == list(range(30, 60))
    p.free(b)
    assert p.num_free_runs == 2  # the hole 10..30 and the tail 60..100
    assert p.alloc(15) == list(range(10, 25))  # the lowest run long enough
    assert p.alloc(40) == list(range(60, 100))  # the hole is too short: the tail
    p.free(a)
    p.free(list(range(10, 25)))
    p.free(c)
    p.check()
    assert p.num_free_runs == 1 and p.num_free == 60  # 0..60 merged back into one run
    assert p.alloc(60) == list(range(60))
    assert p.alloc(1) is None
    p.check()


def test_fragmented_alloc_takes_the_lowest_runs_and_never_sorts_the_whole_pool():
    p = pool(20)
    everything = p.alloc(20)
    p.free(everything[0:3] + everything[10:14] + everything[17:19])
    got = p.alloc(8)
    assert got == [0, 1, 2, 10, 11, 12, 13, 17]
    assert p.num_free == 1
    p.check()


def test_random_alloc_free_keeps_the_free_list_exact():
    rng = random.Random(0)
    p = pool(300)
    held: list[list[int]] = []
    for _ in range(2000):
        if held and rng.random() < 0.5:
            p.free(held.pop(rng.randrange(len(held))))
        else:
            got = p.alloc(rng.randint(1, 40))
            if got is not None:
                held.append(got)
        taken = [s for h in held for s in h]
        assert len(taken) == len(set(taken)) == p.num_used
    p.check()
    assert sorted(s for h in held for s in h) == sorted(set(range(300)) - _free_slots(p))


def _free_slots(p: KVPool) -> set[int]:
    free = set()
    for start in p._starts:
        free.update(range(start, start + p._run_len[start]))
    return free


def test_rebuild_keeps_data_and_renumbers_in_order():
    p = pool(50)
    slots = p.alloc(50)
    for layer in range(p.num_layers):
        p.k[layer][:, slots] = torch.arange(50, dtype=torch.float32).view(1, 50, 1) + 100 * layer
    keep = [40, 3, 17]
    mapping = p.rebuild(10 * p.bytes_per_token, keep)
    assert mapping == {40: 0, 3: 1, 17: 2} and p.capacity == 10 and p.num_free == 7
    for layer in range(p.num_layers):
        assert p.k[layer][0, :3, 0].tolist() == [40 + 100 * layer, 3 + 100 * layer, 17 + 100 * layer]
    assert contiguous_runs(p.alloc(7)) == [(0, 3, 7)]
    p.check()
