"""Our own CPU attention kernel (``decode_attention.c``), built on this machine on first use.

Owns: compiling the C file with the system's C compiler into a shared library under a cache
folder, loading it, and one call of it on tensors. Knows nothing of the plan or the pool.

The library is built for this CPU (``-march=native``, OpenMP: it shares PyTorch's thread
pool, the same ``libgomp``) and named by a hash of the source, the flags and the compiler, so
an edited file or another compiler builds anew; a build writes a temporary file and renames
it, so two processes never load half a library. Anything that fails (no compiler, no
AVX-512, a read-only cache folder) leaves ``kernel()`` None and the caller on PyTorch's
kernels; ``RADIX_NATIVE_ATTENTION=0`` turns it off, and ``RADIX_NATIVE_DIR`` moves the
folder (default ``$XDG_CACHE_HOME/radix-cache-playground/native``).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
ENV_SWITCH = "RADIX_NATIVE_ATTENTION"
ENV_DIR = "RADIX_NATIVE_DIR"
MAX_ROWS = 8  # decode_attention.c's MAX_ROWS
MAX_HEAD_DIM = 256
CHUNK = 256  # keys per work item

_lock = threading.Lock()
_kernel: DecodeKernel | None = None
_tried = False
_why = ""


class DecodeKernel:
    """The loaded library: ``attend`` runs it on torch tensors."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._run = lib.radix_decode_attention
        self._run.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float,
                              ctypes.c_int, ptr, ptr, ptr, i64, ctypes.c_int]
        self._run.restype = ctypes.c_int
        self._work = lib.radix_attn_work_floats
        self._work.argtypes = [i64] * 5
        self._work.restype = i64
        self.path = path

    @staticmethod
    def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether one call takes these shapes: ``q [1, H, M, D]`` with at most ``MAX_ROWS``
        rows, ``k``/``v`` ``[1, H, L, D]``, float32 or bfloat16 on the CPU, rows contiguous."""
        return (q.device.type == "cpu" and q.dim() == 4 and q.shape[0] == 1 and q.shape[2] <= MAX_ROWS
                and q.dtype in (torch.float32, torch.bfloat16) and k.dtype == q.dtype and v.dtype == q.dtype
                and k.shape == v.shape and k.shape[0] == 1 and k.shape[1] == q.shape[1] and k.shape[3] == q.shape[3]
                and q.shape[3] % 16 == 0 and q.shape[3] <= MAX_HEAD_DIM and k.shape[2] >= 1
                and q.stride(3) == 1 and k.stride(3) == 1 and v.stride(3) == 1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``q [1, H, M, D]`` over every key of ``k``/``v`` ``[1, H, L, D]`` (no
        mask): ``(out [1, H, M, D] float32, lse [1, H, M] float32)``. The caller checks ``fits``."""
        _, h, m, d = q.shape
        length = k.shape[2]
        out = torch.empty((1, h, m, d), dtype=torch.float32)
        lse = torch.empty((1, h, m), dtype=torch.float32)
        work = torch.empty(self._work(h, m, d, length, CHUNK), dtype=torch.float32)
        rc = self._run(q.data_ptr(), q.stride(1), q.stride(2), k.data_ptr(), k.stride(1), k.stride(2),
                       v.data_ptr(), v.stride(1), v.stride(2), h, m, length, d, scale,
                       int(q.dtype == torch.bfloat16), out.data_ptr(), lse.data_ptr(), work.data_ptr(), CHUNK,
                       torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"the native attention kernel refused q {tuple(q.shape)} k {tuple(k.shape)}")
        return out, lse


def kernel() -> DecodeKernel | None:
    """The kernel, built and loaded on the first call; None where it cannot be (``why()``)."""
    global _kernel, _tried, _why
    with _lock:
        if not _tried:
            _tried = True
            try:
                _kernel = _load()
            except Exception as exc:  # no compiler, no AVX-512, an unwritable folder: PyTorch's kernels
                _why = str(exc) or type(exc).__name__
                log.info("native attention kernel not used: %s", _why)
        return _kernel


def why() -> str:
    """Why ``kernel()`` is None (empty when it is not, or was not tried)."""
    return _why


def _load() -> DecodeKernel:
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        raise RuntimeError(f"{ENV_SWITCH}=0")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler (cc) on PATH")
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + " ".join((compiler, *FLAGS)).encode()).hexdigest()[:16]
    folder = Path(os.environ.get(ENV_DIR) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                  / "radix-cache-playground" / "native")
    path = folder / f"decode_attention-{tag}.so"
    if path.exists():
        try:
            return DecodeKernel(path)
        except (OSError, AttributeError) as exc:  # a damaged file where the library should be: built again
            log.warning("rebuilding %s: %s", path, exc)
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(compiler).name} failed: {done.stderr.strip()[-300:]}")
        # loaded under its temporary name: a process that already opened a damaged file at
        # ``path`` would otherwise be handed that one again
        built = DecodeKernel(Path(tmp))
        os.replace(tmp, path)
        built.path = path
        return built
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def reset() -> None:
    """Forget the kernel (tests that change the environment build or refuse it anew)."""
    global _kernel, _tried, _why
    with _lock:
        _kernel, _tried, _why = None, False, ""
