"""engine.model.loader: what an interrupted first start leaves behind is removed at the next start, and
nothing else is; dtype names. No model is loaded here."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.model import loader
from engine.model.loader import (
    STALE_AFTER_S,
    ModelLoadError,
    converted_cache_dir,
    load_model,
    remove_stale_conversions,
    resolve_dtype,
)


@pytest.fixture
def cache_root(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("RADIX_PLAYGROUND_CACHE", str(tmp_path))
    return tmp_path


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def fake_conversion(root: Path, pid: int | str, size_bytes: int = 1024) -> Path:
    folder = root / f"{converted_cache_dir().name}.tmp{pid}"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"\0" * size_bytes)
    (folder / "config.json").write_text("{}")
    return folder


def test_stale_conversion_folders_are_removed_and_nothing_else(cache_root):
    stale = fake_conversion(cache_root, dead_pid())
    huge_pid = fake_conversion(cache_root, "9" * 30)  # no process can have it
    mine = fake_conversion(cache_root, os.getpid())  # this process is not converting: left by an earlier run
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        running = fake_conversion(cache_root, sleeper.pid)  # another process converting right now
        keep = [converted_cache_dir(), cache_root / "other-model.tmp123",
                cache_root / f"{converted_cache_dir().name}.tmpabc", cache_root / f"{converted_cache_dir().name}.tmp1x"]
        for folder in keep:
            folder.mkdir()
        a_file = cache_root / f"{converted_cache_dir().name}.tmp{dead_pid()}.txt"
        a_file.write_text("not a folder of ours")
        removed = remove_stale_conversions()
        assert sorted(removed) == sorted([stale, huge_pid, mine])
        assert not stale.exists() and not huge_pid.exists() and not mine.exists()
        assert running.exists() and all(f.exists() for f in keep) and a_file.exists()
        # Once that process is gone, its folder is stale too.
        sleeper.kill()
        sleeper.wait()
        assert remove_stale_conversions() == [running] and not running.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_live_pid_whose_folder_is_hours_old_was_reused(cache_root):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        folder = fake_conversion(cache_root, sleeper.pid)
        assert remove_stale_conversions() == []
        assert remove_stale_conversions(now=time.time() + STALE_AFTER_S + 60) == [folder]
    finally:
        sleeper.kill()
        sleeper.wait()


def test_no_cache_folder_yet_is_fine(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIX_PLAYGROUND_CACHE", str(tmp_path / "missing"))
    assert remove_stale_conversions() == []


def test_a_start_removes_what_an_interrupted_start_left(cache_root, monkeypatch):
    """The cleanup runs at start, before any loading (which fails here, offline, with no weights)."""
    import transformers

    stale = fake_conversion(cache_root, dead_pid(), size_bytes=1 << 20)

    def offline(*args, **kwargs):
        raise OSError("offline")

    monkeypatch.setattr(loader, "embedded_gguf_path", lambda: None)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    with pytest.raises(ModelLoadError, match="offline"):
        load_model(device="cpu")
    assert not stale.exists()


def test_dtype_names():
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("bfloat16", cpu) == resolve_dtype("bf16", cpu) == torch.bfloat16
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        resolve_dtype("int3", cpu)


def test_tokenizer_dir_env_gives_the_embedded_tokenizer(tokenizer, tmp_path, monkeypatch):
    """RADIX_TOKENIZER_DIR: the embedded tokenizer's saved files, where no GGUF file or hub is (the GPU check)."""
    from engine.model.hub import TOKENIZER_DIR_ENV, load_tokenizer

    tokenizer.save_pretrained(tmp_path / "tok")
    monkeypatch.setenv(TOKENIZER_DIR_ENV, str(tmp_path / "tok"))
    carried = load_tokenizer()
    text = "Hello\n\nworld, été"
    assert carried.encode(text) == tokenizer.encode(text) and len(carried) == len(tokenizer)
    msgs = [{"role": "user", "content": text}]
    assert carried.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == \
        tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    monkeypatch.setenv(TOKENIZER_DIR_ENV, str(tmp_path))
    with pytest.raises(ModelLoadError, match="no saved tokenizer"):
        load_tokenizer()
