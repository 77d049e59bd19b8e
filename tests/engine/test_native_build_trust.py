"""Our native libraries are loaded only from a folder and a file that are the user's alone
(issue 43): a library's name is computable from public inputs and loading one runs its
constructors, so a ``.so`` planted in a folder others may write, or one others may write in the
user's own folder, is never loaded; the kernel is built in a private folder instead (one log
line), and a library the user built in a private folder is still reused."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from engine.model import native_build

COMPILER = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(not COMPILER, reason="no C compiler")

KERNEL = "int radix_probe(void) { return 7; }\n"
PLANTED = """#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w");
    if (f) { fputs("ran", f); fclose(f); }
}
int radix_probe(void) { return 666; }
"""


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    """A one-function C source, its library's folder (RADIX_NATIVE_DIR) and the paths loaded."""
    monkeypatch.setattr(native_build, "_refused", set())
    source = tmp_path / "probe_kernel.c"
    source.write_text(KERNEL)
    folder = tmp_path / "native"
    monkeypatch.setenv(native_build.ENV_DIR, str(folder))
    loaded: list[Path] = []

    def load(path: Path) -> ctypes.CDLL:
        loaded.append(path)
        return ctypes.CDLL(str(path))

    return source, folder, loaded, load


def plant(tmp_path: Path, at: Path) -> Path:
    """A library whose constructor writes a marker file, built at ``at``; returns the marker."""
    marker = tmp_path / "constructor-ran"
    src = tmp_path / "planted.c"
    src.write_text(PLANTED % marker)
    subprocess.run([COMPILER, "-shared", "-fPIC", "-o", str(at), str(src)], check=True, capture_output=True)
    return marker


def test_a_library_planted_in_a_folder_others_may_write_is_never_loaded(tmp_path, kernel, caplog):
    source, folder, loaded, load = kernel
    folder.mkdir()
    folder.chmod(0o777)
    planted = folder / native_build.library_name(source, COMPILER)
    marker = plant(tmp_path, planted)
    with caplog.at_level(logging.WARNING, logger=native_build.__name__):
        lib = native_build.build_and_load(source, load)
    assert lib.radix_probe() == 7 and not marker.exists()  # ours, built anew; the planted one never ran
    assert loaded and all(p.parent != folder for p in loaded)
    private = loaded[-1].parent
    assert (private.stat().st_mode & 0o777) == 0o700 and private.stat().st_uid == os.geteuid()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "written by others" in lines[0] and str(private) in lines[0]
    assert planted.exists()  # nothing is built into (or removed from) a folder others may write


@pytest.mark.parametrize("how", ["others may write it", "a symlink"])
def test_a_library_file_others_may_write_is_built_again(tmp_path, kernel, how):
    source, folder, loaded, load = kernel
    folder.mkdir(mode=0o700)
    path = folder / native_build.library_name(source, COMPILER)
    if how == "a symlink":
        marker = plant(tmp_path, tmp_path / "elsewhere.so")
        path.symlink_to(tmp_path / "elsewhere.so")
    else:
        marker = plant(tmp_path, path)
        path.chmod(0o666)
    lib = native_build.build_and_load(source, load)
    assert lib.radix_probe() == 7 and not marker.exists()
    assert path not in loaded[:1]  # the file at the library's name was never loaded as it was
    st = os.lstat(path)  # built again in its place, the user's alone
    assert not path.is_symlink() and (st.st_mode & 0o777) == 0o700 and st.st_uid == os.geteuid()


def test_a_library_in_a_private_folder_is_reused(tmp_path, kernel, monkeypatch):
    source, folder, loaded, load = kernel
    native_build.build_and_load(source, load)
    path = folder / native_build.library_name(source, COMPILER)
    assert (folder.stat().st_mode & 0o777) == 0o700 and path.exists()

    def no_build(*args, **kwargs):
        raise AssertionError("built again")

    monkeypatch.setattr(native_build.subprocess, "run", no_build)
    loaded.clear()
    assert native_build.build_and_load(source, load).radix_probe() == 7 and loaded == [path]
