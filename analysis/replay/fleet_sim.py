"""The fleet simulator: a request trace routed over N replicas, each with its own prefix cache.

    run = simulate_fleet(requests, replicas=16, policy="cache_aware", budget_tokens=250_000)
    run.hit_rate, run.ceiling_rate, run.duplication.share, run.imbalance, run.seconds

A SIMULATION, model-free: no tokens are computed and nothing is timed but the simulator itself.
Each request (``SimRequest``: the chained block names of its prompt and answer, from
``analysis.replay.fleet_trace``) is routed by a policy (``analysis.replay.fleet_policies``) to one
replica, reuses that replica's longest cached prefix (whole blocks, at most all but one prompt
token), and leaves its prompt and answer cached there, evicting least recently used leaf blocks
down to the replica's budget (``analysis.replay.fleet_cache``: block-level, as vLLM's prefix cache).

The load model, so that load-aware policies have something to balance: requests arrive at their
trace times; each occupies its replica for ``uncached prompt tokens / prefill_tokens_per_s +
output tokens / decode_tokens_per_s`` seconds, all of a replica's requests at once (continuous
batching, no queue); a replica's load is its requests in flight, which is what vllm-router counts.
Deterministic: the only randomness (``random``, ``power_of_two``) draws from ``seed``.

Per run: hit rate (cached / prompt tokens), the ceiling (per request, the most any replica held
just before it was routed: what a perfect router would have reused on this run's caches),
duplication at the end of the run (blocks held on more than one replica, and the memory the extra
copies take as a share of all held), imbalance (most requests on a replica over the mean), seconds.
"""

from __future__ import annotations

import heapq
import random
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from analysis.replay.fleet_cache import Duplication, ReplicaCaches
from analysis.replay.fleet_policies import FleetState, Policy, make_policy


@dataclass(frozen=True, slots=True)
class SimRequest:
    blocks: array  # chained names of the whole blocks of prompt + answer: what it leaves cached
    prompt_tokens: int
    output_tokens: int
    key: str  # the session or user: what consistent_hash hashes
    arrival_s: float


@dataclass(frozen=True)
class LoadModel:
    prefill_tokens_per_s: float = 8_000.0
    decode_tokens_per_s: float = 50.0  # one request's decode rate, whatever else runs beside it

    def busy_s(self, uncached_tokens: int, output_tokens: int) -> float:
        return uncached_tokens / self.prefill_tokens_per_s + output_tokens / self.decode_tokens_per_s


@dataclass
class FleetRun:
    policy: str
    replicas: int
    block_tokens: int
    budget_tokens: int | None
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ceiling_tokens: int = 0
    evicted_tokens: int = 0
    per_replica: list[int] | None = None
    duplication: Duplication = Duplication(0, 0, 0, 0)
    peak_load: int = 0
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ceiling_rate(self) -> float:
        return self.ceiling_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def imbalance(self) -> float:
        """Most requests on one replica over the mean (1.0: perfectly even)."""
        counts = self.per_replica or []
        return max(counts) * len(counts) / sum(counts) if counts and sum(counts) else 0.0


def simulate_fleet(requests: list[SimRequest], replicas: int, policy: str | Policy, budget_tokens: int | None,
                   block_tokens: int = 16, load: LoadModel = LoadModel(), seed: int = 0,
                   on_request: Callable[[SimRequest, int, int, ReplicaCaches], None] | None = None) -> FleetRun:
    """Route ``requests`` (in arrival order) over ``replicas`` replicas of ``budget_tokens`` each
    (None: no limit). ``on_request(request, replica, cached_tokens, caches)`` is called after each."""
    started = time.perf_counter()
    router = make_policy(policy, block_tokens) if isinstance(policy, str) else policy
    caches = ReplicaCaches(replicas, budget_tokens // block_tokens if budget_tokens is not None else None)
    state = FleetState(caches, [0] * replicas, random.Random(seed))
    loads, finishing = state.loads, []  # (finish time, replica)
    run = FleetRun(router.name, replicas, block_tokens, budget_tokens, per_replica=[0] * replicas)
    for req in requests:
        while finishing and finishing[0][0] <= req.arrival_s:
            loads[heapq.heappop(finishing)[1]] -= 1
        prompt_blocks = req.prompt_tokens // block_tokens
        usable = max(0, req.prompt_tokens - 1) // block_tokens  # at least one prompt token is computed
        best, _ = caches.longest(req.blocks, usable)
        r = router.choose(req.blocks, prompt_blocks, req.prompt_tokens, req.key, state)
        held = caches.depth(r, req.blocks)
        cached = min(held, usable) * block_tokens
        run.evicted_tokens += caches.store(r, req.blocks, held) * block_tokens
        run.requests += 1
        run.prompt_tokens += req.prompt_tokens
        run.cached_tokens += cached
        run.ceiling_tokens += best * block_tokens
        run.per_replica[r] += 1
        loads[r] += 1
        run.peak_load = max(run.peak_load, loads[r])
        heapq.heappush(finishing, (req.arrival_s + load.busy_s(req.prompt_tokens - cached, req.output_tokens), r))
        if on_request is not None:
            on_request(req, r, cached, caches)
    run.duplication = caches.duplication()
    run.seconds = time.perf_counter() - started
    return run
