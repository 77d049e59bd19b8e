"""Building and loading our C kernels on this machine, on first use.

Owns: compiling one C file with the system's C compiler into a shared library in a cache
folder, and handing its path to the caller's loader. Knows nothing of what the kernels do
(``engine.model.attention.native``: attention of decode rows; ``engine.model.native_linear``:
the decode step's linears).

A library is built for this CPU (``-march=native``, OpenMP: it shares PyTorch's thread pool,
the same ``libgomp``) and named by a hash of the source (with the headers it includes in quotes,
found beside it as the compiler finds them: ``native_abi.h``, ``engine.model.native_abi``), the
flags, the compiler and the CPU's model and feature flags, so an edited file or header, another
compiler or another CPU builds anew; a build writes a temporary file and renames it, so two processes never load half a
library, and a damaged file where the library should be is built again. The folder is
``RADIX_NATIVE_DIR``, default ``native/`` in the app's cache folder
(``engine.model.hub.cache_root()``); ``CC`` picks the compiler.

INSTRUCTION SET (issue 48). ``RADIX_ISA`` (``native``, the default; ``avx2``; ``avx512``), read here
and nowhere else (``isa()``), builds the kernels for a narrower CPU than this one, so the AVX2
kernels of a laptop can be built, run and checked on an AVX-512 machine: ``avx2`` is
``-march=x86-64-v3`` (AVX2, FMA, F16C; no AVX-512, no AMX), ``avx512`` is ``-march=x86-64-v4``
(AVX-512 F/BW/CD/DQ/VL; no AVX512-BF16, no AMX), both ``-mtune=native``. The setting is in the
library's flags and its name (``linear-avx2-<hash>.so``), so the builds sit side by side in the
folder, and the Python side's choices that hang on the CPU ask here too (``bf16_dot_products``;
the attention kernel reports what it was built with), so the whole process runs as on that CPU.
A setting this CPU cannot run (``avx512`` on an AVX2 CPU) or does not know is refused with one log
line and the native build is used. Unset or ``native``: the flags and names of before. PyTorch's
own kernels are not ours to narrow: ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` does that
(the benches print both, ``tools.measure.machine_header``).

TRUST (issue 43). A library's name is computable from public inputs, and loading one runs its
constructors, so a library is loaded only from a folder that is the user's alone and only if the
file is too: the folder (created with mode 0o700) must belong to the user and not be writable by
its group or others (``mode & 0o022``), and the ``.so`` must be a regular file (not a symlink) of
the user's that others may not write. A folder that fails is not used at all, neither to load
from nor to build into: the library is built in a private folder of this process instead
(``tempfile.mkdtemp``, mode 0o700, removed at exit), with one log line saying why; a library file
that fails is built again. A build's output is made 0o700 before it is renamed into place.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import platform
import re
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from engine.model.hub import cache_root

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")  # the native build's (its names hash these)
ENV_DIR = "RADIX_NATIVE_DIR"
ENV_ISA = "RADIX_ISA"
# each narrower build: its -march (in place of -march=native) and the /proc/cpuinfo flags it needs
ISA_MARCH = {"avx2": ("-march=x86-64-v3", "-mtune=native"), "avx512": ("-march=x86-64-v4", "-mtune=native")}
ISA_NEEDS = {"avx2": frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}),
             "avx512": frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})}
ISAS = ("native", *ISA_MARCH)
T = TypeVar("T")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``'s first ``flags`` line; empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == "flags":
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def refused_isa(name: str, flags: frozenset[str] | None = None) -> str:
    """Why ``RADIX_ISA=name`` cannot be used on a CPU with ``flags`` (this one by default), or ""."""
    if name not in ISAS:
        return f"{ENV_ISA}={name!r} is not one of {', '.join(ISAS)}"
    missing = sorted(ISA_NEEDS.get(name, frozenset()) - (cpu_flags() if flags is None else flags))
    return f"{ENV_ISA}={name} needs {', '.join(missing)}, which this CPU lacks" if missing else ""


_said_isa: set[str] = set()  # refused settings already logged (one line each)


def isa() -> str:
    """The instruction set the kernels are built for (module docstring): ``RADIX_ISA`` when this CPU
    can run it, else ``native`` (with one log line)."""
    name = (os.environ.get(ENV_ISA) or "native").strip().lower()
    why = refused_isa(name)
    if why:
        if name not in _said_isa:
            _said_isa.add(name)
            log.warning("native kernels: %s; building them for this CPU (native) instead", why)
        return "native"
    return name


def flags(name: str | None = None) -> tuple[str, ...]:
    """The compiler's flags for the instruction set ``name`` (``isa()`` by default)."""
    name = isa() if name is None else name
    if name == "native":
        return FLAGS
    return tuple(x for f in FLAGS for x in (ISA_MARCH[name] if f == "-march=native" else (f,)))


ISA_WORDS = {"avx2": "-march=x86-64-v3: AVX2 and FMA, no AVX-512, no AMX",
             "avx512": "-march=x86-64-v4: AVX-512 F/BW/CD/DQ/VL, no AVX512-BF16, no AMX"}
SHOWN_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def describe_isa(name: str | None = None) -> str:
    """The instruction set the kernels are built for, in words (the engine info, the benches)."""
    name = isa() if name is None else name
    have = [f for f in SHOWN_FLAGS if f in cpu_flags()]
    cpu = f"this CPU has {', '.join(have) or 'none of ' + ', '.join(SHOWN_FLAGS)}"
    if name == "native":
        return f"native (-march=native; {cpu}; {ENV_ISA}=avx2 or avx512 builds for a narrower CPU)"
    return f"{name} ({ENV_ISA}={name}, {ISA_WORDS[name]}; {cpu})"


def bf16_dot_products() -> bool:
    """Whether the process may count on bf16 dot products (AVX512-BF16 or AMX: oneDNN's bf16
    products, packed linears): oneDNN's own answer on the native build, no on a narrower one."""
    if isa() != "native":
        return False
    import torch  # the native build's question is oneDNN's; nothing here needs torch otherwise

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def build_and_load(source: Path, load: Callable[[Path], T]) -> T:
    """``load(path)`` of ``source`` built for this CPU (cached; module docstring). Raises
    RuntimeError (no compiler, a failed build) or what ``load`` raises on a fresh build."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler (cc) on PATH")
    folder = usable_folder(Path(os.environ.get(ENV_DIR) or cache_root() / "native"))
    name = isa()
    path = folder / library_name(source, compiler, name)
    if os.path.lexists(path):
        why = untrusted_file(path)
        if why:
            log.warning("not loading %s (%s): building it again", path, why)
        else:
            try:
                return load(path)
            except (OSError, AttributeError) as exc:  # a damaged file where the library should be: built again
                log.warning("rebuilding %s: %s", path, exc)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags(name), "-o", tmp, str(source)], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(compiler).name} failed: {done.stderr.strip()[-300:]}")
        os.chmod(tmp, 0o700)  # the linker may have made it anew under the umask: the user's alone
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


_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def source_bytes(source: Path, _seen: set[Path] | None = None) -> bytes:
    """``source`` followed by each file it includes in quotes (found beside the file that includes it,
    as the compiler looks first), depth first, each once: what a build of it reads of ours."""
    seen = set() if _seen is None else _seen
    seen.add(source.resolve())
    text = source.read_bytes()
    out = [text]
    for name in _INCLUDE.findall(text):
        path = source.parent / name.decode()
        if path.resolve() not in seen and path.is_file():
            out.append(source_bytes(path, seen))
    return b"".join(out)


def library_name(source: Path, compiler: str, name: str = "native") -> str:
    """The library's file name: the source's stem, the instruction set ``name`` unless native, and
    a hash of the source and its headers (``source_bytes``), the compiler, the flags and this CPU
    (``cpu_signature``)."""
    text = source_bytes(source)
    tag = hashlib.sha256(text + " ".join((compiler, *flags(name), cpu_signature())).encode()).hexdigest()[:16]
    return f"{source.stem}-{tag}.so" if name == "native" else f"{source.stem}-{name}-{tag}.so"


def unsafe_folder(folder: Path) -> str:
    """Why ``folder`` may not hold libraries this process loads (module docstring), or ""."""
    try:
        st = os.stat(folder)
    except OSError as exc:
        return f"cannot be checked ({exc.strerror or exc})"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != os.geteuid():
        return f"belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        return f"may be written by others (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


def untrusted_file(path: Path) -> str:
    """Why the library file ``path`` may not be loaded (module docstring), or ""."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot be checked ({exc.strerror or exc})"
    if not stat.S_ISREG(st.st_mode):
        return "a symlink or not a regular file"
    if st.st_uid != os.geteuid():
        return f"it belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        return f"others may write it (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


_private: list[Path] = []  # this process's private folder, once made
_refused: set[str] = set()  # folders already said to be refused (one line each)
_private_lock = threading.Lock()


def usable_folder(folder: Path) -> Path:
    """``folder`` (made with mode 0o700 if missing) when it is the user's alone, else this process's
    private folder (one log line per refused folder)."""
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        why = unsafe_folder(folder)
    except OSError as exc:
        why = f"cannot be made ({exc.strerror or exc})"
    if not why:
        return folder
    with _private_lock:
        if not _private:
            private = Path(tempfile.mkdtemp(prefix="radix-native-"))  # mode 0o700, a fresh name
            atexit.register(shutil.rmtree, private, True)
            _private.append(private)
        if str(folder) not in _refused:
            _refused.add(str(folder))
            log.warning("native kernels: %s %s; building them in the private folder %s instead", folder, why,
                        _private[0])
        return _private[0]


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
    where it cannot be (no compiler, a CPU it does not build for), with the reason in ``why``,
    and the caller stays on PyTorch's kernels. Whether it is wanted at all is the execution
    plan's to say (``engine.model.plan``), which then never asks."""

    def __init__(self, source: Path, load: Callable[[Path], T]) -> None:
        self.source, self.load = source, load
        self._lock = threading.Lock()
        self._value: T | None = None
        self._tried = False
        self.why = ""
        self.isa = ""  # the instruction set it was built for (``isa()`` at the first ``get()``)

    def get(self) -> T | None:
        with self._lock:
            if not self._tried:
                self._tried = True
                try:
                    self.isa = isa()
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
            self._value, self._tried, self.why, self.isa = None, False, "", ""
