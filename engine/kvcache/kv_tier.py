"""The second tier: KV that the pool evicted, kept in fixed-size chunks on disk or in host memory.

Owns: chunk files (or host tensors), their byte budget and LRU order, and their
integrity. Knows nothing about trees or requests: it stores and returns the KV
of ``CHUNK_TOKENS`` consecutive positions under a key that names the whole
prefix ending there (the cache computes it), as LMCache keys its chunks::

    positions: [0 ........ i*C) [i*C ...... (i+1)*C)
    key_i = hash(fingerprint, namespace, public tokens, ids[:(i+1)*C])
    chunk i holds the KV of the second range only; it is valid only after the first.

Only whole chunks are kept (a prompt's last ``< C`` tokens are recomputed, as vLLM
caches only full blocks). On disk a chunk is one file: a header (magic, the key,
dtype, shape, payload length, CRC-32 of the payload) and the raw bytes of K and V,
``[2, layers, kv_heads, C, head_dim]``. A file whose header, length or checksum
does not check out is skipped with one log line and removed: never a crash, never
wrong KV. Files live under a folder named by the fingerprint (model, dtype,
tokenizer, KV geometry), so another model or dtype never reads them, and they
survive restarts. In host memory (a GPU's second tier) the same chunks are CPU
tensors, lost at exit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CHUNK_TOKENS = 64
_MAGIC = b"RXKV1\n"
_HEADER = struct.Struct("<6s40s16sIIIIQI")  # magic, key, dtype, layers, heads, tokens, dim, payload bytes, crc32


def chunk_key(fingerprint: str, namespace: str, public_tokens: int, ids) -> str:
    """The key of the chunk that ends after ``ids`` (40 hex digits)."""
    h = hashlib.sha1(f"{fingerprint}|{namespace}|{public_tokens}|".encode())
    h.update(torch.tensor(list(ids), dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()


class ChunkStore:
    """LRU over chunks under a byte budget; subclasses keep the bytes (disk or host memory).
    Thread-safe. ``on_drop`` (if set) is told the key of every chunk that leaves: dropped for
    room or found bad (the cache keeps its map of what the tier holds by it)."""

    kind = ""  # where the bytes are, for a person: "disk" or "host memory"
    paths_file: Path | None = None  # disk only: the spilled paths, written at persist, read at start

    def __init__(self, budget_bytes: int) -> None:
        self.on_drop: Callable[[str], None] | None = None
        self.budget_bytes = int(budget_bytes)
        self._sizes: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recently used first
        self._lock = threading.Lock()
        self.bytes_in_use = 0
        self.stored_chunks = self.loaded_chunks = self.dropped_chunks = self.bad_chunks = 0
        self.bytes_written = self.bytes_read = 0

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._sizes

    @property
    def num_chunks(self) -> int:
        return len(self._sizes)

    def put(self, key: str, kv: torch.Tensor) -> bool:
        """Keep ``kv`` ([2, layers, heads, C, dim], on any device) under ``key``, dropping least
        recently used chunks for room. False if it cannot fit at all or writing failed."""
        size = kv.numel() * kv.element_size()
        with self._lock:
            if key in self._sizes:
                self._sizes.move_to_end(key)
                return True
            if size > self.budget_bytes:
                return False
            while self.bytes_in_use + size > self.budget_bytes and self._sizes:
                old, old_size = self._sizes.popitem(last=False)
                self.bytes_in_use -= old_size
                self.dropped_chunks += 1
                self._forget(old)
            try:
                self._write(key, kv)
            except OSError as exc:  # a full disk: the chunk is simply not kept
                log.warning("KV tier: could not write a chunk (%s); it will be recomputed when needed", exc)
                return False
            self._sizes[key] = size
            self.bytes_in_use += size
            self.stored_chunks += 1
            self.bytes_written += size
            return True

    def get(self, key: str) -> torch.Tensor | None:
        """The chunk's KV on the CPU, or None (missing, or bad: then it is removed)."""
        with self._lock:
            if key not in self._sizes:
                return None
            kv = self._read(key)
            if kv is None:
                self.bad_chunks += 1
                self.bytes_in_use -= self._sizes.pop(key)
                self._forget(key)
                return None
            self._sizes.move_to_end(key)
            self.loaded_chunks += 1
            self.bytes_read += kv.numel() * kv.element_size()
            return kv

    def write_paths(self, paths: list) -> None:
        """Keep the spilled paths (``CacheKey``s) for the next start (disk only)."""
        target = self.paths_file
        if target is None:
            return
        data = [{"ids": list(p.ids), "namespace": p.namespace, "public_len": p.public_len} for p in paths]
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps({"version": 1, "paths": data}))
            os.replace(tmp, target)
        except OSError as exc:
            log.warning("KV tier: could not write %s (%s)", target, exc)

    def read_paths(self) -> list:
        """The spilled paths a previous run kept ([] without, or when the file does not parse)."""
        source = self.paths_file
        if source is None or not source.exists():
            return []
        from engine.types import CacheKey
        try:
            saved = json.loads(source.read_text())["paths"]
            return [CacheKey(tuple(int(i) for i in p["ids"]), str(p["namespace"]), int(p["public_len"]))
                    for p in saved]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("KV tier: skipping %s (%s)", source.name, exc)
            return []

    def _forget(self, key: str) -> None:
        self._drop(key)
        if self.on_drop is not None:
            self.on_drop(key)

    def _write(self, key: str, kv: torch.Tensor) -> None:
        raise NotImplementedError

    def _read(self, key: str) -> torch.Tensor | None:
        raise NotImplementedError

    def _drop(self, key: str) -> None:
        raise NotImplementedError


class HostStore(ChunkStore):
    """Chunks as CPU tensors: a GPU's second tier (copied back per load); gone at exit."""

    kind = "host memory"

    def __init__(self, budget_bytes: int) -> None:
        super().__init__(budget_bytes)
        self._data: dict[str, torch.Tensor] = {}

    def _write(self, key: str, kv: torch.Tensor) -> None:
        self._data[key] = kv.detach().to("cpu", copy=True)

    def _read(self, key: str) -> torch.Tensor | None:
        return self._data.get(key)

    def _drop(self, key: str) -> None:
        self._data.pop(key, None)


class DiskStore(ChunkStore):
    """Chunks as files under ``folder`` (one per chunk), found again after a restart."""

    kind = "disk"

    @property
    def paths_file(self) -> Path:
        """Where the cache keeps the token paths of what this tier holds, for the tree after a restart."""
        return self.folder / "spilled-paths.json"

    def __init__(self, folder: Path, budget_bytes: int) -> None:
        super().__init__(budget_bytes)
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._scan()

    def _path(self, key: str) -> Path:
        return self.folder / f"{key}.kv"

    def _scan(self) -> None:
        """Index the chunks a previous run left, oldest first (by file time); unreadable or
        foreign files are skipped, each with one log line."""
        found = []
        for path in self.folder.glob("*.kv"):
            try:
                with open(path, "rb") as f:
                    head = _HEADER.unpack(f.read(_HEADER.size))
                if head[0] != _MAGIC or head[1].decode() != path.stem:
                    raise ValueError("not a chunk of this tier")
                expected = _HEADER.size + head[7]
                if path.stat().st_size != expected:
                    raise ValueError(f"truncated: {path.stat().st_size} of {expected} bytes")
                found.append((path.stat().st_mtime, path.stem, head[7]))
            except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
                log.warning("KV tier: skipping %s (%s)", path.name, exc)
                self.bad_chunks += 1
                path.unlink(missing_ok=True)
        for _, key, size in sorted(found):
            if self.bytes_in_use + size > self.budget_bytes:
                self._path(key).unlink(missing_ok=True)
                continue
            self._sizes[key] = size
            self.bytes_in_use += size

    def _write(self, key: str, kv: torch.Tensor) -> None:
        kv = kv.detach().to("cpu").contiguous()
        payload = kv.view(torch.uint8).numpy().tobytes()
        two, layers, heads, tokens, dim = kv.shape
        dtype = str(kv.dtype).removeprefix("torch.").encode()
        header = _HEADER.pack(_MAGIC, key.encode(), dtype, layers, heads, tokens, dim, len(payload),
                              zlib.crc32(payload))
        tmp = self._path(key).with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, self._path(key))  # a crash mid-write never leaves a half file under the key

    def _read(self, key: str) -> torch.Tensor | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
            head = _HEADER.unpack_from(data)
            magic, stored_key, dtype, layers, heads, tokens, dim, size, crc = head
            payload = memoryview(data)[_HEADER.size:]
            if magic != _MAGIC or stored_key.decode() != key or len(payload) != size:
                raise ValueError("header or length does not match")
            if zlib.crc32(payload) != crc:
                raise ValueError("checksum mismatch")
            torch_dtype = getattr(torch, dtype.rstrip(b"\0").decode())
            flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            return flat.view(torch_dtype).view(2, layers, heads, tokens, dim)
        except (OSError, ValueError, struct.error, AttributeError, RuntimeError, UnicodeDecodeError) as exc:
            log.warning("KV tier: skipping chunk %s (%s); it will be recomputed", path.name, exc)
            return None

    def _drop(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


def fingerprint(model_name: str, dtype: torch.dtype, tokenizer, num_layers: int, num_kv_heads: int,
                head_dim: int) -> str:
    """Names what the KV depends on: the same model, dtype, tokenizer and geometry, or nothing."""
    h = hashlib.sha1(f"{model_name}|{dtype}|{num_layers}|{num_kv_heads}|{head_dim}|".encode())
    vocab = sorted(tokenizer.get_vocab().items()) if tokenizer is not None else []
    h.update(repr(vocab).encode("utf-8", "surrogatepass"))
    h.update(str(getattr(tokenizer, "chat_template", "")).encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:16]
