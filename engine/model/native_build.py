"""Building and loading our C kernels on this machine, on first use.

Owns: compiling one C file with the system's C compiler into a shared library in a cache
folder, and handing its path to the caller's loader. Knows nothing of what the kernels do
(``engine.model.attention.native``: attention of decode rows; ``engine.model.native_linear``:
the decode step's linears).

A library is built for this CPU (``-march=native``, OpenMP: it shares PyTorch's thread pool,
the same ``libgomp``) and named by a hash of the source, the flags, the compiler and the
CPU's model and feature flags, so an edited file, another compiler or another CPU builds
anew; a build writes a temporary file and renames it, so two processes never load half a
library, and a damaged file where the library should be is built again. The folder is
``RADIX_NATIVE_DIR``, default ``native/`` in the app's cache folder
(``engine.model.hub.cache_root()``); ``CC`` picks the compiler.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from engine.model.hub import cache_root

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
ENV_DIR = "RADIX_NATIVE_DIR"
T = TypeVar("T")


def switched_off(env: str) -> bool:
    """Whether the kernel's switch (``RADIX_NATIVE_ATTENTION``, ``RADIX_NATIVE_LINEAR``) says no."""
    return os.environ.get(env, "1").strip().lower() in ("0", "false", "no", "off")


def build_and_load(source: Path, load: Callable[[Path], T]) -> T:
    """``load(path)`` of ``source`` built for this CPU (cached; module docstring). Raises
    RuntimeError (no compiler, a failed build) or what ``load`` raises on a fresh build."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler (cc) on PATH")
    text = source.read_bytes()
    tag = hashlib.sha256(text + " ".join((compiler, *FLAGS, cpu_signature())).encode()).hexdigest()[:16]
    folder = Path(os.environ.get(ENV_DIR) or cache_root() / "native")
    path = folder / f"{source.stem}-{tag}.so"
    if path.exists():
        try:
            return load(path)
        except (OSError, AttributeError) as exc:  # a damaged file where the library should be: built again
            log.warning("rebuilding %s: %s", path, exc)
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, "-o", tmp, str(source)], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(compiler).name} failed: {done.stderr.strip()[-300:]}")
        # loaded under its temporary name: a process that already opened a damaged file at
        # ``path`` would otherwise be handed that one again
        built = load(Path(tmp))
        os.replace(tmp, path)
        if hasattr(built, "path"):
            built.path = path
        return built
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def cpu_signature() -> str:
    """What ``-march=native`` builds for: the CPU's model and feature flags. Part of a
    library's name, so a cache folder that moved to another CPU (a shared home, a copied
    image) builds anew instead of loading code this CPU cannot run (an illegal instruction
    would kill the process, not raise)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + " " + platform.processor()
    wanted = ("model name", "flags")
    return " | ".join(sorted({line.strip() for line in lines if line.split(":", 1)[0].strip() in wanted}))


class OnFirstUse(Generic[T]):
    """A kernel built and loaded on the first ``get()`` (once per process, thread-safe); None
    where it cannot be (no compiler, a CPU it does not build for, its switch set to 0), with
    the reason in ``why``, and the caller stays on PyTorch's kernels."""

    def __init__(self, source: Path, switch: str, load: Callable[[Path], T]) -> None:
        self.source, self.switch, self.load = source, switch, load
        self._lock = threading.Lock()
        self._value: T | None = None
        self._tried = False
        self.why = ""

    def get(self) -> T | None:
        with self._lock:
            if not self._tried:
                self._tried = True
                try:
                    if switched_off(self.switch):
                        raise RuntimeError(f"{self.switch}=0")
                    self._value = build_and_load(self.source, self.load)
                except Exception as exc:  # no compiler, no AVX2, an unwritable folder: PyTorch's kernels
                    self.why = str(exc) or type(exc).__name__
                    log.info("%s not used: %s", self.source.name, self.why)
            return self._value

    def loaded(self) -> T | None:
        """What ``get()`` returned, without trying (None before the first ``get()``)."""
        return self._value

    def reset(self) -> None:
        """Forget it (tests that change the environment build or refuse it anew)."""
        with self._lock:
            self._value, self._tried, self.why = None, False, ""
