"""The prefix cache: the radix tree over the one KV pool, behind one lock.

Owns: every pool slot's owner. A slot is free, or held by the tree (cached
KV, any request may reuse it), or held by one running request (the KV it
computes). Running requests read the tree's slots for their cached prefix in
place, never a copy; at the end their own slots pass to the tree, no copy
either. So the pool's byte count is all the KV the process holds, and the
budget is a physical bound. Two implementations share one interface, so
comparing with and without reuse is one constructor argument:

- ``RadixCache``: any prefix of anything cached before is reused.
- ``NoPrefixCache``: nothing is ever reused or stored (requests still hold
  their own KV in the pool).

A running request's KV, as ``RequestSlots``::

    positions: [0 ........ tree_len) [tree_len ........ length) [length .. len(slots))
    slots:      the tree's, locked     its own, computed          its own, not yet written

Contract: slots of a ``RequestSlots`` are valid until ``release``; the tree's
part cannot be evicted meanwhile. A budget change renumbers slots and updates
every live ``RequestSlots`` in place, so only this module keeps slot numbers
across steps.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from engine.kvcache.kv_pool import KVPool, contiguous_runs
from engine.kvcache.kv_tier import CHUNK_TOKENS, ChunkStore, chunk_key
from engine.kvcache.radix_tree import Node, RadixTree
from engine.kvcache.request_kv import RequestKV
from engine.kvcache.spilled_tree import SpilledTree
from engine.snapshot_view import for_viewer, node_infos, with_text
from engine.types import PUBLIC, CacheKey, EngineError, TreeSnapshot

log = logging.getLogger(__name__)


@dataclass(eq=False)
class RequestSlots:
    """A running request's KV in the pool (see the module docstring's sketch)."""

    slots: list[int]
    tree_len: int  # positions [0, tree_len) are the tree's, locked through ``node``
    cached_tokens: int  # reused from the cache at admission
    path: tuple[int, ...]  # node ids of the match, root's child first
    node: Node | None
    length: int = 0  # positions whose KV is written
    tier_tokens: int = 0  # of the cached ones, loaded back from the second tier at admission
    tier_load_ms: float = 0.0
    _runs: list[tuple[int, int, int]] | None = field(default=None, repr=False)

    @property
    def own_tokens(self) -> int:
        """Slots this request holds itself (computed or not yet written)."""
        return len(self.slots) - self.tree_len

    def runs(self) -> list[tuple[int, int, int]]:
        """``contiguous_runs(slots)``, kept until the slots change."""
        if self._runs is None:
            self._runs = contiguous_runs(self.slots)
        return self._runs


class PrefixCache(Protocol):
    """What the engine asks of a prefix cache. ``RadixCache`` and ``NoPrefixCache``
    implement it; the engine and the UI (through the engine) see nothing else.

    Every method is thread-safe. Token counts are in tokens of ``key.ids``.
    """

    enabled: bool
    pool: KVPool

    def acquire(self, key: CacheKey, max_len: int, total_tokens: int) -> RequestSlots | None:
        """Admit a request of ``total_tokens`` positions (prompt plus new tokens): reuse the
        longest cached prefix of ``key.ids[:max_len]`` (locked until ``release``) and take
        slots of its own for the rest, evicting unlocked entries for room (by fair share for
        ``key.namespace`` in isolation mode: a visitor never evicts shipped content, nor a
        visitor within their share). None, with nothing changed (no hit counted, no access
        time, no split, nothing evicted), when there is no room."""

    def adopt(self, rs: RequestSlots, key: CacheKey) -> int:
        """Cache the first ``min(len(key.ids), rs.length)`` positions of ``rs`` under ``key``:
        its own slots pass to the tree (no copy), positions someone else cached meanwhile
        switch to the tree's slots (its duplicates are freed), and the lock moves to the
        node ending there. Returns tokens newly stored."""

    def release(self, rs: RequestSlots) -> None:
        """Free ``rs``'s own slots and unlock its cached part. Exactly once per ``acquire``."""

    def insert(self, key: CacheKey, kv: RequestKV) -> int:
        """Store the first ``min(len(key.ids), kv.length)`` tokens of a scratch buffer under
        ``key`` (copied into free slots), evicting unlocked least-recently-used entries for
        room; stores the longest prefix that fits. Returns tokens newly stored."""

    def match_len(self, key: CacheKey) -> int:
        """Cached length of ``key.ids`` now. Does not modify the tree or access times."""

    def copy_prefix(self, key: CacheKey, max_len: int, kv: RequestKV, touch: bool = False) -> int:
        """Copy the KV of the longest cached prefix of ``key.ids[:max_len]`` into the empty
        scratch buffer ``kv`` (for timings and tools). With ``touch`` the match counts as a
        hit (access time, hits); nothing is locked. Returns the copied length."""

    def clear(self, namespace: str | None = None) -> int:
        """Evict every unlocked entry (only ``namespace``'s, if given); returns tokens freed."""

    def set_budget(self, budget_bytes: int) -> int:
        """Resize to ``budget_bytes``, evicting as needed; returns tokens evicted. Raises
        ``EngineError`` when running requests and locked entries alone exceed it."""

    @property
    def budget_bytes(self) -> int: ...

    @property
    def bytes_per_token(self) -> int: ...

    @property
    def bytes_in_use(self) -> int:
        """Pool bytes held: by the tree and by running requests."""

    @property
    def tree_bytes(self) -> int: ...

    @property
    def running_tokens(self) -> int:
        """Slots held by running requests themselves (not the tree's)."""

    @property
    def shared_tokens(self) -> int:
        """Cached tokens read by more than one running request right now."""

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_nodes(self) -> int: ...

    @property
    def evicted_tokens(self) -> int:
        """Tokens evicted since start (a running total)."""

    def locked_tokens(self) -> int:
        """Cached tokens pinned by running requests right now."""

    version: int  # changes whenever anything ``snapshot`` or the counters show could have

    def check_invariants(self) -> None:
        """Assert the cache is consistent (tests call it after every operation)."""

    def snapshot(self, decode: Callable[[Sequence[int]], str] | None = None, viewer: str | None = None,
                 max_text_tokens: int = 256) -> TreeSnapshot:
        """A read-only copy as plain data; with ``viewer`` set, other namespaces' nodes
        are hidden (shape and size only). Nodes whose KV is in the second tier, not in the
        pool, are there too, marked ``spilled`` (never counted in the pool's tokens)."""


class RadixCache:
    enabled = True

    def __init__(self, pool: KVPool, fair_share: bool = False, tier: ChunkStore | None = None,
                 fingerprint: str = "") -> None:
        """``fair_share`` (isolation mode): a visitor's insert evicts by the tree's fair
        share policy, and never evicts ``PUBLIC`` (shipped) content. ``tier``: the second
        tier evicted KV goes to (whole chunks; in isolation mode shipped content only),
        keyed with ``fingerprint`` (what the KV depends on: model, dtype, tokenizer)."""
        self.pool = pool
        self.tree = RadixTree()
        self.fair_share = fair_share
        self.tier, self.fingerprint = tier, fingerprint
        self.spilled = SpilledTree()  # what the tier holds, for the tree view (``engine.kvcache.spilled_tree``)
        if tier is not None:
            tier.on_drop = self.spilled.dropped
            self._restore_paths()
        self._lock = threading.RLock()
        self._live: set[RequestSlots] = set()  # acquired, not released
        self._running_tokens = 0  # own slots of the live ones
        self.tier_loaded_tokens = self.tier_spilled_tokens = 0  # running totals
        self.tier_load_ms = 0.0
        self.version = 0  # bumped by every change of the tree, its locks or the budget (panels compare it)

    # ---------------------------------------------------------------- facts
    @property
    def bytes_per_token(self) -> int:
        return self.pool.bytes_per_token

    @property
    def budget_bytes(self) -> int:
        return self.pool.budget_bytes

    @property
    def bytes_in_use(self) -> int:
        return self.pool.bytes_in_use

    @property
    def tree_bytes(self) -> int:
        return self.tree.num_tokens * self.pool.bytes_per_token

    @property
    def running_tokens(self) -> int:
        return self._running_tokens

    @property
    def shared_tokens(self) -> int:
        return self.tree.shared_tokens

    @property
    def num_tokens(self) -> int:
        return self.tree.num_tokens

    @property
    def num_nodes(self) -> int:
        return self.tree.num_nodes

    @property
    def evicted_tokens(self) -> int:
        return self.tree.evicted_tokens

    def locked_tokens(self) -> int:
        return self.tree.locked_tokens

    # ------------------------------------------------------------- room
    def _evict_for(self, short: int, namespace: str | None, incoming: int, removed: list[Node]) -> list:
        """Evict up to ``short`` tokens for ``namespace``'s ``incoming`` ones: by fair share for
        a visitor in isolation mode (shipped ``PUBLIC`` content is never evicted for a
        visitor), else least recently used. Returns the freed slots (not yet given back)."""
        if self.fair_share and namespace is not None and namespace != PUBLIC:
            return self.tree.evict(short, fair_for=namespace, capacity_tokens=self.pool.capacity,
                                   incoming_tokens=incoming, removed=removed)
        return self.tree.evict(short, removed=removed)

    def _make_room(self, num_slots: int, namespace: str | None) -> bool:
        """Evict until ``num_slots`` slots are free, all or nothing: False, with the tree as
        it was, when eviction cannot make that much room. Call with the lock held."""
        short = num_slots - self.pool.num_free
        if short <= 0:
            return True
        removed: list[Node] = []
        freed = self._evict_for(short, namespace, num_slots, removed)
        if len(freed) < short:
            self.tree.restore(removed)
            return False
        self._evicted(removed, freed)
        return True

    def _evicted(self, removed: Sequence[Node], freed: list) -> None:
        """Eviction is final: the removed nodes' KV goes to the second tier, then their slots
        are free. Call with the lock held, before anything reuses the slots."""
        if self.tier is not None:
            for node in removed:
                self._spill(node)
            self.spilled.apply_drops(self.tier.__contains__)
        self.pool.free(freed)

    # ------------------------------------------------------------- second tier
    def _path_of(self, node: Node) -> tuple[list[int], list, int, str]:
        """Token ids, slots, ``PUBLIC`` tokens and the private namespace from the root to the end
        of ``node`` (its ancestors may be removed in the same eviction: their links and slots
        are intact until the slots are freed)."""
        chain = []
        while node is not None and node is not self.tree.root:
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
        return ids, slots, public, namespace

    def _tier_key(self, ids, end: int, public_len: int, namespace: str) -> str:
        public = end if namespace == PUBLIC else min(public_len, end)
        ns = namespace if end > public else PUBLIC
        return chunk_key(self.fingerprint, ns, public, ids[:end])

    def _may_spill(self, namespace: str, public_len: int, end: int) -> bool:
        """On a public deployment no visitor's private tokens are ever written to the tier."""
        return not (self.fair_share and namespace != PUBLIC and end > public_len)

    def _spill(self, node: Node) -> None:
        """Keep the whole chunks that end inside ``node`` (chunks ending earlier belong to its
        ancestors, which go when they are evicted)."""
        ids, slots, public, namespace = self._path_of(node)
        end, start = len(ids), len(ids) - len(node.key)
        chunks: list[tuple[int, str, bool]] = []  # (chunk end, key, kept), for the tree view
        for i in range(start // CHUNK_TOKENS + 1, end // CHUNK_TOKENS + 1):
            stop = i * CHUNK_TOKENS
            if not self._may_spill(namespace, public, stop):
                break
            key = self._tier_key(ids, stop, public, namespace)
            chunks.append((stop, key, key in self.tier or self._put(key, slots[stop - CHUNK_TOKENS:stop])))
        if chunks:
            self.spilled.record(CacheKey(tuple(ids[:chunks[-1][0]]), namespace, public), chunks)

    def _put(self, key: str, slots: list) -> bool:
        """Write one chunk's KV (the pool's ``slots``) to the tier; whether it was kept."""
        idx = torch.tensor(slots, dtype=torch.long, device=self.pool.device)
        kv = torch.stack([torch.stack([layer.index_select(1, idx) for layer in half])
                          for half in (self.pool.k, self.pool.v)])
        if not self.tier.put(key, kv):
            return False
        self.tier_spilled_tokens += CHUNK_TOKENS
        return True

    def _path_chunk_key(self, path: CacheKey, stop: int) -> str:
        """The tier's key of the chunk ending at ``stop`` on ``path`` (a spilled tree's path)."""
        return self._tier_key(path.ids, stop, path.public_len, path.namespace)

    def _tier_keys(self, key: CacheKey, cached: int, max_len: int) -> list[tuple[int, str]]:
        """The chunks after the first ``cached`` tokens of ``key`` that the tier holds, in order
        and without a gap, within ``max_len``: ``(chunk end, chunk key)`` pairs. Reads no file."""
        if self.tier is None or not self.tier.num_chunks:
            return []
        out = []
        stop = (cached // CHUNK_TOKENS + 1) * CHUNK_TOKENS
        while stop <= max_len and self._may_spill(key.namespace, key.public_len, stop):
            chunk = self._tier_key(key.ids, stop, key.public_len, key.namespace)
            if chunk not in self.tier:
                break
            out.append((stop, chunk))
            stop += CHUNK_TOKENS
        return out

    def _tier_read(self, keys: list[tuple[int, str]]) -> list[tuple[int, torch.Tensor]]:
        """The chunks' KV, up to the first that cannot be read (a bad file is dropped by the tier)."""
        out = []
        for stop, chunk in keys:
            kv = self.tier.get(chunk)
            if kv is None:
                break
            out.append((stop, kv))
        return out

    def _load(self, key: CacheKey, cached: int, chunks: list[tuple[int, torch.Tensor]]) -> int:
        """Write loaded chunks after the first ``cached`` tokens into free slots (room was made)
        and cache them under ``key``. Returns the tokens loaded."""
        end = chunks[-1][0]
        slots = self.pool.alloc(end - cached)
        assert slots is not None, "room was made"
        pos = 0
        for stop, kv in chunks:
            skip = max(0, cached - (stop - CHUNK_TOKENS))  # the chunk's head is in memory already
            part = kv[:, :, :, skip:].to(self.pool.device)
            n = part.shape[3]
            idx = torch.tensor(slots[pos:pos + n], dtype=torch.long, device=self.pool.device)
            for layer in range(self.pool.num_layers):
                self.pool.k[layer].index_copy_(1, idx, part[0, layer])
                self.pool.v[layer].index_copy_(1, idx, part[1, layer])
            pos += n
        self.tree.insert(key.prefix(end), [-1] * cached + slots)
        self.tier_loaded_tokens += end - cached
        return end - cached

    def load_prefix(self, key: CacheKey, max_len: int) -> int:
        """Bring what the second tier holds of ``key.ids[:max_len]`` (after the part in memory)
        back into the pool and the tree; returns tokens loaded (0 without room)."""
        with self._lock:
            cached = self._match(key, max_len).length
            keys = self._tier_keys(key, cached, max_len)
            if not keys or not self._make_room(keys[-1][0] - cached, key.namespace):
                return 0
            chunks = self._tier_read(keys)
            self.version += 1
            return self._load(key, cached, chunks) if chunks else 0

    def offload(self) -> int:
        """Evict every unlocked entry to the second tier (for benchmarks and tests); tokens evicted."""
        with self._lock:
            removed: list[Node] = []
            freed = self.tree.evict(self.tree.num_tokens, removed=removed)
            self._evicted(removed, freed)
            self.version += 1
            return len(freed)

    def persist(self) -> int:
        """Write every cached chunk to the second tier (for a restart); returns chunks written."""
        if self.tier is None:
            return 0
        with self._lock:
            before = self.tier.stored_chunks
            for node in self.tree.nodes():
                self._spill(node)
            self.spilled.apply_drops(self.tier.__contains__)
            self._save_paths()
            return self.tier.stored_chunks - before

    def _save_paths(self) -> None:
        """Write the spilled paths next to the chunks (a temp name, then renamed), so the next
        start draws what the tier holds. Only what the tier may hold is in them (in isolation
        mode shipped content only, as for the chunks)."""
        target = self.tier.paths_file if self.tier is not None else None
        if target is None:
            return
        paths = [{"ids": list(p.ids), "namespace": p.namespace, "public_len": p.public_len}
                 for p in self.spilled.leaf_paths()]
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps({"version": 1, "paths": paths}))
            os.replace(tmp, target)
        except OSError as exc:
            log.warning("KV tier: could not write %s (%s); the tree will show the tier after the next load", target, exc)

    def _restore_paths(self) -> None:
        """At start: the paths a previous run saved, each marked as far as the tier still holds
        its chunks (keys recomputed, so a stale or foreign path marks nothing). A file that does
        not parse is skipped with one log line."""
        source = self.tier.paths_file if self.tier is not None else None
        if source is None or not source.exists():
            return
        try:
            saved = json.loads(source.read_text())["paths"]
            paths = [CacheKey(tuple(int(i) for i in p["ids"]), str(p["namespace"]), int(p["public_len"]))
                     for p in saved]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("KV tier: skipping %s (%s)", source.name, exc)
            return
        for path in paths:
            chunks = []
            for stop in range(CHUNK_TOKENS, len(path.ids) + 1, CHUNK_TOKENS):
                if not self._may_spill(path.namespace, path.public_len, stop):
                    break
                key = self._path_chunk_key(path, stop)
                chunks.append((stop, key, key in self.tier))
            if chunks:
                self.spilled.record(path.prefix(chunks[-1][0]), chunks)

    # ------------------------------------------------------------- requests
    def acquire(self, key: CacheKey, max_len: int, total_tokens: int) -> RequestSlots | None:
        with self._lock:
            t0 = time.perf_counter()
            m = self._match(key, max_len)
            # Room for the whole request past the memory match: the tier's chunks (read only once
            # room is made, so a request waiting for room reads no file) plus its own slots.
            keys = self._tier_keys(key, m.length, max_len)
            node, nodes_before = None, self.tree.num_nodes
            if m.length:
                # Protect exactly the match while making room: where the prompt leaves a node
                # mid-way, the node's unmatched rest must stay evictable. (A match cut short by
                # ``max_len`` goes on along the prompt itself: that node is locked whole.)
                capped = self.tree.match(key, touch=False).length > m.length
                node = m.node if capped else self._split_at(key, m.length)
                self.tree.lock(node)
            try:
                room = self._make_room(max(0, total_tokens - m.length), key.namespace)
            finally:
                if node is not None:
                    self.tree.unlock(node)
            if not room:
                if self.tree.num_nodes > nodes_before:
                    self.tree.unsplit(node)  # a failed admission leaves the tree as it found it
                return None
            chunks = self._tier_read(keys) if keys else []
            loaded = self._load(key, m.length, chunks) if chunks else 0
            cached = m.length + loaded
            own = max(0, total_tokens - cached)
            load_ms = (time.perf_counter() - t0) * 1000 if loaded else 0.0
            self.tier_load_ms += load_ms
            path: tuple[int, ...] = ()
            if loaded:
                node = self._split_at(key, cached)
            m = self.tree.match(key, max_len=cached) if cached else m
            if m.length:
                path = tuple(m.path)  # the match now counts: hits and access times
                self.tree.lock(node)
            slots = self.pool.alloc(own)
            assert slots is not None, "room was made"
            rs = RequestSlots(list(m.values) + slots, m.length, m.length, path, node, length=m.length,
                              tier_tokens=loaded, tier_load_ms=load_ms)
            self._live.add(rs)
            self._running_tokens += own
            self.version += 1
            return rs

    def _match(self, key: CacheKey, max_len: int):
        return self.tree.match(key, max_len=max_len, touch=False)

    def adopt(self, rs: RequestSlots, key: CacheKey) -> int:
        n = min(len(key.ids), rs.length)
        if n <= rs.tree_len:
            return 0
        with self._lock:
            existing = self.tree.match(key, max_len=n, touch=False)
            # Positions [tree_len, existing) were cached by someone else meanwhile: use theirs.
            duplicates = rs.slots[rs.tree_len:existing.length]
            rs.slots[rs.tree_len:existing.length] = existing.values[rs.tree_len:]
            self.pool.free(duplicates)
            node = self.tree.insert(key.prefix(n), rs.slots[:n]).node
            self.tree.lock(node)
            if rs.node is not None:
                self.tree.unlock(rs.node)
            stored = n - max(existing.length, rs.tree_len)
            self._running_tokens -= n - rs.tree_len
            rs.node, rs.tree_len, rs._runs = node, n, None
            self.version += 1
            return max(0, stored)

    def release(self, rs: RequestSlots) -> None:
        with self._lock:
            if rs not in self._live:
                return
            self._live.discard(rs)
            self.version += 1
            self.pool.free(rs.slots[rs.tree_len:])
            self._running_tokens -= rs.own_tokens
            if rs.node is not None:
                self.tree.unlock(rs.node)
            rs.node, rs.slots, rs._runs = None, rs.slots[:rs.tree_len], None

    def _split_at(self, key: CacheKey, length: int) -> Node:
        """The node that ends exactly ``length`` (cached) tokens into ``key``, splitting the
        node a match ends in: inserting an already-cached prefix only splits."""
        return self.tree.insert(key.prefix(length), [None] * length).node

    def match_len(self, key: CacheKey) -> int:
        with self._lock:
            return self._match(key, len(key.ids)).length

    def copy_prefix(self, key: CacheKey, max_len: int, kv: RequestKV, touch: bool = False) -> int:
        with self._lock:
            m = self.tree.match(key, max_len=max_len, touch=touch)
            if not m.length:
                return 0
            if touch:  # hits and access times changed: what the tree view shows
                self.version += 1
            k_dst, v_dst = kv.prefill_from(m.length)
            self.pool.read_into(m.values, k_dst, v_dst)
            return m.length

    def insert(self, key: CacheKey, kv: RequestKV) -> int:
        n = min(len(key.ids), kv.length)
        with self._lock:
            existing = self.tree.match(key, max_len=n, touch=False)
            need = n - existing.length
            if need <= 0:
                return 0
            # Protect the path we extend (exactly: not the rest of a node we leave mid-way)
            # while evicting for room; store the longest prefix that fits.
            anchor = self._split_at(key, existing.length) if existing.length else None
            if anchor is not None:
                self.tree.lock(anchor)
            try:
                short = need - self.pool.num_free
                if short > 0:
                    removed: list[Node] = []
                    self._evicted(removed, self._evict_for(short, key.namespace, need, removed))
            finally:
                if anchor is not None:
                    self.tree.unlock(anchor)
            take = min(need, self.pool.num_free)
            if take <= 0:
                return 0
            slots = self.pool.alloc(take)
            end = existing.length + take
            self.pool.write_from(slots, kv.k[:, :, existing.length:end], kv.v[:, :, existing.length:end])
            self.tree.insert(key.prefix(end), [-1] * existing.length + slots)
            self.version += 1
            return take

    # ------------------------------------------------------------- controls
    def clear(self, namespace: str | None = None) -> int:
        """Evict everything not in use by a running request (only ``namespace``'s
        nodes, if given); returns tokens freed."""
        with self._lock:
            freed = self.tree.clear(namespace)
            self.pool.free(freed)
            self.version += 1
            return len(freed)

    def set_budget(self, budget_bytes: int) -> int:
        """Change the budget, evicting LRU leaves if it shrinks. Returns tokens evicted.
        Running requests keep their slots (renumbered in place)."""
        budget_bytes = int(budget_bytes)
        if budget_bytes < 0:
            raise EngineError("the cache budget cannot be negative")
        with self._lock:
            new_capacity = budget_bytes // self.pool.bytes_per_token
            held = self.tree.locked_tokens + self._running_tokens
            if held > new_capacity:
                raise EngineError(
                    f"cannot shrink to {budget_bytes / 2**20:.1f} MB now: running requests hold "
                    f"{held * self.pool.bytes_per_token / 2**20:.1f} MB; try again when idle")
            evicted = 0
            over = self.tree.num_tokens + self._running_tokens - new_capacity
            if over > 0:
                removed: list[Node] = []
                freed = self.tree.evict(over, removed=removed)
                self._evicted(removed, freed)
                evicted = len(freed)
            own = [s for rs in self._live for s in rs.slots[rs.tree_len:]]
            mapping = self.pool.rebuild(budget_bytes, self.tree.all_values() + own)
            self.tree.remap_values(lambda vals: [mapping[v] for v in vals])
            for rs in self._live:
                rs.slots = [mapping[s] for s in rs.slots]
                rs._runs = None
            self.version += 1
            return evicted

    # ------------------------------------------------------------- checking
    def check_invariants(self) -> None:
        with self._lock:
            self.tree.check_invariants()
            self.pool.check()
            values = self.tree.all_values()
            own = [s for rs in self._live for s in rs.slots[rs.tree_len:]]
            assert len(values) == len(set(values)), "a pool slot is held twice by the tree"
            assert not set(own) & set(values), "a running request's own slot is also the tree's"
            assert len(own) == len(set(own)), "a pool slot is held by two running requests"
            assert len(own) == self._running_tokens, f"running tokens {self._running_tokens} != {len(own)}"
            assert all(0 <= v < self.pool.capacity for v in values + own), "slot out of range"
            assert self.pool.num_used == len(values) + len(own), (
                f"pool slots in use {self.pool.num_used} != tree {len(values)} + running {len(own)}")
            assert self.pool.bytes_in_use <= self.pool.budget_bytes
            if self.tier is None:
                assert self.spilled.tree.num_nodes == 0, "spilled nodes without a second tier"
            else:
                self.spilled.apply_drops(self.tier.__contains__)
                self.spilled.check(self.tier.__contains__, self._path_chunk_key)

    def snapshot(self, decode: Callable[[Sequence[int]], str] | None = None, viewer: str | None = None,
                 max_text_tokens: int = 256) -> TreeSnapshot:
        """A read-only copy of the tree, with the second tier's nodes (``spilled``, see
        ``engine.kvcache.spilled_tree``) beside the pool's. With ``viewer`` set, what other visitors
        cached shows only as ``engine.snapshot_view.for_viewer`` allows (coarse "others" nodes,
        no text, hits, locks or times on shared nodes, totals in buckets).

        The structure is copied under the lock; text is decoded after it is released, so a
        redraw never holds up the scheduler."""
        now = time.monotonic()
        bpt = self.pool.bytes_per_token
        with self._lock:
            infos = node_infos(self.tree, now, bpt)
            if self.tier is not None:
                self.spilled.apply_drops(self.tier.__contains__)
                infos += self.spilled.infos(self.tree, now, bpt)
            full = TreeSnapshot(tuple(infos), self.tree.num_tokens, self.tree_bytes, self.pool.budget_bytes,
                                self.pool.capacity, self.tree.evicted_tokens, bpt,
                                self.tier.kind if self.tier is not None else "")
        view = for_viewer(full, viewer) if viewer is not None else full
        return replace(view, nodes=with_text(view.nodes, decode, max_text_tokens))


class NoPrefixCache(RadixCache):
    """The cache-off twin: same interface and the same pool for running requests' KV,
    nothing reused, nothing stored."""

    enabled = False

    def __init__(self, pool: KVPool) -> None:
        super().__init__(pool)

    def _match(self, key: CacheKey, max_len: int):
        return self.tree.match(key, max_len=0, touch=False)

    def adopt(self, rs: RequestSlots, key: CacheKey) -> int:
        return 0

    def insert(self, key: CacheKey, kv: RequestKV) -> int:
        return 0
