"""The fleet simulator's routers: which replica a request goes to, under each policy.

Written from how vLLM's router (``vllm-router`` 0.1.17, the one ``tools/fleet`` runs) and SGLang's
describe their policies, in our own terms, over the simulator's state (``FleetState``: each
replica's requests in flight and its block cache):

- ``round_robin``: the next replica in turn.
- ``random``: a replica drawn from the run's seeded generator.
- ``consistent_hash``: a ring of ``VIRTUAL_NODES`` points per replica; the request's key (its
  session or user) goes to the first point at or after the key's own. Adding a replica moves only
  the keys that now land on its points (about 1/N of them).
- ``power_of_two``: two different replicas drawn at random, the one with fewer in flight.
- ``cache_aware``: the router's own approximate tree per replica of the prompts it sent there
  (not the replicas' caches: it never hears of an eviction, only of its own ``max_tree_tokens``).
  When the load is out of balance (most in flight minus fewest above ``balance_abs`` and most
  above ``balance_rel`` times fewest) the replica with fewest in flight; otherwise the replica whose
  tree matches the longest prefix, if that match is more than ``cache_threshold`` of the prompt,
  else the replica with the smallest tree. Defaults: vllm-router 0.1.17's (0.3, 64, 1.5).
- ``kv_aware``: the replicas' real caches (as their KV events tell), weighed against their load as
  vllm-router 0.1.17 weighs them: each replica's cost is the prompt tokens it would still have to
  compute (the prompt less the leading blocks it holds, at least the last token) times one more
  than its requests in flight; the cheapest wins, a tie to the lowest index. A long match on a
  busy replica can so lose to a shorter one on an idle replica.
- ``oracle``: the replica holding the most of the request, load ignored; a tie to the replica with
  the fewest blocks held (the most room). A greedy upper reference, not a proof of optimality;
  every run also records the per-request ceiling (the most any replica held).

Knows nothing about tokenizers, logs or the load model's numbers.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from analysis.replay.fleet_cache import ReplicaCaches

POLICIES = ("round_robin", "random", "consistent_hash", "power_of_two", "cache_aware", "kv_aware", "oracle")
VIRTUAL_NODES = 160


@dataclass
class FleetState:
    """What a router may look at: requests in flight per replica and the replicas' caches."""
    caches: ReplicaCaches
    loads: list[int]
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    @property
    def replicas(self) -> int:
        return len(self.loads)

    def least_loaded(self, mask: int | None = None) -> int:
        """The replica with the fewest in flight among ``mask`` (None: all); ties to the lowest index."""
        loads = self.loads
        if mask is None or mask == self.caches.all_mask:
            return min(range(len(loads)), key=loads.__getitem__)
        return min(_bits(mask), key=lambda r: (loads[r], r))


class Policy(Protocol):
    name: str

    def choose(self, blocks: Sequence[int], prompt_blocks: int, prompt_tokens: int, key: str,
               state: FleetState) -> int:
        """The replica for a request whose prompt covers ``blocks[:prompt_blocks]`` whole blocks."""
        ...


def _bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, blocks: Sequence[int], prompt_blocks: int, prompt_tokens: int, key: str,
               state: FleetState) -> int:
        r = self._next % state.replicas
        self._next = r + 1
        return r


class RandomPolicy:
    name = "random"

    def choose(self, blocks: Sequence[int], prompt_blocks: int, prompt_tokens: int, key: str,
               state: FleetState) -> int:
        return state.rng.randrange(state.replicas)


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    """``VIRTUAL_NODES`` points per replica on a 64-bit ring; a replica's points depend only on its
    index, so a fleet that grows keeps every old point."""

    def __init__(self, replicas: int, virtual_nodes: int = VIRTUAL_NODES) -> None:
        pairs = sorted((_point(f"replica-{r}#{v}"), r) for r in range(replicas) for v in range(virtual_nodes))
        self._points = [p for p, _ in pairs]
        self._owners = [r for _, r in pairs]

    def owner(self, key: str) -> int:
        i = bisect.bisect_left(self._points, _point(key))
        return self._owners[i % len(self._points)]


class ConsistentHash:
    name = "consistent_hash"

    def __init__(self) -> None:
        self._ring: HashRing | None = None

    def choose(self, blocks: Sequence[int], prompt_blocks: int, prompt_tokens: int, key: str,
               state: FleetState) -> int:
        if self._ring is None:
            self._ring = HashRing(state.replicas)
        return self._ring.owner(key)


class PowerOfTwo:
    name = "power_of_two"

    def choose(self, blocks: Sequence[int], prompt_blocks: int, prompt_tokens: int, key: str,
               state: FleetState) -> int:
        if state.replicas == 1:
            return 0
        a, b = state.rng.sample(range(state.replicas), 2)
        return b if state.loads[b] < state.loads[a] else a


class CacheAware:
    name = "cache_aware"

    def __init__(self, block_tokens: int, cache_threshold: float = 0.3, balance_abs: int = 64,
                 balance_rel: float = 1.5, max_tree_tokens: int | None = 2**26 // 4) -> None:
        self.block_tokens = block_tokens
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel
        self.max_tree_tokens = max_tree_tokens
        self.trees: ReplicaCaches | None = None  # what the router sent where: prompts only

    def choose(self, blocks: Sequence[int], prompt_blocks: int, prompt_tokens: int, key: str,
               state: FleetState) -> int:
        if self.trees is None:
            cap = self.max_tree_tokens // self.block_tokens if self.max_tree_tokens is not None else None
            self.trees = ReplicaCaches(state.replicas, cap)
        lo, hi = min(state.loads), max(state.loads)
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            r = state.least_loaded()
        else:
            depth, mask = self.trees.longest(blocks, prompt_blocks)
            if prompt_tokens and depth * self.block_tokens / prompt_tokens > self.cache_threshold:
                r = state.least_loaded(mask)
            else:
                r = min(range(state.replicas), key=lambda i: (self.trees.held(i), i))
        sent = blocks[:prompt_blocks]
        self.trees.store(r, sent, self.trees.depth(r, sent))
        return r


class KvAware:
    name = "kv_aware"

    def __init__(self, block_tokens: int = 1) -> None:
        self.block_tokens = block_tokens

    def choose(self, blocks: Sequence[int], prompt_blocks: int, prompt_tokens: int, key: str,
               state: FleetState) -> int:
        prompt = blocks[:prompt_blocks]
        most = max(0, prompt_tokens - 1)  # the last token is computed for its logits whatever is held

        def cost(r: int) -> tuple[int, int]:
            to_compute = prompt_tokens - min(state.caches.depth(r, prompt) * self.block_tokens, most)
            return to_compute * (state.loads[r] + 1), r

        return min(range(state.replicas), key=cost)


class Oracle:
    name = "oracle"

    def choose(self, blocks: Sequence[int], prompt_blocks: int, prompt_tokens: int, key: str,
               state: FleetState) -> int:
        _, mask = state.caches.longest(blocks, prompt_blocks)
        return min(_bits(mask), key=lambda r: (state.caches.held(r), r))


def make_policy(name: str, block_tokens: int) -> Policy:
    """A fresh router (routers keep state: a turn, a ring, trees)."""
    makers = {"round_robin": RoundRobin, "random": RandomPolicy, "consistent_hash": ConsistentHash,
              "power_of_two": PowerOfTwo, "cache_aware": lambda: CacheAware(block_tokens),
              "kv_aware": lambda: KvAware(block_tokens),
              "oracle": Oracle}
    if name not in makers:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return makers[name]()
