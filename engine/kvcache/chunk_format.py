"""What one chunk of the second tier is, and the trust rule for a file that claims to be one.

Owns: ``ChunkGeometry`` (the shape, dtype and size of every chunk of a store), the on-disk header
(magic, the key, dtype, layers, heads, tokens, head_dim, payload length, CRC-32) and its field
by field check, ``chunk_key`` (the key of the chunk that ends after some ids), and the check of one
entry of the spilled-paths file. Knows nothing about folders, budgets or LRU order: the stores
(``kv_tier.py``) apply these checks to every file before a byte reaches the pool. The whole rule:
docs/TIER.md and ``kv_tier``'s docstring (TRUST RULE).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import torch

from engine.kvcache.chunks import CHUNK_TOKENS
from engine.types import CacheKey

_MAGIC = b"RXKV1\n"
_HEADER = struct.Struct("<6s40s16sIIIIQI")  # magic, key, dtype, layers, heads, tokens, dim, payload bytes, crc32
_MAX_TOKEN_ID = 2**31  # ids in the paths file: [0, 2**31)
_MAX_NAMESPACE_CHARS = 256


@dataclass(frozen=True)
class ChunkGeometry:
    """What every chunk of a store is: ``[2, num_layers, num_kv_heads, tokens, head_dim]`` of ``dtype``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    tokens: int = CHUNK_TOKENS

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (2, self.num_layers, self.num_kv_heads, self.tokens, self.head_dim)

    @property
    def nbytes(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.tokens * self.head_dim * self.dtype.itemsize

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def check_tensor(self, kv: torch.Tensor) -> None:
        """A chunk handed to ``put`` must be exactly this; anything else is a programming error."""
        if tuple(kv.shape) != self.shape or kv.dtype != self.dtype:
            raise ValueError(f"a KV chunk must be {list(self.shape)} {self.dtype_name}, "
                             f"got {list(kv.shape)} {str(kv.dtype).removeprefix('torch.')}")

    def header(self, key: str, payload_crc: int) -> bytes:
        return _HEADER.pack(_MAGIC, key.encode(), self.dtype_name.encode(), self.num_layers, self.num_kv_heads,
                            self.tokens, self.head_dim, self.nbytes, payload_crc)

    def check_header(self, raw: bytes, key: str) -> int:
        """Every field of a file's header against this geometry and the expected key; returns
        the payload's CRC-32. Raises ValueError naming the first field that does not match."""
        if len(raw) != _HEADER.size:
            raise ValueError(f"truncated header: {len(raw)} of {_HEADER.size} bytes")
        magic, stored_key, dtype, layers, heads, tokens, dim, size, crc = _HEADER.unpack(raw)
        if magic != _MAGIC:
            raise ValueError("not a chunk of this tier")
        if stored_key.rstrip(b"\0") != key.encode():
            raise ValueError("written under another key")
        name = dtype.rstrip(b"\0")
        if name != self.dtype_name.encode():
            raise ValueError(f"dtype {name.decode('ascii', 'replace')!r}, expected {self.dtype_name}")
        for field, got, want in (("layers", layers, self.num_layers), ("kv heads", heads, self.num_kv_heads),
                                 ("tokens", tokens, self.tokens), ("head_dim", dim, self.head_dim),
                                 ("payload bytes", size, self.nbytes)):
            if got != want:
                raise ValueError(f"{field} {got}, expected {want}")
        return crc


def chunk_key(fingerprint: str, namespace: str, public_tokens: int, ids) -> str:
    """The key of the chunk that ends after ``ids`` (40 hex digits)."""
    h = hashlib.sha1(f"{fingerprint}|{namespace}|{public_tokens}|".encode())
    h.update(torch.tensor(list(ids), dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()


def _path_entry(entry: object) -> CacheKey | None:
    """One entry of the paths file, or None if any field is not what ``write_paths`` writes."""
    if not isinstance(entry, dict):
        return None
    ids, namespace, public_len = entry.get("ids"), entry.get("namespace"), entry.get("public_len")
    if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < _MAX_TOKEN_ID for i in ids):
        return None
    if not isinstance(namespace, str) or len(namespace) > _MAX_NAMESPACE_CHARS:
        return None
    try:
        namespace.encode("utf-8")  # JSON may carry lone surrogates; chunk_key encodes the namespace
    except UnicodeEncodeError:
        return None
    if type(public_len) is not int or not 0 <= public_len <= len(ids):
        return None
    return CacheKey(tuple(ids), namespace, public_len)
