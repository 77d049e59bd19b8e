"""The second tier's folder on disk: the user's alone, held by one store, and old tiers pruned.

Owns: the folder's safety rule (``unsafe_folder``, ``TierUnsafe``), how a file in it is opened
(``open_new``, ``open_regular``, ``temporary_name``), its lock (``lock_folder``, ``TierBusy``)
and the removal of tier folders this configuration can never read (``prune_other_tiers``).
Knows nothing about chunks, their format or their budget (``engine.kvcache.kv_tier``'s
``DiskStore`` keeps those), nor about trees or requests.

THE FOLDER IS THE USER'S ALONE (issue 43). Whoever can write the folder can plant a chunk
whose header and CRC are right and whose KV is wrong, or a symlink where the store writes.
So a store refuses (``TierUnsafe``: the engine runs without a second tier and says why in
one line) a folder that is a symlink, that the user does not own, or that its group or
others may write (``mode & 0o022``); it creates its folder with mode 0o700. Its parent,
where the weights' digests are kept (``engine.tier_setup``), must be the user's or root's
and not writable by others unless sticky (as ``/tmp``). Every file is opened without
following a symlink (``O_NOFOLLOW``) and must be a regular file; a temporary file gets a
fresh random name and is created exclusively (``O_CREAT | O_EXCL``, mode 0o600), so a
link planted at any name is never followed and its target never written.

ONE STORE A FOLDER. A store holds an exclusive ``flock`` on the folder's ``.lock`` for its
lifetime (``TierBusy`` for a second store, in this process or another); the lock file says
the holder's pid.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import secrets
import shutil
import stat
from pathlib import Path
from typing import IO

log = logging.getLogger("engine.kvcache.kv_tier")  # the tier's one log, as before the split

_LOCK_NAME = ".lock"
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_TIER_FOLDER = re.compile(r"^[0-9a-f]{16}(-shared|-isolated)?$")  # a fingerprint, and the mode since #27


class TierBusy(RuntimeError):
    """Another store (another process, or another engine in this one) holds the tier's folder."""


class TierUnsafe(RuntimeError):
    """The tier's folder is not the user's alone (module docstring): the engine runs without it."""


def unsafe_folder(path: Path, parent: bool = False) -> str:
    """Why ``path`` may not hold a tier's files (the module docstring's rule), or "" if it may.
    With ``parent`` (the folder the tier folders and the weights' digests sit in): it may be a
    symlink and root's, and others may write it when it is sticky."""
    try:
        st = os.stat(path) if parent else os.lstat(path)
    except OSError as exc:
        return f"cannot be checked ({exc.strerror or exc})"
    if not stat.S_ISDIR(st.st_mode):
        return "is a symlink or not a folder"
    owners = (os.geteuid(), 0) if parent else (os.geteuid(),)
    if st.st_uid not in owners:
        return f"belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o022 and not (parent and st.st_mode & stat.S_ISVTX):
        return f"may be written by others (mode {stat.S_IMODE(st.st_mode):o}; chmod go-w it)"
    return ""


def open_new(path: Path) -> int:
    """A new file at ``path``, created exclusively (never an existing file, never through a
    symlink), mode 0o600: its descriptor, open for writing."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)


def open_regular(path: Path) -> int:
    """``path`` opened for reading without following a symlink; OSError unless it is a regular
    file (a FIFO or a device planted there is never read from)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path.name} is not a regular file")
    return fd


def temporary_name(target: Path) -> Path:
    """A fresh name beside ``target`` for writing it (pid and a random suffix; ``*.tmp*``)."""
    return target.with_name(f"{target.name}.tmp{os.getpid()}-{secrets.token_hex(6)}")


def lock_folder(folder: Path) -> IO[str]:
    """flock on a file description of our own (a fresh open, never a dup), so the lock is the
    caller's: a second store, in another process or this one, is refused (``TierBusy``). The
    open file is returned, the lock held while it stays open; it says this process's pid."""
    path = folder / _LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise TierUnsafe(f"the KV tier folder's lock {path} is not a regular file")
    f = os.fdopen(fd, "r+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        f.seek(0)
        holder = f.read().strip()[:20]
        f.close()
        raise TierBusy(f"the KV tier folder {folder} is in use by another engine "
                       f"(pid {holder or 'unknown'}); {exc.strerror or exc}") from exc
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    return f


def prune_other_tiers(parent: Path, keep: Path) -> int:
    """Remove the tier folders under ``parent`` other than ``keep`` that no engine holds now (their
    lock is free): tiers of another model, weights, dtype or mode, which this run can never read.
    So the disk holds the tier of the configuration that runs, plus those of engines running
    beside it, and ``--disk-cache-mb`` bounds each. Returns the bytes removed."""
    removed = 0
    for folder in sorted(parent.iterdir()):
        if folder == keep or not folder.is_dir() or folder.is_symlink() or not _TIER_FOLDER.match(folder.name):
            continue
        try:
            with os.fdopen(os.open(folder / _LOCK_NAME, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600), "r+") as f:
                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue  # another engine's, running now
                size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
                shutil.rmtree(folder)
                removed += size
        except OSError as exc:
            log.warning("KV tier: could not remove the old tier %s (%s)", folder.name, exc)
    if removed:
        log.info("KV tier: removed %.0f MiB of tiers this configuration cannot read", removed / 2**20)
    return removed
