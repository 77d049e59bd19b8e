"""The second tier: KV that the pool evicted, kept in fixed-size chunks on disk or in host memory.

Owns: chunk files (or host tensors), their byte budget and LRU order, their
integrity, the folder's lock and the file of spilled paths. Knows nothing about
trees or requests: it stores and returns the KV of ``CHUNK_TOKENS`` consecutive
positions under a key that names the whole prefix ending there (the cache
computes it), as LMCache keys its chunks::

    positions: [0 ........ i*C) [i*C ...... (i+1)*C)
    key_i = hash(fingerprint, namespace, public tokens, ids[:(i+1)*C])
    chunk i holds the KV of the second range only; it is valid only after the first.

Only whole chunks are kept (a prompt's last ``< C`` tokens are recomputed, as vLLM
caches only full blocks). On disk a chunk is one file: a header (magic, the key,
dtype, layers, heads, tokens, head_dim, payload length, CRC-32 of the payload) and
the raw bytes of K and V, ``[2, layers, kv_heads, C, head_dim]``. In host memory
(a GPU's second tier) the same chunks are CPU tensors, lost at exit.

TRUST RULE. Files are input, never trusted. A store is built for one
``ChunkGeometry`` (layers, KV heads, head_dim, dtype, tokens per chunk) and checks
EVERY header field against it (magic, key equal to the file's name, dtype name
equal to the geometry's, each dimension, payload length), then the file's exact
length, then the CRC-32, before any byte is handed out; ``get`` returns a CPU
tensor of exactly ``geometry.shape`` and ``geometry.dtype`` or None. A file that
fails any check (also unreadable, truncated, an unknown dtype name) costs one log
line and a recompute: it is removed, counted in ``bad_chunks``, and ``on_drop``
tells the cache. Never a crash, never wrong KV. The scan at start applies the same
header and length checks. The spilled-paths file is checked entry by entry
(``read_paths``). What names the folder (``fingerprint`` and the mode, see
docs/TIER.md) keeps other models, weights, dtypes, tokenizers and modes out.
The geometry, the header and its checks live in ``chunk_format.py``; the fingerprint in
``tier_identity.py``; the store interface and its LRU (``ChunkStore``) in ``chunk_store.py``
(all re-exported here); the folder's safety rule and lock in ``tier_folder.py``. This module
keeps the two stores.

On disk the store also keeps: an exclusive lock on the folder for its lifetime
(``tier_folder.lock_folder``: ``TierBusy`` for a second store, in this process or another),
LRU order across restarts (a put and a hit set the file's time; the scan keeps the newest
within budget), and a full disk costs nothing already kept (the new chunk is written to a
temporary file first; room is made only once it is complete). Chunks the cache spills
are queued and written after it releases its lock (``ChunkStore.put_later``, see
``chunk_store.py``).

THE FOLDER IS THE USER'S ALONE (issue 43): the folder's rule, its lock and how its files are
opened are ``tier_folder.py``'s; ``DiskStore`` opens every file through it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import stat
import struct
import time
import zlib
from collections.abc import Iterable
from pathlib import Path

import torch

from engine.kvcache.chunk_format import (  # noqa: F401 (re-exported: the tier's old import paths)
    _HEADER,
    _MAGIC,
    ChunkGeometry,
    _path_entry,
    chunk_key,
)
from engine.kvcache.chunk_store import ChunkStore
from engine.kvcache.chunks import CHUNK_TOKENS  # noqa: F401 (re-exported)
from engine.kvcache.tier_folder import TierUnsafe, lock_folder, open_new, open_regular, temporary_name, unsafe_folder
from engine.kvcache.tier_identity import fingerprint, weights_digest  # noqa: F401 (re-exported)
from engine.types import CacheKey

log = logging.getLogger(__name__)

_MAX_PATHS_FILE_BYTES = 256 * 2**20


class HostStore(ChunkStore):
    """Chunks as CPU tensors: a GPU's second tier (copied back per load); gone at exit."""

    kind = "host memory"

    def __init__(self, budget_bytes: int, geometry: ChunkGeometry) -> None:
        super().__init__(budget_bytes, geometry)
        self._data: dict[str, torch.Tensor] = {}

    def _stage(self, key: str, kv: torch.Tensor) -> torch.Tensor:
        return kv.detach().to("cpu", copy=True)

    def _commit(self, key: str, staged: object) -> None:
        assert isinstance(staged, torch.Tensor)
        self._data[key] = staged

    def _read(self, key: str) -> torch.Tensor:
        return self._data[key]

    def _drop(self, key: str) -> None:
        self._data.pop(key, None)

    def _release(self) -> None:
        self._data.clear()


class DiskStore(ChunkStore):
    """Chunks as files under ``folder`` (one per chunk), found again after a restart. Holds an
    exclusive lock on the folder while open (``TierBusy`` if another store has it)."""

    kind = "disk"
    persistent = True
    writes_later = True

    @property
    def paths_file(self) -> Path | None:
        """Where the token paths of what this tier holds are kept, for the tree after a restart;
        None once closed (the folder may be another engine's by then)."""
        return None if self._closed else self.folder / "spilled-paths.json"

    def __init__(self, folder: Path, budget_bytes: int, geometry: ChunkGeometry,
                 max_queued_bytes: int | None = None) -> None:
        """``max_queued_bytes``: the bound on chunks handed over and not yet written
        (``ChunkStore``). TierUnsafe for a folder others may write (module docstring)."""
        super().__init__(budget_bytes, geometry, max_queued_bytes)
        self.folder = Path(folder)
        self._lock_file = None
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        why = unsafe_folder(self.folder)
        if why:
            raise TierUnsafe(f"the KV tier folder {self.folder} {why}")
        self._lock_file = lock_folder(self.folder)  # held for the store's lifetime; closed in _release
        self._lock_pid = os.getpid()
        self._clock_ns = 0  # the last file time set: strictly increasing, so LRU order survives a restart
        self._scan()

    def _path(self, key: str) -> Path:
        return self.folder / f"{key}.kv"

    # ------------------------------------------------------------ the folder's lock
    def _release(self) -> None:
        if self._lock_file is not None:
            if os.getpid() == self._lock_pid:  # a forked child shares the description: unlocking would free the parent's
                fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None

    # ------------------------------------------------------------ the scan at start
    def _scan(self) -> None:
        """Index the chunks a previous run left: files whose header or length does not match the
        geometry are removed (one log line each); of the rest the NEWEST within budget are kept
        (file times are LRU order), the others removed. Temporary files are left-overs of a
        process that died mid-write (the lock proves no other process writes here): removed."""
        for tmp in self.folder.glob("*.tmp*"):
            tmp.unlink(missing_ok=True)
            log.info("KV tier: removed %s, left by an interrupted write", tmp.name)
        g = self.geometry
        expected = _HEADER.size + g.nbytes
        found = []
        for path in self.folder.glob("*.kv"):
            try:
                with os.fdopen(open_regular(path), "rb") as f:
                    g.check_header(f.read(_HEADER.size), path.stem)
                    st = os.fstat(f.fileno())
                if st.st_size != expected:
                    raise ValueError(f"length {st.st_size}, expected {expected} bytes")
                found.append((st.st_mtime_ns, path.stem))
            except (OSError, ValueError, struct.error) as exc:
                log.warning("KV tier: skipping %s (%s)", path.name, exc)
                self.bad_chunks += 1
                path.unlink(missing_ok=True)
        found.sort(reverse=True)  # newest first
        kept: list[str] = []
        for _, key in found:
            if self.bytes_in_use + g.nbytes > self.budget_bytes:
                self._path(key).unlink(missing_ok=True)
                self.dropped_chunks += 1
                continue
            kept.append(key)
            self.bytes_in_use += g.nbytes
        for key in reversed(kept):  # least recently used first
            self._sizes[key] = g.nbytes
        if len(kept) < len(found):
            log.info("KV tier: kept the %d newest chunks within budget, removed %d older", len(kept),
                     len(found) - len(kept))
        self._clock_ns = found[0][0] if found else 0

    # ------------------------------------------------------------ chunk files
    def _stage(self, key: str, kv: torch.Tensor) -> Path:
        kv = kv.detach().to("cpu").contiguous()
        payload = kv.reshape(-1).view(torch.uint8).numpy()  # a view, no copy
        header = self.geometry.header(key, zlib.crc32(payload))
        tmp = temporary_name(self._path(key))
        fd = open_new(tmp)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def _commit(self, key: str, staged: object) -> None:
        assert isinstance(staged, Path)
        os.replace(staged, self._path(key))  # a crash mid-write never leaves a half file under the key
        self._touch(key)

    def _discard(self, staged: object) -> None:
        assert isinstance(staged, Path)
        staged.unlink(missing_ok=True)

    def _touch(self, key: str) -> None:
        """Set the file's time to now (strictly after the last one set): the scan's LRU order."""
        self._clock_ns = max(time.time_ns(), self._clock_ns + 1)
        try:
            os.utime(self._path(key), ns=(self._clock_ns, self._clock_ns))
        except OSError:
            pass  # the order after a restart is a little off; nothing else depends on it

    def _read(self, key: str) -> torch.Tensor:
        """The header checked field by field, then the payload read into ONE buffer (the tensor
        returned), its length and checksum checked."""
        g = self.geometry
        with os.fdopen(open_regular(self._path(key)), "rb", buffering=0) as f:
            crc = g.check_header(f.read(_HEADER.size), key)
            buf = torch.empty(g.nbytes, dtype=torch.uint8)
            view = memoryview(buf.numpy())
            got = 0
            while got < g.nbytes:
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
            if got != g.nbytes or f.read(1):
                raise ValueError(f"payload length {got if got != g.nbytes else 'over'}, expected {g.nbytes} bytes")
        if zlib.crc32(view) != crc:
            raise ValueError("checksum mismatch")
        return buf.view(g.dtype).view(g.shape)

    def _drop(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def _still_there(self, key: str) -> bool:
        try:
            return stat.S_ISREG(os.lstat(self._path(key)).st_mode)
        except OSError:
            return False

    # ------------------------------------------------------------ the spilled paths
    def write_paths(self, paths: Iterable[CacheKey]) -> None:
        """``{"version": 1, "paths": [{"ids": [...], "namespace": str, "public_len": int}]}``, written
        under a temporary name and renamed; a failure costs one log line (the tree then shows the
        tier's chunks as they are loaded)."""
        data = {"version": 1, "paths": [{"ids": [int(i) for i in p.ids], "namespace": p.namespace,
                                         "public_len": int(p.public_len)} for p in paths]}
        target = self.folder / "spilled-paths.json"
        tmp = temporary_name(target)
        with self._lock:
            if self._closed:
                return
            try:
                with os.fdopen(open_new(tmp), "w") as f:
                    f.write(json.dumps(data))
                os.replace(tmp, target)
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                log.warning("KV tier: could not write %s (%s); the tree will show the tier after the next load",
                            target, exc)

    def read_paths(self) -> list[CacheKey]:
        """The saved paths; an entry that is not exactly what ``write_paths`` writes (ids ints in
        [0, 2**31), a namespace string of at most 256 characters, 0 <= public_len <= len(ids)) is
        skipped; a file that does not parse gives []. One log line either way; never raises."""
        source = self.folder / "spilled-paths.json"
        try:
            if self._closed or not os.path.lexists(source):
                return []
            with os.fdopen(open_regular(source), "rb") as f:
                if os.fstat(f.fileno()).st_size > _MAX_PATHS_FILE_BYTES:
                    raise ValueError(f"larger than {_MAX_PATHS_FILE_BYTES} bytes")
                raw = f.read(_MAX_PATHS_FILE_BYTES + 1)
            data = json.loads(raw)
            if not isinstance(data, dict) or data.get("version") != 1 or not isinstance(data.get("paths"), list):
                raise ValueError("not a paths file of version 1")
        except (OSError, ValueError, RecursionError) as exc:
            log.warning("KV tier: skipping %s (%s)", source.name, exc)
            return []
        paths = [_path_entry(entry) for entry in data["paths"]]
        good = [p for p in paths if p is not None]
        if len(good) < len(paths):
            log.warning("KV tier: skipped %d bad entries of %s", len(paths) - len(good), source.name)
        return good
