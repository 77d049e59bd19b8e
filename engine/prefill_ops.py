"""The engine's synchronous prefills, outside the scheduler: ``PrefillOps``, a part of ``Engine``.

Owns: ``prefill`` (a scratch buffer, the cached prefix copied in, then cached: the start-up warm
start and the prefill benchmark's reuse path), ``cache_prefill``, ``scratch_prefill`` (the
``PrefillAPI`` primitive every no-reuse figure is measured with: a throwaway pool of exactly the
prompt, which neither reads the tree for reuse nor writes it) and ``prefill_in_pool`` (the
scheduler's way, synchronously, for tests and tools). Each runs on the compute thread, between
the scheduler's steps. Needs the engine's ``runner`` and ``cache``; knows nothing of requests,
streams or the inbox.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from engine.api import CachedPrefill, ScratchPrefill
from engine.kvcache.kv_pool import KVPool, contiguous_runs
from engine.model.paged_attention import PagedSegment
from engine.types import CacheKey, EngineError


class PrefillResult(NamedTuple):
    logits: torch.Tensor  # fp32 logits of the last prompt position
    cached_tokens: int
    prefill_ms: float
    inserted_tokens: int


class PrefillOps:
    """The prefills above, over ``self.runner`` and ``self.cache`` (the ``Engine``'s)."""

    def prefill(self, key: CacheKey, kv) -> PrefillResult:
        """Prefill ``key.ids`` into the empty scratch buffer ``kv``, reusing the longest cached
        prefix (copied into ``kv``), then cache the prompt. ``prefill_ms`` covers match, copy
        and forward. The prefill benchmark's reuse path and the start-up warm-up; the
        scheduler's requests read the pool in place instead."""
        return self.runner.compute.call(self._prefill, key, kv)

    def _prefill(self, key: CacheKey, kv) -> PrefillResult:
        runner = self.runner
        runner.synchronize()
        t0 = time.perf_counter()
        # At least one prompt token is always computed: its logits start the answer. On the
        # compute thread no step runs meanwhile, so the copied prefix cannot change.
        self.cache.load_prefix(key, len(key.ids) - 1)  # what the second tier holds comes back first
        cached = self.cache.copy_prefix(key, len(key.ids) - 1, kv, touch=True)
        logits = runner.forward_last(key.ids[cached:], kv)
        runner.synchronize()
        prefill_ms = (time.perf_counter() - t0) * 1000
        inserted = self.cache.insert(key, kv)
        return PrefillResult(logits, cached, prefill_ms, inserted)

    def cache_prefill(self, key: CacheKey) -> CachedPrefill:
        """``PrefillAPI.cache_prefill``: ``prefill`` into a scratch buffer of its own."""
        result = self.prefill(key, self.runner.new_request_kv(len(key.ids)))
        return CachedPrefill(result.cached_tokens, result.prefill_ms, result.inserted_tokens)

    def scratch_prefill(self, key: CacheKey, reuse_tokens: int = 0, block_tokens: int = 512,
                        before_block: Callable[[], None] | None = None) -> ScratchPrefill:
        """``PrefillAPI.scratch_prefill``: the scheduler's own forward (``forward_paged``, a GPU call
        on ZeroGPU) over a ``KVPool`` of exactly the prompt's tokens, outside the cache's budget::

            scratch pool:  [0 ...... reused) [reused ... block) [block ... n)
                            copied from the    one compute call   the next ...
                            cache (untimed)

        The copy is not timed: a request reads its cached prefix in place, copying is the
        scratch pool's cost only."""
        runner, ids, n = self.runner, key.ids, len(key.ids)
        if n == 0:
            raise EngineError("nothing to prefill: the prompt is empty")
        if n > runner.max_context:
            raise EngineError(f"{n:,} tokens, over the model's {runner.max_context:,}-token context")
        pool = KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype, runner.device,
                      n * runner.kv_bytes_per_token)
        slots = pool.alloc(n)
        assert slots is not None, "a scratch pool holds its prompt"
        runs = contiguous_runs(slots)
        block, reuse = max(1, int(block_tokens)), max(0, min(int(reuse_tokens), n - 1))

        def copy_prefix() -> int:  # read only, under the cache's own lock: no hit, no access time, no node locked
            kv = runner.new_request_kv(reuse)
            got = self.cache.copy_prefix(key, reuse, kv)
            if got:
                pool.write_from(slots[:got], kv.k, kv.v)
            return got

        def forward(start: int, stop: int) -> tuple[float, torch.Tensor | None]:
            runner.synchronize()
            t0 = time.perf_counter()
            logits = runner.forward_paged(pool, [PagedSegment(ids[start:stop], start, slots, runs)])[0]
            runner.synchronize()
            ms = (time.perf_counter() - t0) * 1000
            return ms, logits.detach().float().cpu().clone() if stop == n else None  # the last block's only

        reused = 0
        if reuse:
            if before_block is not None:
                before_block()
            reused = runner.compute.call(copy_prefix)
        forward_ms, pos, last = 0.0, reused, None
        while pos < n:
            if before_block is not None:
                before_block()
            stop = min(n, pos + block)
            ms, last = runner.compute.call(forward, pos, stop)
            forward_ms, pos = forward_ms + ms, stop
        return ScratchPrefill(forward_ms, reused, last)

    def prefill_in_pool(self, key: CacheKey) -> PrefillResult:
        """Prefill ``key.ids`` the scheduler's way, synchronously: the cached prefix is read in
        place from the pool, the rest is computed into pool slots of its own, which then pass
        to the tree. ``prefill_ms`` covers match, slot bookkeeping, forward and hand-over; the
        prefill benchmark's engine path (for tests and tools)."""
        return self.runner.compute.call(self._prefill_in_pool, key)

    def _prefill_in_pool(self, key: CacheKey) -> PrefillResult:
        runner = self.runner
        runner.synchronize()
        t0 = time.perf_counter()
        rs = self.cache.acquire(key, len(key.ids) - 1, len(key.ids))
        if rs is None:
            raise EngineError("no room in the cache for this prompt now")
        try:
            segment = PagedSegment(key.ids[rs.cached_tokens:], rs.cached_tokens, rs.slots, rs.runs())
            logits = runner.forward_paged(self.cache.pool, [segment])[0]
            runner.synchronize()
            rs.length = len(key.ids)
            inserted = self.cache.adopt(rs, key)
        finally:
            self.cache.release(rs)
        prefill_ms = (time.perf_counter() - t0) * 1000
        return PrefillResult(logits, rs.cached_tokens, prefill_ms, inserted)
