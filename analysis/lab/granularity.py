"""Granularity: what a paged engine's block matching would reuse on the same trace.

A SIMULATION, labelled as such wherever it is shown: it runs the pure
``RadixTree`` (no model, no KV: ``value=[None] * n``) over real token ids, once
per granularity, with no budget (nothing is evicted):

- per token (block size 1), as this engine and SGLang's RadixAttention do: a
  request reuses its longest cached prefix;
- in blocks of B tokens, as paged engines (vLLM's prefix caching) do: only full
  blocks are cached and matched, so a request reuses its longest cached prefix
  rounded down to a multiple of B, and a prompt's last partial block is never
  cached.

Both keep the engine's rule that at least one prompt token is computed.
::

    tokens:  |<------------- cached prefix, per token ------------->|
    blocks:  [  B  ][  B  ][  B  ][  B  ][  B  ]|<- lost to alignment ->|

Knows nothing about the UI; the tree's own ``match``/``insert`` do the work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.kvcache.radix_tree import RadixTree
from engine.types import CacheKey

DEFAULT_BLOCK_SIZES = (1, 16, 64)


@dataclass(frozen=True)
class GranularityResult:
    block_size: int
    cached_per_request: tuple[int, ...]
    prompt_tokens_per_request: tuple[int, ...]

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached_per_request)

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompt_tokens_per_request)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def simulate_blocks(prompts: Sequence[Sequence[int]], block_size: int,
                    inserted: Sequence[Sequence[int]] | None = None) -> GranularityResult:
    """Cached tokens per request when matching in blocks of ``block_size`` tokens.

    ``inserted[i]`` is what request ``i`` leaves in the cache (its prompt, plus the
    output tokens the engine forwarded); by default its prompt.
    """
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    if inserted is not None and len(inserted) != len(prompts):
        raise ValueError("one inserted sequence per prompt")
    tree = RadixTree()
    cached: list[int] = []
    for i, ids in enumerate(prompts):
        ids = tuple(ids)
        usable = _floor(max(0, len(ids) - 1), block_size)  # at least one token is computed
        m = tree.match(CacheKey(ids), max_len=usable)
        cached.append(_floor(m.length, block_size))
        keep = tuple(inserted[i]) if inserted is not None else ids
        keep = keep[:_floor(len(keep), block_size)]  # only full blocks are cached
        if keep:
            tree.insert(CacheKey(keep), [None] * len(keep))
    return GranularityResult(block_size, tuple(cached), tuple(len(p) for p in prompts))


def compare_granularity(prompts: Sequence[Sequence[int]], block_sizes: Sequence[int] = DEFAULT_BLOCK_SIZES,
                        inserted: Sequence[Sequence[int]] | None = None) -> list[GranularityResult]:
    return [simulate_blocks(prompts, b, inserted) for b in block_sizes]


def tokens_lost_to_alignment(results: Sequence[GranularityResult]) -> dict[int, int]:
    """Per block size: cached tokens per token granularity minus cached tokens in blocks."""
    per_token = next((r for r in results if r.block_size == 1), None)
    if per_token is None:
        raise ValueError("include block size 1 (per token) to measure what alignment loses")
    return {r.block_size: per_token.cached_tokens - r.cached_tokens for r in results}


def _floor(n: int, block: int) -> int:
    return n - n % block
