"""The second tier's rules, as the prefix cache sees them: keys, what may be written, spill, load,
the persisted paths and the view of what the tier holds.

Owns: the chunk keys (which name a whole prefix, with the fingerprint of what the KV depends
on), the rule of what may be written under which mode, the running totals of what moved, and
the ``SpilledTree`` the tree view draws. Knows nothing about the radix tree's nodes or the
pool's free list: ``RadixCache`` hands it token paths and the pool's KV, and asks it for the
chunks after a match. The bytes, their files and the trust rule for files live in the store
(``engine.kvcache.kv_tier``).

A path and its chunks (``C`` = ``CHUNK_TOKENS``)::

    positions: [0 .......... C) [C ......... 2C) [2C ... end)
    chunk key:  key(ids[:C])     key(ids[:2C])    (a partial last chunk is never kept)

What may be written: everything when the cache is shared (one public deployment's
visitors share the tree anyway); with ``public_only`` (isolation mode) only chunks whose
whole prefix is ``PUBLIC`` (shipped content), so no visitor's private tokens ever reach a
file, and a later run, whatever its mode, cannot show them. The store's folder is named by
the mode too (``engine.tier_setup.make_tier``), so an isolated run never reads a shared run's
chunks or paths.

Not thread-safe on its own: the cache calls it under the cache's lock. The store is
thread-safe, and its ``on_drop`` may come from any thread (``SpilledTree.dropped`` only
queues it). A spill does no I/O: it hands the chunks to the store's queue
(``ChunkStore.put_later``: findable at once, served from the queued tensor until written), and
the cache has them written once it has released its lock (``write_queued``). When the queue is
full a chunk is not kept (the KV is simply evicted) and ``spill`` says so, so ``persist`` can
write what is left after the queue drains.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from engine.kvcache.kv_pool import KVPool
from engine.kvcache.kv_tier import CHUNK_TOKENS, ChunkStore, chunk_key
from engine.kvcache.radix_tree import Node, RadixTree
from engine.kvcache.spilled_tree import SpilledTree
from engine.types import PUBLIC, CacheKey, NodeInfo

log = logging.getLogger(__name__)


class SecondTier:
    def __init__(self, store: ChunkStore, fingerprint: str, public_only: bool) -> None:
        """``store`` keeps the bytes; ``fingerprint`` names what the KV depends on (model,
        weights, dtype, tokenizer, geometry); ``public_only``: isolation mode (see the module
        docstring). Marks the paths a previous run saved, as far as the store still holds them."""
        self.store, self.fingerprint, self.public_only = store, fingerprint, public_only
        self.spilled = SpilledTree()
        self.listener = None  # KV events (engine.kvcache.kv_events.KVEventPublisher): what the tier holds
        store.on_drop = self._dropped
        self.loaded_tokens = self.spilled_tokens = 0  # running totals
        self.load_ms = 0.0  # reading chunks and writing them into the pool, never eviction's writes
        self._restore_paths()

    @property
    def kind(self) -> str:
        return self.store.kind

    # ------------------------------------------------------------- keys and rules
    def may_keep(self, namespace: str, public_len: int, end: int) -> bool:
        """Whether the chunk ending at ``end`` of a path may be written (see the module docstring)."""
        return not (self.public_only and namespace != PUBLIC and end > public_len)

    def key_of(self, path: CacheKey, end: int) -> str:
        """The store's key of the chunk of ``path`` ending at ``end``."""
        public = end if path.namespace == PUBLIC else min(path.public_len, end)
        namespace = path.namespace if end > public else PUBLIC
        return chunk_key(self.fingerprint, namespace, public, path.ids[:end])

    # ------------------------------------------------------------- spill
    def spill(self, path: CacheKey, slots: Sequence[int], start: int, pool: KVPool,
              handed: set[str] | None = None) -> bool:
        """``path``'s positions ``[start, len(path.ids))`` leave the pool (``slots`` hold the KV of
        the whole path, still intact): hand the store the whole chunks that end in that range
        (chunks ending earlier belong to the part above, which is spilled when it goes), a copy
        of each, written later (module docstring). False if the store's queue refused one.
        ``handed`` (persist's rounds): chunks handed over before, never again (one the store let
        go since is not kept); those handed over now are added."""
        end = len(path.ids)
        chunks: list[tuple[int, str, bool]] = []  # (chunk end, key, kept), for the tree view
        refused = self.store.refused_spills
        for stop in range((start // CHUNK_TOKENS + 1) * CHUNK_TOKENS, end + 1, CHUNK_TOKENS):
            if not self.may_keep(path.namespace, path.public_len, stop):
                break
            key = self.key_of(path, stop)
            kept = key in self.store
            if not kept and (handed is None or key not in handed):
                kept = self._put(key, pool, slots[stop - CHUNK_TOKENS:stop])
                if kept and handed is not None:
                    handed.add(key)
            chunks.append((stop, key, kept))
        if chunks:
            self.spilled.record(path.prefix(chunks[-1][0]), chunks)
            if self.listener is not None:
                self.listener.tier_kept(self, path, [stop for stop, _, kept in chunks if kept])
        return self.store.refused_spills == refused

    def publish_to(self, listener) -> None:
        """Tell ``listener`` what the tier holds now (paths of a previous run) and what it keeps and drops."""
        self.listener = listener
        for path in self.spilled.leaf_paths():
            listener.tier_kept(self, path, list(range(CHUNK_TOKENS, len(path.ids) + 1, CHUNK_TOKENS)))

    def _dropped(self, key: str) -> None:
        """The store's ``on_drop`` (any thread)."""
        self.spilled.dropped(key)
        if self.listener is not None:
            self.listener.tier_dropped(key)

    def _put(self, key: str, pool: KVPool, slots: Sequence[int]) -> bool:
        if not self.store.put_later(key, pool.gather(slots)):  # gather copies: the store owns the tensor
            return False
        self.spilled_tokens += CHUNK_TOKENS
        return True

    def settle(self) -> None:
        """Apply what the store dropped meanwhile to the spilled view (call after spills, before views)."""
        self.spilled.apply_drops(self.store.__contains__)

    # ------------------------------------------------------------- load
    def chunks_after(self, key: CacheKey, cached: int, max_len: int) -> list[tuple[int, str]]:
        """The chunks after the first ``cached`` tokens of ``key`` that the store holds, in order
        and without a gap, within ``max_len``: ``(chunk end, chunk key)`` pairs. Reads no file."""
        if not self.store.num_chunks:
            return []
        out = []
        stop = (cached // CHUNK_TOKENS + 1) * CHUNK_TOKENS
        while stop <= max_len and self.may_keep(key.namespace, key.public_len, stop):
            chunk = self.key_of(key, stop)
            if chunk not in self.store:
                break
            out.append((stop, chunk))
            stop += CHUNK_TOKENS
        return out

    def read(self, keys: list[tuple[int, str]]) -> list[tuple[int, torch.Tensor]]:
        """The chunks' KV, up to the first that cannot be read (a bad file is dropped by the store)."""
        out = []
        for stop, chunk in keys:
            kv = self.store.get(chunk)
            if kv is None:
                break
            out.append((stop, kv))
        return out

    def load_into(self, pool: KVPool, slots: Sequence[int], cached: int,
                  chunks: list[tuple[int, torch.Tensor]]) -> None:
        """Write read ``chunks`` after the first ``cached`` tokens into ``slots`` (one per position
        from ``cached`` to the last chunk's end); a chunk's head that is in memory already is skipped."""
        pos = 0
        for stop, kv in chunks:
            part = kv[:, :, :, max(0, cached - (stop - CHUNK_TOKENS)):]
            n = part.shape[3]
            pool.scatter(slots[pos:pos + n], part)
            pos += n
        self.loaded_tokens += pos

    # ------------------------------------------------------------- persistence
    def write_queued(self) -> None:
        """Write the chunks spills handed over (call without the cache's lock: it does the I/O)."""
        self.store.write_queued()

    def paths_to_save(self) -> list[CacheKey]:
        """The spilled paths, for ``store.write_paths`` (under the cache's lock; the write after it)."""
        self.settle()
        return self.spilled.leaf_paths()

    def save_paths(self) -> None:
        """Write the spilled paths beside the chunks, so the next start draws what the store holds."""
        self.store.write_paths(self.paths_to_save())

    def _restore_paths(self) -> None:
        """Mark each saved path as far as the store still holds its chunks (keys recomputed, so a
        stale or foreign path marks nothing; the store validated the file)."""
        for path in self.store.read_paths():
            chunks = []
            for stop in range(CHUNK_TOKENS, len(path.ids) + 1, CHUNK_TOKENS):
                if not self.may_keep(path.namespace, path.public_len, stop):
                    break
                key = self.key_of(path, stop)
                chunks.append((stop, key, key in self.store))
            if chunks:
                self.spilled.record(path.prefix(chunks[-1][0]), chunks)

    # ------------------------------------------------------------- views and checks
    def infos(self, resident: RadixTree, now: float, bytes_per_token: int) -> list[NodeInfo]:
        self.settle()
        return self.spilled.infos(resident, now, bytes_per_token)

    def check(self) -> None:
        self.settle()
        self.spilled.check(self.store.__contains__, self.key_of)

    def stats(self) -> dict:
        store = self.store
        return dict(tier_bytes=store.bytes_in_use, tier_budget_bytes=store.budget_bytes, tier_chunks=store.num_chunks,
                    tier_loaded_tokens=self.loaded_tokens, tier_spilled_tokens=self.spilled_tokens,
                    tier_bytes_read=store.bytes_read, tier_bytes_written=store.bytes_written, tier_kind=store.kind,
                    tier_queued_bytes=store.queued_bytes, tier_queue_bound_bytes=store.max_queued_bytes)


def path_of(node: Node, root: Node) -> tuple[CacheKey, list]:
    """The path from ``root`` to the end of ``node`` and its slots: the key the tier spills it under
    (its ancestors may be removed in the same eviction: their links and slots are intact until the
    slots are freed)."""
    chain = []
    while node is not None and node is not root:
        chain.append(node)
        node = node.parent
    ids, slots, public, namespace = [], [], 0, PUBLIC
    for n in reversed(chain):
        ids.extend(n.key)
        slots.extend(n.value)
        if n.namespace == PUBLIC:
            public += len(n.key)
        else:
            namespace = n.namespace
    return CacheKey(tuple(ids), namespace, public), slots
