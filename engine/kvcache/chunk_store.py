"""The second tier's store interface: an LRU over chunks of one ``ChunkGeometry`` under a byte budget.

Owns: ``ChunkStore``, what the cache calls on a tier (``put``, ``put_later`` and ``write_queued``,
``get``, the budget, the counters, ``on_drop``), the LRU order and budget they share, and the
queue of chunks handed over but not yet written (their bytes bounded by ``max_queued_bytes``);
where the bytes are is a subclass's (``HostStore`` and ``DiskStore`` in ``kv_tier.py``, which
re-exports this class). Knows nothing about trees or requests.

Spills under the cache's lock, writes after it (issue 43). The cache spills at eviction, with its
lock held; a file write there held every other request's ``match_len`` for as long as the disk
took (a 4,000-token eviction of a big model writes about 180 MB). So the cache hands chunks over
with ``put_later`` (no I/O: the tensor, a copy the cache made, is the store's from then on) and
calls ``write_queued`` once it has released its lock; ``flush`` writes all and waits for a writer
in another thread::

    under the cache's lock        put_later: index the chunk at once (LRU, budget, room made),
                                  keep its tensor in the queue: ``get`` serves it from there
    after the lock                write_queued: the file written under a temporary name, then,
                                  under the store's lock, renamed into place; only then is its
                                  tensor let go and the files of the chunks it displaced removed

So a queued chunk is found and bit-identical from the moment it is handed over; a load never
reads a half-written file (the rename is atomic, and until it the tensor answers); the index,
the LRU and the budget change exactly as a synchronous ``put`` would change them (the replay's
simulation agrees chunk for chunk). The queue's bytes are bounded (``max_queued_bytes``, default
the smaller of the budget and 256 MiB, at least one chunk): a chunk that does not fit is refused
(``put_later`` is False, ``refused_spills`` counts it, one log line until the queue drains), never
waited for, and the cache then simply evicts that KV. A write that fails costs that chunk only:
the chunks it displaced are indexed again when their files are still there (``on_drop`` was told;
the tree view shows them once they are loaded or spilled again).
"""

from __future__ import annotations

import logging
import struct
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from engine.kvcache.chunk_format import ChunkGeometry
from engine.types import CacheKey

log = logging.getLogger("engine.kvcache.kv_tier")  # the tier's one log, as before the split

DEFAULT_MAX_QUEUED_BYTES = 256 * 2**20


class ChunkStore:
    """LRU over chunks of one ``ChunkGeometry`` under a byte budget; subclasses keep the bytes
    (disk or host memory). Thread-safe. ``on_drop`` (if set) is told the key of every chunk that
    leaves: dropped for room, found bad or failed to be written (the cache keeps its map of what
    the tier holds by it; any thread may call it). After ``close`` it keeps nothing more and
    returns nothing."""

    kind = ""  # where the bytes are, for a person: "disk" or "host memory"
    persistent = False  # whether what it keeps outlives the process (a restart finds it)
    writes_later = False  # whether put_later queues (disk) or keeps the chunk at once (host memory)
    paths_file: Path | None = None  # disk only: the spilled paths, written at persist, read at start

    def __init__(self, budget_bytes: int, geometry: ChunkGeometry, max_queued_bytes: int | None = None) -> None:
        self.on_drop: Callable[[str], None] | None = None
        self.budget_bytes = int(budget_bytes)
        self.geometry = geometry
        bound = min(self.budget_bytes, DEFAULT_MAX_QUEUED_BYTES) if max_queued_bytes is None else max_queued_bytes
        self.max_queued_bytes = max(int(bound), geometry.nbytes)
        self._sizes: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recently used first (queued too)
        self._queued: dict[str, torch.Tensor] = {}  # indexed chunks whose bytes are not written yet
        self._queue: deque[tuple[str, torch.Tensor, list[str]]] = deque()  # (key, kv, keys it displaced)
        self.queued_bytes = 0
        self._lock = threading.Lock()
        self._writer = threading.Lock()  # held by the one thread writing the queue
        self._closed = False
        self._write_failing = False  # a write failed and none succeeded since: warn once, not per chunk
        self._refusing = False  # the queue refused a chunk and has not drained since: say so once
        self.bytes_in_use = 0
        self.stored_chunks = self.loaded_chunks = self.dropped_chunks = self.bad_chunks = 0
        self.failed_writes = self.refused_spills = 0
        self.bytes_written = self.bytes_read = 0

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._sizes

    @property
    def num_chunks(self) -> int:
        return len(self._sizes)

    @property
    def queued_chunks(self) -> int:
        """Chunks handed over by ``put_later`` and not yet written."""
        return len(self._queued)

    def put(self, key: str, kv: torch.Tensor) -> bool:
        """Keep ``kv`` (exactly ``geometry.shape`` and dtype, on any device: else ValueError) under
        ``key``, written before it returns. The chunk is written first; only then are least
        recently used chunks dropped for room. False if it cannot fit at all or writing failed
        (then nothing else changed)."""
        self.geometry.check_tensor(kv)
        size = self.geometry.nbytes
        with self._lock:
            if self._closed:
                return False
            if key in self._sizes:
                self._sizes.move_to_end(key)
                self._touch_kept(key)
                return True
            if size > self.budget_bytes:
                return False
            try:
                staged = self._stage(key, kv)
            except OSError as exc:
                self._write_failed(exc)
                return False
            self._make_room(size, None)
            try:
                self._commit(key, staged)
            except OSError as exc:
                self._discard(staged)
                self._write_failed(exc)
                return False
            self._written(size)
            self._sizes[key] = size
            self.bytes_in_use += size
            return True

    def put_later(self, key: str, kv: torch.Tensor) -> bool:
        """Keep ``kv`` under ``key`` without writing it now (no I/O: call it under the cache's lock,
        ``write_queued`` after it; see the module docstring). ``kv`` is the store's from now on:
        the caller must not change it. Indexed at once (``in``, ``get``, the LRU and the budget
        see it); False, with nothing changed, if it cannot fit at all or the queue is full."""
        if not self.writes_later:
            return self.put(key, kv)
        self.geometry.check_tensor(kv)
        size = self.geometry.nbytes
        kv = kv.detach().to("cpu")  # the pool's gather made a new tensor: on a CPU no copy
        with self._lock:
            if self._closed:
                return False
            if key in self._sizes:
                self._sizes.move_to_end(key)
                self._touch_kept(key)
                return True
            if size > self.budget_bytes:
                return False
            if self.queued_bytes + size > self.max_queued_bytes:
                self.refused_spills += 1
                if not self._refusing:
                    log.info("KV tier: the write queue is full (%.0f MiB); evicted KV is not kept until it "
                             "drains (said once until it does)", self.queued_bytes / 2**20)
                    self._refusing = True
                return False
            displaced: list[str] = []
            self._make_room(size, displaced)
            self._sizes[key] = size
            self.bytes_in_use += size
            self._queued[key] = kv
            self.queued_bytes += size
            self._queue.append((key, kv, displaced))
            return True

    def write_queued(self) -> None:
        """Write the queued chunks (call without the cache's lock). If another thread is writing
        them now, leave them to it: it writes until the queue is empty."""
        while self._queue:
            if not self._writer.acquire(blocking=False):
                return  # the thread that holds it looks at the queue again after letting it go
            try:
                self._write_all()
            finally:
                self._writer.release()

    def flush(self) -> None:
        """Write every queued chunk, waiting for a writer in another thread (persist, close)."""
        with self._writer:
            self._write_all()

    def get(self, key: str) -> torch.Tensor | None:
        """The chunk's KV: a CPU tensor of exactly ``geometry.shape`` and dtype, or None (missing,
        or bad: then it is removed with one log line, counted in ``bad_chunks``, and ``on_drop``
        is told). A queued chunk is served from its tensor."""
        g = self.geometry
        with self._lock:
            if self._closed or key not in self._sizes:
                return None
            kv = self._queued.get(key)
            try:
                if kv is None:
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
            self._touch_kept(key)
            self.loaded_chunks += 1
            self.bytes_read += g.nbytes
            return kv

    def write_paths(self, paths: Iterable[CacheKey]) -> None:
        """Keep the token paths of what the tier holds, for the tree after a restart (disk only)."""

    def read_paths(self) -> list[CacheKey]:
        """The paths ``write_paths`` kept, each entry checked; [] when there is none (disk only)."""
        return []

    def close(self) -> None:
        """Write what is queued, then keep and return nothing more; on disk, release the folder's
        lock (the files stay)."""
        self.flush()
        with self._lock:
            self._closed = True
            self._release()

    # ------------------------------------------------------------ the queue's writer
    def _write_all(self) -> None:
        """Write queued chunks until none is left (the caller holds ``_writer``)."""
        while True:
            with self._lock:
                if not self._queue:
                    self._refusing = False
                    return
                key, kv, displaced = self._queue.popleft()
                wanted = not self._closed and self._queued.get(key) is kv
            staged, error = None, None
            if wanted:
                try:
                    staged = self._stage(key, kv)  # the slow part, under no lock at all
                except OSError as exc:
                    error = exc
            with self._lock:
                self._settle_write(key, kv, displaced, staged, error)

    def _settle_write(self, key: str, kv: torch.Tensor, displaced: list[str], staged: object | None,
                      error: OSError | None) -> None:
        """Under the store's lock: put a written chunk in place, or account for one that failed."""
        if self._closed or self._queued.get(key) is not kv:  # dropped for room or found bad meanwhile
            if staged is not None:
                self._discard(staged)
            if not self._closed:
                self._remove_files(displaced)
            return
        if staged is not None:
            try:
                self._commit(key, staged)
            except OSError as exc:
                self._discard(staged)
                error = exc
        del self._queued[key]
        self.queued_bytes -= self._sizes[key]
        if error is None:
            self._written(self._sizes[key])
        else:
            self.bytes_in_use -= self._sizes.pop(key)
            self._write_failed(error)
            self._restore(displaced)
            self._forget(key)
        self._remove_files(displaced)

    def _remove_files(self, keys: list[str]) -> None:
        """The files of chunks that left the index for room (each unless it is indexed again)."""
        for old in keys:
            if old not in self._sizes:
                self._drop(old)

    def _restore(self, keys: list[str]) -> None:
        """A failed write's displaced chunks, back at the LRU's cold end while the budget allows."""
        for old in reversed(keys):
            if old in self._sizes or not self._still_there(old):
                continue
            size = self.geometry.nbytes
            if self.bytes_in_use + size > self.budget_bytes:
                break
            self._sizes[old] = size
            self._sizes.move_to_end(old, last=False)
            self.bytes_in_use += size
            self.dropped_chunks -= 1

    # ------------------------------------------------------------ shared bookkeeping
    def _make_room(self, size: int, displaced: list[str] | None) -> None:
        """Drop least recently used chunks until ``size`` more bytes fit. A queued one goes at once
        (its tensor is let go); a written one's file is removed now, or, with ``displaced`` given,
        listed there for the writer to remove once the new chunk is written."""
        while self.bytes_in_use + size > self.budget_bytes and self._sizes:
            old, old_size = self._sizes.popitem(last=False)
            self.bytes_in_use -= old_size
            self.dropped_chunks += 1
            if self._queued.pop(old, None) is not None:
                self.queued_bytes -= old_size
                self._tell_dropped(old)
            elif displaced is not None:
                displaced.append(old)
                self._tell_dropped(old)
            else:
                self._forget(old)

    def _written(self, size: int) -> None:
        if self._write_failing:
            log.info("KV tier: writing chunks works again")
            self._write_failing = False
        self.stored_chunks += 1
        self.bytes_written += size

    def _touch_kept(self, key: str) -> None:
        if key not in self._queued:  # a queued chunk's file gets its time when it is written
            self._touch(key)

    def _write_failed(self, exc: OSError) -> None:
        self.failed_writes += 1
        if not self._write_failing:
            log.warning("KV tier: could not write a chunk (%s); chunks that cannot be written are recomputed "
                        "when needed (said once until a write succeeds)", exc)
            self._write_failing = True

    def _forget(self, key: str) -> None:
        if self._queued.pop(key, None) is not None:
            self.queued_bytes -= self.geometry.nbytes
        self._drop(key)
        self._tell_dropped(key)

    def _tell_dropped(self, key: str) -> None:
        if self.on_drop is not None:
            self.on_drop(key)

    # What a subclass provides. _stage may raise OSError and must then leave nothing behind; it
    # runs under the store's lock for ``put`` and under none for the queue's writer.
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

    def _still_there(self, key: str) -> bool:
        """Whether a written chunk's bytes are still where ``_read`` finds them."""
        return False

    def _touch(self, key: str) -> None:
        pass

    def _release(self) -> None:
        pass
