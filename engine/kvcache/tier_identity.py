"""What names the second tier: the fingerprint of everything its KV depends on.

Owns: ``fingerprint`` (model, weights, dtype, tokenizer, geometry, linear kernels) and
``weights_digest`` (the weights' files, each file's digest kept in a memo so a start hashes them
only when they changed). A tier folder is named by the fingerprint and the mode (docs/TIER.md), so
another model, weights, dtype, tokenizer or mode never reads it. Knows nothing about chunks or stores.

WHEN A REMEMBERED DIGEST IS BELIEVED (issue 43). Size and mtime alone are not enough: ``cp -p``
or ``touch -r`` gives other weights of the same size the old mtime, and the old KV would be
served. A file's digest is reused only when all of these are as they were when it was hashed:

- size, mtime_ns, **ctime_ns**, inode and device. The ctime is the kernel's: any write, rename,
  ``chmod`` or ``utime`` sets it to now, and nothing (``cp -p``, ``touch``, ``os.utime``) can set
  it back; a new file (a copy, a download, a rename onto the path) has a new ctime and usually a
  new inode;
- the file had not changed for ``_RACY_NS`` (2 s) before it was hashed, so a change within the
  same clock tick as the hash cannot hide behind an equal ctime (git's "racily clean" rule);
  a file hashed sooner is hashed again at the next start;
- a digest of a sample of its content, 16 blocks of 64 KiB spread over the file (its head, with
  a safetensors header, and its tail included; the whole file when it is under 1 MiB), for file
  systems whose ctime is not kept (some network and FUSE mounts): about 1 MiB read per file.

Anything else hashes the file in full again (about 1 s per 540 MB here). The memo is read only
from a regular file of the user's that others may not write (never through a symlink), and
written under a fresh name (``O_EXCL``) and renamed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import stat
import time
from collections.abc import Sequence
from pathlib import Path

import torch

log = logging.getLogger("engine.kvcache.kv_tier")  # the tier's one log, as before the split

def fingerprint(model_name: str, dtype: torch.dtype, tokenizer, num_layers: int, num_kv_heads: int,
                head_dim: int, weights: str = "", packed_linear: bool = False, native_linear: int = 0,
                fused_decode: bool = False, attention: str = "", isa: str = "", exact: bool = False) -> str:
    """Names what the KV depends on: the same model, weights (``weights_digest``), dtype,
    tokenizer, geometry, linear kernels (oneDNN-packed or our native linears, and our fused decode
    layers, change the KV's last bits) and attention kernels (``attention``: the backend's own
    description, which names its kernels and their paths; a token's KV past the first layer
    depends on the attention of the layers below it) and the instruction set our kernels were built
    for when it is not this CPU's own (``isa``: ``RADIX_ISA``, ``engine.model.native_build``), or
    nothing."""
    h = hashlib.sha1(f"{model_name}|{dtype}|{num_layers}|{num_kv_heads}|{head_dim}|".encode())
    h.update(f"weights={weights}|packed_linear={int(bool(packed_linear))}|".encode())
    if native_linear:  # our linears (engine.model.native_linear), up to that many float32 rows; absent: the
        h.update(f"native_linear={int(native_linear)}|".encode())  # names tiers had before
    if fused_decode:  # our fused decode layers (engine.model.fused_decode), likewise
        h.update(b"fused_decode=1|")
    if attention:  # the attention backend and its kernels, likewise
        h.update(f"attention={attention}|".encode())
    if exact:  # the exact forward (issue 44: engine.model.attention.exact), whose bits are its own, likewise
        h.update(b"exact=1|")
    if isa and isa != "native":  # a narrower build of our kernels (RADIX_ISA), likewise
        h.update(f"isa={isa}|".encode())
    vocab = sorted(tokenizer.get_vocab().items()) if tokenizer is not None else []
    h.update(repr(vocab).encode("utf-8", "surrogatepass"))
    h.update(str(getattr(tokenizer, "chat_template", "")).encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:16]


_RACY_NS = 2 * 10**9  # a file changed this recently when it was hashed is hashed again next time
_SAMPLE_BLOCKS = 16
_SAMPLE_BYTES = 64 * 1024
_STAT_FIELDS = ("size", "mtime_ns", "ctime_ns", "ino", "dev")


def weights_digest(files: Sequence[Path], model: torch.nn.Module | None = None, memo: Path | None = None) -> str:
    """A digest of the model's weights: of the ``files`` they were loaded from (each file's digest
    kept in ``memo``, a JSON file, and believed only by the module docstring's rule, so a start
    hashes the weights only when they changed: about 1 s for 540 MB here), or, without files, of
    the ``model``'s tensors as loaded."""
    if files:
        table = _read_memo(memo)
        h = hashlib.sha256()
        changed = False
        for path in sorted(Path(p) for p in files):
            digest, entry = _digest_of(path, table.get(str(path)))
            if entry is not None:
                table[str(path)] = entry
                changed = True
            h.update(f"{path.name}|{digest}|".encode())
        if changed and memo is not None:
            _write_memo(memo, table)
        return h.hexdigest()[:32]
    if model is None:
        return ""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{t.numel()}|".encode())
        h.update(t.view(torch.uint8).numpy())
    return h.hexdigest()[:32]


def _identity(st: os.stat_result) -> dict[str, int]:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino,
            "dev": st.st_dev}


def _digest_of(path: Path, entry: object) -> tuple[str, dict | None]:
    """The file's SHA-256 and, when it was hashed now, the memo's new entry for it (None when the
    remembered one was believed)."""
    before = os.stat(path)
    seen = _identity(before)
    sample = _sample_digest(path, before.st_size)
    if (isinstance(entry, dict) and all(entry.get(k) == v for k, v in seen.items()) and entry.get("sample") == sample
            and isinstance(entry.get("hashed_ns"), int) and before.st_ctime_ns + _RACY_NS <= entry["hashed_ns"]
            and isinstance(entry.get("sha256"), str)):
        return entry["sha256"], None
    hashed_ns = time.time_ns()
    digest = _file_digest(path)
    if _identity(os.stat(path)) != seen:  # changed while it was hashed: nothing worth remembering
        hashed_ns = 0
    return digest, {**seen, "sample": sample, "sha256": digest, "hashed_ns": hashed_ns}


def _sample_digest(path: Path, size: int) -> str:
    """SHA-256 of the size and ``_SAMPLE_BLOCKS`` blocks spread evenly over the file (all of it
    when it is small): cheap, and it sees most replacements whatever the file system keeps."""
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= _SAMPLE_BLOCKS * _SAMPLE_BYTES:
            h.update(f.read())
        else:
            for i in range(_SAMPLE_BLOCKS):
                f.seek(i * (size - _SAMPLE_BYTES) // (_SAMPLE_BLOCKS - 1))
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _read_memo(memo: Path | None) -> dict:
    """The memo's table, or {} (none, unreadable, not a regular file of the user's that others may
    not write: a memo someone else could write would let them name other weights as these)."""
    if memo is None:
        return {}
    try:
        fd = os.open(memo, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
                log.info("KV tier: not reading %s (not a private file of this user); the weights are hashed again",
                         memo)
                return {}
            table = json.loads(f.read())
        return table if isinstance(table, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_memo(memo: Path, table: dict) -> None:
    tmp = memo.with_name(f"{memo.name}.tmp{os.getpid()}-{secrets.token_hex(6)}")
    try:
        memo.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(table))
        os.replace(tmp, memo)
    except OSError as exc:  # the next start hashes again
        tmp.unlink(missing_ok=True)
        log.info("KV tier: could not keep the weights' digest in %s (%s)", memo, exc)
