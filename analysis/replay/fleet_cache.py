"""The fleet simulator's caches: every replica's prefix cache in whole blocks, and one index of who holds what.

A SIMULATION, model-free and block-level (vLLM's automatic prefix caching, not this engine's token
tree): a sequence is cut into blocks of ``block_tokens`` and each whole block is named by a chained
hash (the hash of the previous block's name and this block's token ids), so a block's name stands
for the whole prefix up to its end. A replica holds a set of names under a budget in blocks and
evicts the least recently used first.

Why blocks and not ``analysis.replay.sim_cache.SimCache``: the token tree costs tens of microseconds
per request per replica in Python, and the fleet runs must route 100,000 requests over 64 replicas
in seconds. With ``block_tokens=1`` the blocks are tokens and a single replica reuses exactly what
SimCache reuses while nothing is evicted (the tests check it); with eviction the two differ only in
what they drop (SimCache a whole leaf node, this one leaf blocks).

Invariant: a request touches its blocks from the last to the first, so a block is always at least as
recent as any block after it in a sequence; the least recently used block is therefore a leaf, and
eviction never leaves a block whose prefix is gone (a match can stop at the first miss).

``holders`` maps a block's name to a bitmask of the replicas holding it: the longest prefix over the
whole fleet is then one walk over the request's blocks, whatever the number of replicas, and the
duplication (blocks held more than once) is read off the masks. Knows nothing about routing,
tokenizers or logs.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple


def chain_hashes(ids: Sequence[int], block_tokens: int, parent: int = 0) -> array:
    """The chained names of the whole blocks of ``ids`` (a partial last block has none),
    continuing from ``parent`` (0: the start of a sequence)."""
    out = array("q")
    h = parent
    for start in range(0, len(ids) - block_tokens + 1, block_tokens):
        h = hash((h, *ids[start:start + block_tokens]))
        out.append(h)
    return out


class BlockChain:
    """A growing sequence kept as the names of its whole blocks and the tokens of its partial last
    block, so that extending a long conversation hashes only the new tokens. Immutable: ``extend``
    returns a new chain (the names are copied, never shared with a chain that may grow again)."""

    __slots__ = ("block_tokens", "hashes", "tail", "num_tokens")

    def __init__(self, block_tokens: int, hashes: array | None = None, tail: tuple[int, ...] = (),
                 num_tokens: int = 0) -> None:
        self.block_tokens = block_tokens
        self.hashes = hashes if hashes is not None else array("q")
        self.tail = tail
        self.num_tokens = num_tokens

    def extend(self, ids: Sequence[int]) -> BlockChain:
        pending = (*self.tail, *ids)
        whole = len(pending) - len(pending) % self.block_tokens
        hashes = array("q", self.hashes)
        hashes.extend(chain_hashes(pending[:whole], self.block_tokens, self.hashes[-1] if self.hashes else 0))
        return BlockChain(self.block_tokens, hashes, pending[whole:], self.num_tokens + len(ids))


class Duplication(NamedTuple):
    held_blocks: int  # summed over replicas: the memory in use
    distinct_blocks: int  # different blocks held anywhere
    shared_blocks: int  # distinct blocks held on two replicas or more
    extra_copies: int  # held_blocks - distinct_blocks: the memory duplication costs

    @property
    def share(self) -> float:
        """The share of the fleet's cache memory spent on second and later copies."""
        return self.extra_copies / self.held_blocks if self.held_blocks else 0.0


class ReplicaCaches:
    """``replicas`` LRU block caches of ``budget_blocks`` each (None: no limit), and the holders index."""

    def __init__(self, replicas: int, budget_blocks: int | None) -> None:
        if replicas < 1:
            raise ValueError("a fleet needs at least one replica")
        self.lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(replicas)]
        self.holders: dict[int, int] = {}
        self.budget_blocks = budget_blocks
        self.all_mask = (1 << replicas) - 1
        self.evicted_blocks = 0

    @property
    def replicas(self) -> int:
        return len(self.lru)

    def held(self, replica: int) -> int:
        return len(self.lru[replica])

    def longest(self, blocks: Sequence[int], stop: int) -> tuple[int, int]:
        """``(depth, mask)``: the most leading blocks of ``blocks[:stop]`` any one replica holds,
        and the replicas that hold that many (every replica when the depth is 0). Touches nothing."""
        holders, mask, depth = self.holders, self.all_mask, 0
        for i in range(min(stop, len(blocks))):
            m = holders.get(blocks[i], 0) & mask
            if not m:
                break
            mask, depth = m, depth + 1
        return depth, mask

    def depth(self, replica: int, blocks: Sequence[int]) -> int:
        """How many leading blocks of ``blocks`` ``replica`` holds. Touches nothing."""
        lru, n = self.lru[replica], 0
        for h in blocks:
            if h not in lru:
                break
            n += 1
        return n

    def store(self, replica: int, blocks: Sequence[int], held: int) -> int:
        """``replica`` ran a request that leaves ``blocks`` cached, of which it held the first
        ``held`` (``depth``): add the rest, touch all from last to first, evict down to the
        budget. Returns the blocks evicted."""
        lru, bit, holders = self.lru[replica], 1 << replica, self.holders
        for i in range(len(blocks) - 1, held - 1, -1):
            h = blocks[i]
            lru[h] = None
            holders[h] = holders.get(h, 0) | bit
        for i in range(held - 1, -1, -1):
            lru.move_to_end(blocks[i])
        over = len(lru) - self.budget_blocks if self.budget_blocks is not None else 0
        for _ in range(over):
            h, _ = lru.popitem(last=False)
            m = holders[h] & ~bit
            if m:
                holders[h] = m
            else:
                del holders[h]
        if over > 0:
            self.evicted_blocks += over
            return over
        return 0

    def duplication(self) -> Duplication:
        held = sum(len(x) for x in self.lru)
        shared = sum(1 for m in self.holders.values() if m & (m - 1))
        return Duplication(held, len(self.holders), shared, held - len(self.holders))

    def check_invariants(self) -> None:
        """Budgets hold, and the index says exactly which replica holds which block."""
        seen: dict[int, int] = {}
        for r, lru in enumerate(self.lru):
            if self.budget_blocks is not None and len(lru) > self.budget_blocks:
                raise AssertionError(f"replica {r} holds {len(lru)} blocks over a budget of {self.budget_blocks}")
            for h in lru:
                seen[h] = seen.get(h, 0) | (1 << r)
        if seen != self.holders:
            raise AssertionError("the holders index does not match the replicas' caches")
