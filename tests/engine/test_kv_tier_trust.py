"""The second tier's trust rules (issue #27), on real files: a chunk file is checked field by
field against the store's geometry before any byte is handed out; the spilled-paths file entry by
entry; LRU order survives a restart; one store per folder; a full disk (a real EFBIG from a file
size limit) keeps what was kept and warns once; the tier's folder is named by the weights, the
linear kernels and the mode."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import signal
import subprocess
import sys
import tracemalloc
import zlib
from pathlib import Path

import pytest
import torch

from engine.kvcache import kv_tier
from engine.kvcache.kv_tier import CHUNK_TOKENS, ChunkGeometry, DiskStore, HostStore
from engine.kvcache.tier_folder import TierBusy
from engine.types import CacheKey
from tests.conftest import make_tiny_runner
from tests.engine.test_kv_tier import chunk, geometry, req
from tests.engines import rand_ids

C = CHUNK_TOKENS
LOGGER = "engine.kvcache.kv_tier"
A, B, D, E, F, G = ("a" * 40, "b" * 40, "d" * 40, "e" * 40, "f" * 40, "0" * 40)
SIZE = geometry().nbytes


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


def hostile_file(folder: Path, key: str, kv: torch.Tensor, dtype_name: str | None = None) -> Path:
    """A chunk file as another geometry (or a hostile writer) leaves it: header and CRC consistent
    with its own payload, so only the geometry check can catch it."""
    payload = kv.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    _, layers, heads, tokens, dim = kv.shape
    name = dtype_name or str(kv.dtype).removeprefix("torch.")
    header = kv_tier._HEADER.pack(kv_tier._MAGIC, key.encode(), name.encode(), layers, heads, tokens, dim,
                                  len(payload), zlib.crc32(payload))
    path = folder / f"{key}.kv"
    path.write_bytes(header + payload)
    return path


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


HOSTILE = {  # name -> (payload tensor, dtype name in the header)
    "a dtype name that is a torch attribute but no dtype": (chunk(1), "Tensor"),
    "an unknown dtype name": (chunk(1), "float1024"),
    "another dtype": (chunk(1, torch.float16), None),
    "one layer too many": (randn(2, 3, 2, C, 16), None),
    "another head count": (randn(2, 2, 3, C, 16), None),
    "more than 64 tokens": (randn(2, 2, 2, C + 1, 16), None),
    "fewer than 64 tokens": (randn(2, 2, 2, C - 1, 16), None),
    "another head_dim": (randn(2, 2, 2, C, 8), None),
}


# ------------------------------------------------------------------- 1. shape from the geometry
@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_chunk_of_another_shape_is_dropped_with_one_line_and_on_drop(tmp_path, caplog, case):
    store = DiskStore(tmp_path, 10 * 2**20, geometry())
    dropped: list[str] = []
    store.on_drop = dropped.append
    assert store.put(A, chunk(0))
    kv, name = HOSTILE[case]
    hostile_file(tmp_path, A, kv, name)  # the file under the indexed key is replaced
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store.get(A) is None
    assert len(warnings_of(caplog)) == 1 and A in warnings_of(caplog)[0]
    assert A not in store and dropped == [A] and store.bad_chunks == 1 and store.bytes_in_use == 0
    assert not (tmp_path / f"{A}.kv").exists()
    assert store.put(B, chunk(2)) and torch.equal(store.get(B), chunk(2))  # the store goes on


@pytest.mark.parametrize("case", list(HOSTILE))
def test_the_scan_at_start_rejects_a_header_of_another_geometry(tmp_path, caplog, case):
    kv, name = HOSTILE[case]
    hostile_file(tmp_path, A, kv, name)
    hostile_file(tmp_path, B, chunk(2))  # a good one beside it
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        store = DiskStore(tmp_path, 10 * 2**20, geometry())
    assert A not in store and B in store and store.bad_chunks == 1 and len(warnings_of(caplog)) == 1
    assert not (tmp_path / f"{A}.kv").exists()
    assert torch.equal(store.get(B), chunk(2))


def test_get_returns_exactly_the_geometry_and_bad_files_of_every_kind_cost_one_line(tmp_path, caplog):
    store = DiskStore(tmp_path, 10 * 2**20, geometry(torch.bfloat16))
    for key in (A, B, D, E):
        store.put(key, chunk(3, torch.bfloat16))
    kv = store.get(A)
    assert kv.shape == geometry().shape and kv.dtype == torch.bfloat16 and kv.device.type == "cpu"
    path = tmp_path / f"{B}.kv"
    path.write_bytes(path.read_bytes()[:-1])  # truncated by one byte
    path = tmp_path / f"{D}.kv"
    path.write_bytes(path.read_bytes() + b"\0")  # one byte too many
    (tmp_path / f"{E}.kv").unlink()  # gone (unreadable)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store.get(B) is None and store.get(D) is None and store.get(E) is None
    assert len(warnings_of(caplog)) == 3 and store.bad_chunks == 3 and store.num_chunks == 1


def test_a_read_holds_one_copy_of_the_chunk(tmp_path):
    """The payload is read into the tensor returned: no bytes object of the chunk's size on the way."""
    store = DiskStore(tmp_path, 10 * 2**20, geometry())
    store.put(A, chunk(4))
    tracemalloc.start()
    try:
        kv = store.get(A)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert torch.equal(kv, chunk(4))
    assert peak < SIZE // 4, f"{peak} bytes allocated in Python objects for a {SIZE}-byte chunk"


@pytest.mark.parametrize("make", [lambda p: DiskStore(p, 10 * 2**20, geometry()),
                                  lambda p: HostStore(10 * 2**20, geometry())])
def test_put_refuses_a_tensor_of_another_shape_or_dtype(tmp_path, make):
    store = make(tmp_path)
    with pytest.raises(ValueError, match="KV chunk must be"):
        store.put(A, randn(2, 3, 2, C, 16))
    with pytest.raises(ValueError, match="KV chunk must be"):
        store.put(A, chunk(0, torch.bfloat16))
    assert A not in store and store.put(A, chunk(0)) and torch.equal(store.get(A), chunk(0))


def test_chunk_geometry_names_the_shape_and_bytes():
    g = ChunkGeometry(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.float32)
    assert g.shape == (2, 30, 3, 64, 64) and g.nbytes == 46_080 * 64  # the embedded model's KV per token, x64


# ------------------------------------------------------------------- 2. the spilled-paths file
def test_paths_round_trip_in_the_format_the_cache_wrote(tmp_path):
    store = DiskStore(tmp_path, 2**20, geometry())
    assert store.read_paths() == []  # no file yet: nothing, and no complaint
    paths = [CacheKey((1, 2, 3)), CacheKey(tuple(range(130)), "v-alice", 64)]
    store.write_paths(paths)
    assert store.read_paths() == paths
    assert json.loads(store.paths_file.read_text()) == {"version": 1, "paths": [
        {"ids": [1, 2, 3], "namespace": "", "public_len": 0},
        {"ids": list(range(130)), "namespace": "v-alice", "public_len": 64}]}
    assert [p.name for p in tmp_path.iterdir() if ".tmp" in p.name] == []
    host = HostStore(2**20, geometry())
    host.write_paths(paths)
    assert host.read_paths() == []


def test_bad_path_entries_are_skipped_with_one_line(tmp_path, caplog):
    store = DiskStore(tmp_path, 2**20, geometry())
    good = {"ids": [5, 6, 7], "namespace": "", "public_len": 0}
    bad = [
        {"ids": [1, 2**63], "namespace": "", "public_len": 0},  # made chunk_key raise in RadixCache.__init__
        {"ids": [2**31], "namespace": "", "public_len": 0},
        {"ids": [-1], "namespace": "", "public_len": 0},
        {"ids": ["5"], "namespace": "", "public_len": 0},
        {"ids": [1.5], "namespace": "", "public_len": 0},
        {"ids": [True], "namespace": "", "public_len": 0},
        {"ids": "1,2", "namespace": "", "public_len": 0},
        {"ids": [1, 2, 3], "namespace": "", "public_len": 4},
        {"ids": [1, 2, 3], "namespace": "", "public_len": -1},
        {"ids": [1, 2, 3], "namespace": "", "public_len": 1.0},
        {"ids": [1, 2, 3], "namespace": 5, "public_len": 0},
        {"ids": [1, 2, 3], "namespace": "x" * 10_000, "public_len": 0},
        {"ids": [1, 2, 3], "namespace": "\ud800", "public_len": 0},  # a lone surrogate: chunk_key cannot encode it
        {"ids": [1, 2, 3], "public_len": 0},
        [1, 2, 3],
        None,
    ]
    store.paths_file.write_text(json.dumps({"version": 1, "paths": [good, *bad, good]}))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        paths = store.read_paths()
    assert paths == [CacheKey((5, 6, 7))] * 2
    assert len(warnings_of(caplog)) == 1 and str(len(bad)) in warnings_of(caplog)[0]


BAD_PATHS_FILES = {"not json": b"not json", "a list": b"[]", "version 2": b'{"version": 2, "paths": []}',
                   "paths not a list": b'{"version": 1, "paths": {}}', "no paths": b'{"version": 1}',
                   "not utf-8": b"\xff\xfe\x00", "nested too deep": b"[" * 200_000, "empty": b""}


@pytest.mark.parametrize("content", list(BAD_PATHS_FILES.values()), ids=list(BAD_PATHS_FILES))
def test_a_bad_paths_file_gives_nothing_with_one_line_and_never_raises(tmp_path, caplog, content):
    store = DiskStore(tmp_path, 2**20, geometry())
    store.paths_file.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store.read_paths() == []
    assert len(warnings_of(caplog)) == 1


# ------------------------------------------------------------------- 3. LRU order across restarts
def test_a_restart_keeps_the_most_recently_used_chunks(tmp_path):
    store = DiskStore(tmp_path, 3 * SIZE, geometry())
    for i, key in enumerate((A, B, D)):
        store.put(key, chunk(i))
    store.get(A)  # A is now the most recently used, then D, then B
    store.close()
    again = DiskStore(tmp_path, 2 * SIZE, geometry())  # a smaller budget: one must go
    assert A in again and D in again and B not in again
    assert sorted(p.stem for p in tmp_path.glob("*.kv")) == sorted([A, D])
    again.put(E, chunk(5))  # the order came back too: D (older than A's hit) goes first
    assert A in again and D not in again and E in again


def test_a_put_of_a_kept_chunk_refreshes_it(tmp_path):
    store = DiskStore(tmp_path, 2 * SIZE, geometry())
    store.put(A, chunk(0))
    store.put(B, chunk(1))
    store.put(A, chunk(0))  # kept already: now the most recently used
    store.close()
    again = DiskStore(tmp_path, SIZE, geometry())
    assert A in again and B not in again


# ------------------------------------------------------------------- 4. one store per folder
def test_a_second_store_on_the_folder_is_refused_until_the_first_closes(tmp_path):
    first = DiskStore(tmp_path, 2**20, geometry())
    first.put(A, chunk(0))
    with pytest.raises(TierBusy, match=str(tmp_path)):
        DiskStore(tmp_path, 2**20, geometry())
    first.close()
    assert first.get(A) is None and first.put(B, chunk(1)) is False  # a closed store keeps nothing more
    assert first.paths_file is None  # nor writes the paths into a folder another engine may hold now
    second = DiskStore(tmp_path, 2**20, geometry())
    assert A in second and torch.equal(second.get(A), chunk(0))
    second.close()


def test_another_process_gets_tier_busy(tmp_path):
    store = DiskStore(tmp_path, 2**20, geometry())
    child = ("import sys, torch\n"
             "from engine.kvcache.kv_tier import ChunkGeometry, DiskStore\n"
             "from engine.kvcache.tier_folder import TierBusy\n"
             "try:\n"
             "    DiskStore(sys.argv[1], 2**20, ChunkGeometry(2, 2, 16, torch.float32))\n"
             "except TierBusy as exc:\n"
             "    print('BUSY', exc)\n"
             "else:\n"
             "    print('OPENED')\n")
    out = subprocess.run([sys.executable, "-c", child, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.startswith("BUSY"), out.stdout + out.stderr
    assert str(tmp_path) in out.stdout and str(os.getpid()) in out.stdout
    store.close()


def test_an_engine_whose_tier_folder_is_held_runs_without_a_tier(tiny_runner, tmp_path, caplog, make_engine):
    first = make_engine(budget_bytes=500 * tiny_runner.kv_bytes_per_token, tier_bytes=2**24,
                        tier_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="engine.tier_setup"):
        second = make_engine(budget_bytes=500 * tiny_runner.kv_bytes_per_token, tier_bytes=2**24,
                             tier_dir=str(tmp_path))
    assert first.tier is not None and second.tier is None and not second.capabilities.second_tier
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.tier_setup"]
    assert len(lines) == 1 and "without a second tier" in lines[0] and str(tmp_path) in lines[0]
    second.close()
    first.close()
    third = make_engine(budget_bytes=500 * tiny_runner.kv_bytes_per_token, tier_bytes=2**24,
                        tier_dir=str(tmp_path))  # the first released the folder at close
    assert third.tier is not None


def test_an_engine_whose_tier_folder_cannot_be_made_runs_without_a_tier(tiny_runner, tmp_path, caplog, make_engine):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the tier's folder would go")
    with caplog.at_level(logging.WARNING, logger="engine.tier_setup"):
        engine = make_engine(budget_bytes=500 * tiny_runner.kv_bytes_per_token, tier_bytes=2**24,
                             tier_dir=str(blocker))
    assert engine.tier is None and "without a second tier" in caplog.text


# ------------------------------------------------------------------- 5. a full disk
@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """A real write failure: past RLIMIT_FSIZE the kernel refuses the write (EFBIG), as a full disk does."""
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, handler)


def test_a_full_disk_keeps_what_was_kept_leaves_no_temp_file_and_warns_once(tmp_path, caplog):
    store = DiskStore(tmp_path, 3 * SIZE, geometry())
    dropped: list[str] = []
    store.on_drop = dropped.append
    for i, key in enumerate((A, B, D)):
        store.put(key, chunk(i))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with file_size_limit(SIZE // 2):
            assert store.put(E, chunk(4)) is False
            assert store.put(F, chunk(5)) is False
        assert len(warnings_of(caplog)) == 1 and "could not write" in warnings_of(caplog)[0]
        assert {A, B, D} == {k for k in (A, B, D, E, F) if k in store} and dropped == []
        assert store.bytes_in_use == 3 * SIZE and store.failed_writes == 2
        assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".kv" or ".tmp" in p.name) == \
            sorted(f"{k}.kv" for k in (A, B, D))
        assert all(torch.equal(store.get(k), chunk(i)) for i, k in enumerate((A, B, D)))
        assert store.put(G, chunk(6))  # the disk has room again: the least recently used goes now
        assert dropped == [A] and G in store
        with file_size_limit(SIZE // 2):
            assert store.put(E, chunk(4)) is False
    assert len(warnings_of(caplog)) == 2  # once more after a write had succeeded


def test_the_scan_removes_temporary_files_left_by_a_crash(tmp_path):
    store = DiskStore(tmp_path, 2**20, geometry())
    store.put(A, chunk(0))
    store.close()
    for name in (f"{B}.tmp{2**22 + 7}", f"{D}.tmp{os.getpid()}", "spilled-paths.tmp12345"):
        (tmp_path / name).write_bytes(b"half a chunk")
    again = DiskStore(tmp_path, 2**20, geometry())
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [f"{A}.kv"]
    assert A in again


# ------------------------------------------------------------------- 6. what names the tier
def test_the_fingerprint_covers_weights_and_packed_linears(tokenizer):
    base = dict(model_name="m", dtype=torch.float32, tokenizer=tokenizer, num_layers=2, num_kv_heads=2, head_dim=16)
    prints = {kv_tier.fingerprint(**base), kv_tier.fingerprint(**base, weights="w1"),
              kv_tier.fingerprint(**base, weights="w2"), kv_tier.fingerprint(**base, packed_linear=True)}
    assert len(prints) == 4
    assert kv_tier.fingerprint(**base, weights="w1") == kv_tier.fingerprint(**base, weights="w1")


def test_the_fingerprint_names_how_many_rows_our_linears_take(tokenizer):
    """Which kernel computed a prefill chunk's KV depends on the float32 row limit of ours (MKL's
    product past it), so another limit names another tier; the one a runner uses is recorded."""
    from engine.model import native_linear
    from engine.tier_setup import tier_fingerprint

    base = dict(model_name="m", dtype=torch.float32, tokenizer=tokenizer, num_layers=2, num_kv_heads=2, head_dim=16)
    assert kv_tier.fingerprint(**base, native_linear=True) == kv_tier.fingerprint(**base, native_linear=1)
    assert len({kv_tier.fingerprint(**base, native_linear=n) for n in (0, 32, 128)}) == 3

    class Runner:  # what tier_fingerprint reads of a runner, with our linears in use
        name, dtype, num_layers, num_kv_heads, head_dim, native_linears = "m", torch.float32, 2, 2, 16, 7

        class text:
            pass

    Runner.text.tokenizer = tokenizer
    assert tier_fingerprint(Runner(), None) == kv_tier.fingerprint(**base, native_linear=native_linear.MAX_ROWS)


def test_the_fingerprint_names_the_attention_kernels(tokenizer):
    base = dict(model_name="m", dtype=torch.float32, tokenizer=tokenizer, num_layers=2, num_kv_heads=2, head_dim=16)
    assert kv_tier.fingerprint(**base) == kv_tier.fingerprint(**base, attention="")  # the names tiers had before
    assert len({kv_tier.fingerprint(**base, attention=a) for a in ("", "cpu_sdpa", "cpu_native (AVX2)")}) == 3


def test_a_restart_on_another_attention_backend_never_reads_the_old_kv(tiny_runner, tokenizer, tmp_path, monkeypatch,
                                                                       make_engine):
    """The second run with ``RADIX_ATTENTION_BACKEND`` set to another kernel: KV the first run's
    attention computed differs in its last bits from what this one computes, so none of it is read;
    a third run on the first backend starts empty and consistent (the second removed the folder)."""
    doc = rand_ids(12, 2 * C + 1, len(tokenizer))
    kw = dict(budget_bytes=1000 * tiny_runner.kv_bytes_per_token, tier_bytes=2**24, tier_dir=str(tmp_path))
    first = make_engine(**kw)
    first.run(req(doc, 2))
    first.close()
    assert first.tier.num_chunks >= 2
    other_backend = "cpu_sdpa" if tiny_runner.attention.name != "cpu_sdpa" else "math_chunked"
    monkeypatch.setenv("RADIX_ATTENTION_BACKEND", other_backend)  # an alias of RADIX_KERNELS=attention=...
    other = make_tiny_runner(tokenizer)
    try:
        assert other.attention.name == other_backend
        second = make_engine(other, **kw)
        assert second.tier.folder != first.tier.folder
        assert second.stats().tier_chunks == 0 and second.run(req(doc + [9], 2)).tier_tokens == 0
        second.close()
        second.check_invariants()
    finally:
        other.close()
    third = make_engine(**kw)
    assert third.tier.folder == first.tier.folder and third.run(req(doc + [9], 2)).tier_tokens == 0
    third.check_invariants()


def test_the_weights_digest_of_files_is_memoized_while_the_file_is_unchanged(tmp_path, monkeypatch):
    from engine.kvcache import tier_identity

    monkeypatch.setattr(tier_identity, "_RACY_NS", -(10**15))  # as if each hash came long after the file's last change
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\1" * 4096)
    memo = tmp_path / "tier" / "weight-digests.json"
    first = kv_tier.weights_digest([weights], memo=memo)
    assert first and kv_tier.weights_digest([weights]) == first
    table = json.loads(memo.read_text())
    entry = table[str(weights)]
    st = weights.stat()
    assert (entry["size"], entry["mtime_ns"], entry["ctime_ns"], entry["ino"]) == (
        4096, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    entry["sha256"] = "0" * 64  # an unchanged file is not hashed again: the memo is believed
    memo.write_text(json.dumps(table))
    assert kv_tier.weights_digest([weights], memo=memo) != first
    weights.write_bytes(b"\2" * 4096)  # retrained: same size, new content and time
    os.utime(weights, ns=(entry["mtime_ns"] + 10**9, entry["mtime_ns"] + 10**9))
    retrained = kv_tier.weights_digest([weights], memo=memo)
    assert retrained != first and retrained == kv_tier.weights_digest([weights])


def test_a_retrained_checkpoint_of_the_same_name_never_reads_the_old_kv(tiny_runner, tokenizer, tmp_path, make_engine):
    retrained = make_tiny_runner(tokenizer, seed=1)  # same name, dtype, tokenizer and geometry; other weights
    assert retrained.name == tiny_runner.name
    assert kv_tier.weights_digest((), retrained.model) != kv_tier.weights_digest((), tiny_runner.model)
    vocab = len(tokenizer)
    doc = rand_ids(11, 2 * C + 1, vocab)
    first = make_engine(budget_bytes=1000 * tiny_runner.kv_bytes_per_token, tier_bytes=2**24,
                        tier_dir=str(tmp_path))
    first.run(req(doc, 2))
    first.close()
    assert first.tier.num_chunks >= 2
    other = make_engine(retrained, budget_bytes=1000 * retrained.kv_bytes_per_token, tier_bytes=2**24,
                        tier_dir=str(tmp_path))
    assert other.stats().tier_chunks == 0 and other.run(req(doc + [9], 2)).tier_tokens == 0
    other.close()
    retrained.close()


def test_an_isolated_run_never_reads_what_a_shared_run_wrote(tiny_runner, tmp_path, make_engine):
    vocab = len(tiny_runner.text.tokenizer)
    chat = rand_ids(12, 2 * C + 1, vocab)  # a visitor's chat, public in a run without isolation
    shared = make_engine(budget_bytes=1000 * tiny_runner.kv_bytes_per_token, tier_bytes=2**24,
                         tier_dir=str(tmp_path))
    shared.run(req(chat, 2))
    shared.close()
    isolated = make_engine(budget_bytes=1000 * tiny_runner.kv_bytes_per_token, tier_bytes=2**24,
                           tier_dir=str(tmp_path), isolation=True)
    assert isolated.stats().tier_chunks == 0 and isolated.run(req(chat + [9], 2)).tier_tokens == 0
    assert shared.tier.folder.name.endswith("-shared") and isolated.tier.folder.name.endswith("-isolated")
    assert shared.tier.folder.name.removesuffix("-shared") == isolated.tier.folder.name.removesuffix("-isolated")


def test_a_start_removes_the_tiers_it_can_never_read_but_not_a_running_engines(tiny_runner, tmp_path, make_engine):
    """--disk-cache-mb bounds the disk: another configuration's folder (model, weights, dtype, mode)
    goes at the next start, unless an engine holds it now; other files beside them stay."""
    vocab = len(tiny_runner.text.tokenizer)
    shared = make_engine(budget_bytes=1000 * tiny_runner.kv_bytes_per_token, tier_bytes=2**24,
                         tier_dir=str(tmp_path))
    shared.run(req(rand_ids(13, 2 * C + 1, vocab), 2))
    shared.close()
    legacy = tmp_path / "0123456789abcdef"  # a folder named by a fingerprint alone (before the mode was in it)
    legacy.mkdir()
    (legacy / "x.kv").write_bytes(b"old")
    (tmp_path / "notes").mkdir()  # not a tier's folder: never touched
    held = DiskStore(tmp_path / "fedcba9876543210-shared", 2**20, geometry())
    isolated = make_engine(budget_bytes=1000 * tiny_runner.kv_bytes_per_token, tier_bytes=2**24,
                           tier_dir=str(tmp_path), isolation=True)
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert names == sorted([isolated.tier.folder.name, held.folder.name, "notes"])
    isolated.close()
    held.close()
