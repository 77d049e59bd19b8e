"""The second tier's files and folder are the user's alone, and the weights' digest sees a
replaced file (issue 43): a symlink planted where the store writes or reads is never followed,
a folder others may write (or that is a symlink, or not the user's) is refused and the engine
runs without a second tier, and weights replaced by a same-size file with the old mtime
(``cp -p``, ``os.utime``) get a new digest, so the old KV is never served for them."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

from engine.kvcache import kv_tier, tier_identity
from engine.kvcache.kv_tier import DiskStore
from engine.kvcache.tier_folder import TierUnsafe
from engine.types import CacheKey
from tests.engine.test_kv_tier import chunk, geometry

LOGGER = "engine.kvcache.kv_tier"
A, B = "a" * 40, "b" * 40



# ------------------------------------------------------------------- symlinks are never followed
def test_a_symlink_at_the_temporary_name_is_never_written_through(tmp_path, monkeypatch):
    folder, victim = tmp_path / "tier", tmp_path / "victim"
    victim.write_bytes(b"precious")
    store = DiskStore(folder, 2**20, geometry())
    (folder / f"{A}.tmp{os.getpid()}").symlink_to(victim)  # the name the store used to write under
    assert store.put(A, chunk(1)) and torch.equal(store.get(A), chunk(1))
    assert victim.read_bytes() == b"precious"
    planted = folder / f"{B}.kv.tmp-planted"  # even where the link is at the very name chosen: refused, not followed
    planted.symlink_to(victim)
    monkeypatch.setattr(kv_tier, "temporary_name", lambda target: planted)
    assert not store.put(B, chunk(2)) and B not in store and store.failed_writes == 1
    assert victim.read_bytes() == b"precious" and planted.is_symlink()
    store.close()


def test_a_chunk_file_that_is_a_symlink_is_not_read(tmp_path, caplog):
    elsewhere = DiskStore(tmp_path / "elsewhere", 2**20, geometry())
    assert elsewhere.put(A, chunk(3))
    elsewhere.close()
    target = tmp_path / "elsewhere" / f"{A}.kv"
    folder = tmp_path / "tier"
    folder.mkdir(mode=0o700)
    (folder / f"{A}.kv").symlink_to(target)  # a valid chunk, but not this folder's file
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        store = DiskStore(folder, 2**20, geometry())
    assert A not in store and store.bad_chunks == 1 and "skipping" in caplog.text
    assert target.exists() and not (folder / f"{A}.kv").is_symlink()  # the link went, its target stayed
    store.close()


def test_a_paths_file_or_lock_that_is_a_symlink_is_not_followed(tmp_path):
    folder = tmp_path / "tier"
    store = DiskStore(folder, 2**20, geometry())
    store.write_paths([CacheKey(tuple(range(64)))])
    store.close()
    outside = tmp_path / "paths.json"
    os.replace(folder / "spilled-paths.json", outside)
    (folder / "spilled-paths.json").symlink_to(outside)
    again = DiskStore(folder, 2**20, geometry())
    assert again.read_paths() == [] and json.loads(outside.read_text())["paths"]
    again.close()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (folder / ".lock").unlink()
    (folder / ".lock").symlink_to(victim)  # the store used to open it "a+" and write its pid in it
    with pytest.raises(OSError):
        DiskStore(folder, 2**20, geometry())
    assert victim.read_text() == "precious"


# ------------------------------------------------------------------- the folder is the user's alone
@pytest.mark.parametrize("how", ["world-writable", "group-writable", "a symlink"])
def test_a_tier_folder_others_may_write_is_refused(tmp_path, how):
    folder = tmp_path / "tier"
    if how == "a symlink":
        (tmp_path / "real").mkdir(mode=0o700)
        folder.symlink_to(tmp_path / "real")
    else:
        folder.mkdir()
        folder.chmod(0o777 if how == "world-writable" else 0o770)
    with pytest.raises(TierUnsafe):
        DiskStore(folder, 2**20, geometry())
    assert not any(p.name == ".lock" for p in (tmp_path / "real" if how == "a symlink" else folder).iterdir())


def test_a_new_tier_folder_is_private(tmp_path):
    store = DiskStore(tmp_path / "a" / "tier", 2**20, geometry())
    assert (store.folder.stat().st_mode & 0o777) == 0o700
    store.close()


def test_an_engine_whose_tier_folder_others_may_write_runs_without_a_tier(tiny_runner, tmp_path, caplog, make_engine):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # not sticky: anyone may rename or plant folders in it
    with caplog.at_level(logging.WARNING):
        engine = make_engine(budget_bytes=300 * tiny_runner.kv_bytes_per_token, tier_bytes=2**24,
                             tier_dir=str(shared))
    assert engine.tier is None and not engine.capabilities.second_tier
    lines = [r.getMessage() for r in caplog.records if "without a second tier" in r.getMessage()]
    assert len(lines) == 1 and "written by others" in lines[0] and "\n" not in lines[0]
    assert not (shared / "weight-digests.json").exists()  # nothing of ours is kept where others write
    private = tmp_path / "private"  # the same engine on a folder of the user's alone has its tier
    other = make_engine(budget_bytes=300 * tiny_runner.kv_bytes_per_token, tier_bytes=2**24,
                        tier_dir=str(private))
    assert other.tier is not None and (private.stat().st_mode & 0o077) == 0
    assert (other.tier.folder.stat().st_mode & 0o777) == 0o700


# ------------------------------------------------------------------- the weights' digest
@pytest.fixture
def long_after(monkeypatch):
    """As if each hash came long after the file's last change (the racy-file rule does not apply)."""
    monkeypatch.setattr(tier_identity, "_RACY_NS", -(10**15))


def _same_size_same_mtime(path, content: bytes, staging) -> None:
    """Replace ``path``'s content by ``content`` (same size) with ``shutil.copy2``, then set the old mtime back."""
    st = path.stat()
    staging.write_bytes(content)
    shutil.copy2(staging, path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_weights_replaced_by_a_same_size_copy_with_the_old_mtime_get_a_new_digest(tmp_path, long_after):
    weights, memo = tmp_path / "model.safetensors", tmp_path / "tier" / "weight-digests.json"
    weights.write_bytes(b"A" * 4096)
    first = kv_tier.weights_digest([weights], memo=memo)
    assert kv_tier.weights_digest([weights], memo=memo) == first
    _same_size_same_mtime(weights, b"B" * 4096, tmp_path / "other.safetensors")
    replaced = kv_tier.weights_digest([weights], memo=memo)
    assert replaced != first and replaced == kv_tier.weights_digest([weights])  # as a fresh hash says


def test_a_change_outside_the_sampled_blocks_is_seen_by_the_files_identity(tmp_path, long_after):
    """A large file whose changed bytes the content sample does not read: the inode (a file moved
    into place) or the ctime (a write in place, whatever mtime is set back) gives it away."""
    size = 4 * 2**20
    weights, memo = tmp_path / "model.safetensors", tmp_path / "tier" / "weight-digests.json"
    data = bytearray(os.urandom(size))
    weights.write_bytes(bytes(data))
    first = kv_tier.weights_digest([weights], memo=memo)
    middle = 2 * 2**20 + 12345  # between two of the 16 sampled blocks
    assert all(not (o <= middle < o + tier_identity._SAMPLE_BYTES)
               for o in (i * (size - tier_identity._SAMPLE_BYTES) // 15 for i in range(16)))
    data[middle] ^= 0xFF
    st = weights.stat()
    staged = tmp_path / "new.safetensors"
    staged.write_bytes(bytes(data))
    os.utime(staged, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(staged, weights)  # a new inode at the old path, same size and mtime
    moved = kv_tier.weights_digest([weights], memo=memo)
    assert moved != first and moved == kv_tier.weights_digest([weights])


def test_the_memo_is_not_believed_from_a_file_others_may_write(tmp_path, long_after):
    weights, memo = tmp_path / "model.safetensors", tmp_path / "tier" / "weight-digests.json"
    weights.write_bytes(b"A" * 4096)
    first = kv_tier.weights_digest([weights], memo=memo)
    table = json.loads(memo.read_text())
    table[str(weights)]["sha256"] = "0" * 64  # what someone else would write there
    memo.write_text(json.dumps(table))
    memo.chmod(0o666)
    assert kv_tier.weights_digest([weights], memo=memo) == first
    os.unlink(memo)
    (tmp_path / "forged.json").write_text(json.dumps(table))
    memo.symlink_to(tmp_path / "forged.json")
    assert kv_tier.weights_digest([weights], memo=memo) == first
