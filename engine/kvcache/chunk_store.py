"""The second tier's store interface: an LRU over chunks of one ``ChunkGeometry`` under a byte budget.

Owns: ``ChunkStore``, what the cache calls on a tier (``put``, ``get``, ``drop``, the budget, the
counters, ``on_drop``) and the LRU order and budget they share; where the bytes are is a subclass's
(``HostStore`` and ``DiskStore`` in ``kv_tier.py``, which re-exports this class). Knows nothing
about trees or requests.
"""

from __future__ import annotations

import logging
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from engine.kvcache.chunk_format import ChunkGeometry
from engine.types import CacheKey

log = logging.getLogger("engine.kvcache.kv_tier")  # the tier's one log, as before the split


class ChunkStore:
    """LRU over chunks of one ``ChunkGeometry`` under a byte budget; subclasses keep the bytes
    (disk or host memory). Thread-safe. ``on_drop`` (if set) is told the key of every chunk that
    leaves: dropped for room or found bad (the cache keeps its map of what the tier holds by it).
    After ``close`` it keeps nothing more and returns nothing."""

    kind = ""  # where the bytes are, for a person: "disk" or "host memory"
    persistent = False  # whether what it keeps outlives the process (a restart finds it)
    paths_file: Path | None = None  # disk only: the spilled paths, written at persist, read at start

    def __init__(self, budget_bytes: int, geometry: ChunkGeometry) -> None:
        self.on_drop: Callable[[str], None] | None = None
        self.budget_bytes = int(budget_bytes)
        self.geometry = geometry
        self._sizes: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recently used first
        self._lock = threading.Lock()
        self._closed = False
        self._write_failing = False  # a write failed and none succeeded since: warn once, not per chunk
        self.bytes_in_use = 0
        self.stored_chunks = self.loaded_chunks = self.dropped_chunks = self.bad_chunks = 0
        self.failed_writes = 0
        self.bytes_written = self.bytes_read = 0

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._sizes

    @property
    def num_chunks(self) -> int:
        return len(self._sizes)

    def put(self, key: str, kv: torch.Tensor) -> bool:
        """Keep ``kv`` (exactly ``geometry.shape`` and dtype, on any device: else ValueError) under
        ``key``. The chunk is written first; only then are least recently used chunks dropped for
        room. False if it cannot fit at all or writing failed (then nothing else changed)."""
        self.geometry.check_tensor(kv)
        size = self.geometry.nbytes
        with self._lock:
            if self._closed:
                return False
            if key in self._sizes:
                self._sizes.move_to_end(key)
                self._touch(key)
                return True
            if size > self.budget_bytes:
                return False
            try:
                staged = self._stage(key, kv)
            except OSError as exc:
                self._write_failed(exc)
                return False
            while self.bytes_in_use + size > self.budget_bytes and self._sizes:
                old, old_size = self._sizes.popitem(last=False)
                self.bytes_in_use -= old_size
                self.dropped_chunks += 1
                self._forget(old)
            try:
                self._commit(key, staged)
            except OSError as exc:
                self._discard(staged)
                self._write_failed(exc)
                return False
            if self._write_failing:
                log.info("KV tier: writing chunks works again")
                self._write_failing = False
            self._sizes[key] = size
            self.bytes_in_use += size
            self.stored_chunks += 1
            self.bytes_written += size
            return True

    def get(self, key: str) -> torch.Tensor | None:
        """The chunk's KV: a CPU tensor of exactly ``geometry.shape`` and dtype, or None (missing,
        or bad: then it is removed with one log line, counted in ``bad_chunks``, and ``on_drop``
        is told)."""
        g = self.geometry
        with self._lock:
            if self._closed or key not in self._sizes:
                return None
            try:
                kv = self._read(key)
                if tuple(kv.shape) != g.shape or kv.dtype != g.dtype or kv.device.type != "cpu":
                    raise ValueError(f"read {list(kv.shape)} {kv.dtype} on {kv.device}")
            except (OSError, ValueError, RuntimeError, struct.error) as exc:
                log.warning("KV tier: dropping bad chunk %s (%s); it will be recomputed", key, exc)
                self.bad_chunks += 1
                self.bytes_in_use -= self._sizes.pop(key)
                self._forget(key)
                return None
            self._sizes.move_to_end(key)
            self._touch(key)
            self.loaded_chunks += 1
            self.bytes_read += g.nbytes
            return kv

    def write_paths(self, paths: Iterable[CacheKey]) -> None:
        """Keep the token paths of what the tier holds, for the tree after a restart (disk only)."""

    def read_paths(self) -> list[CacheKey]:
        """The paths ``write_paths`` kept, each entry checked; [] when there is none (disk only)."""
        return []

    def close(self) -> None:
        """Keep and return nothing more; on disk, release the folder's lock (the files stay)."""
        with self._lock:
            self._closed = True
            self._release()

    def _write_failed(self, exc: OSError) -> None:
        self.failed_writes += 1
        if not self._write_failing:
            log.warning("KV tier: could not write a chunk (%s); chunks that cannot be written are recomputed "
                        "when needed (said once until a write succeeds)", exc)
            self._write_failing = True

    def _forget(self, key: str) -> None:
        self._drop(key)
        if self.on_drop is not None:
            self.on_drop(key)

    # What a subclass provides. _stage may raise OSError and must then leave nothing behind.
    def _stage(self, key: str, kv: torch.Tensor) -> object:
        raise NotImplementedError

    def _commit(self, key: str, staged: object) -> None:
        raise NotImplementedError

    def _discard(self, staged: object) -> None:
        pass

    def _read(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def _drop(self, key: str) -> None:
        raise NotImplementedError

    def _touch(self, key: str) -> None:
        pass

    def _release(self) -> None:
        pass
