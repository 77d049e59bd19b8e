"""Our own CPU attention kernel (``decode_attention.c``), built on this machine on first use.

Owns: loading the built library and one call of it on tensors. Knows nothing of the plan or
the pool.

Built for this CPU and cached by ``engine.model.native_build`` (under ``native/`` in the
app's cache folder, ``RADIX_NATIVE_DIR`` moves it). Anything that fails (no compiler, no AVX2
or AVX-512, a read-only cache folder) leaves ``kernel()`` None and the caller on PyTorch's
kernels; the execution plan may leave it unused (``engine.model.plan``: ``cpu_native=off``, alias
``RADIX_NATIVE_ATTENTION=0``). Its functions' signatures, its struct, the constants below and the
codes of its refusals come from one table (``engine.model.native_abi``), which writes the C header too.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.model import native_abi as abi
from engine.model.native_build import ENV_DIR, OnFirstUse  # noqa: F401  (ENV_DIR: callers and tests set it here)

SOURCE = Path(__file__).with_name("decode_attention.c")
MAX_ROWS = abi.VALUE["RADIX_MAX_ROWS"]  # query rows per KV head: any dtype, AVX2 or AVX-512
AMX_MAX_ROWS = abi.VALUE["RADIX_MANY_ROWS"]  # bfloat16 with AMX or AVX512-BF16 (head size a multiple of 32),
# float32 with AVX-512
MAX_HEAD_DIM = abi.VALUE["RADIX_MAX_HEAD_DIM"]
CHUNK = abi.VALUE["RADIX_CHUNK"]  # keys per work item
_AttnLayer = abi.struct("radix_attn_layer")  # one layer's attention call but its keys, values, queries and output


class LayerCall:
    """The attention of a step's decode rows, each over its own runs of the pool, for C code to
    call once per layer (``engine.model.fused_decode``): ``fn`` is the address of
    ``radix_attention_layer`` and ``ctx`` of its fixed arguments; queries in are ``[rows, Hq * D]``
    in the pool's dtype (float32 or bfloat16, heads side by side), output out the same shape in
    float32. Holds every buffer the arguments point at."""

    def __init__(self, fn: int, struct: _AttnLayer, keep: tuple) -> None:
        self.fn, self.struct, self._keep = fn, struct, keep
        self.ctx = ctypes.addressof(struct)

    def contexts(self, layers: int) -> ctypes.Array:
        """``ctx`` for each of ``layers`` layers (``radix_layers`` takes one a layer): the same arguments."""
        return (ctypes.c_void_p * layers)(*[self.ctx] * layers)


class DecodeKernel:
    """The loaded library: ``attend`` (one call's rows over a view of keys) and ``attend_rows``
    (many decode rows, each over its own runs of the pool) run it on torch tensors."""

    def __init__(self, path: Path) -> None:
        lib = abi.load(path, SOURCE.stem)  # every signature set from the table
        self._run = lib.radix_attention
        self._work = lib.radix_attn_work_floats
        self.amx = bool(lib.radix_amx_ready())  # the AMX path (more rows) compiled and allowed
        # many bf16 rows (up to AMX_MAX_ROWS): on AMX, or on AVX512-BF16's dot products without it
        self.many_rows = lib.radix_bf16_rows_path() > 0
        self.many_rows_fp32 = lib.radix_fp32_rows_path() > 0  # many float32 rows: AVX-512's FMAs (chunk_fp)
        self._layer_fn = ctypes.cast(lib.radix_attention_layer, ctypes.c_void_p).value
        self.simd = lib.radix_simd().decode()  # the vector layer it was built with: "AVX2" or "AVX-512"
        self.path = path
        self.lib = lib  # the exact attention too (engine.model.attention.exact)
        self.exact_fn = ctypes.cast(lib.radix_exact_attention, ctypes.c_void_p).value

    def many_rows_for(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether calls of this dtype and head size can take a many-rows path (bf16: AMX or
        AVX512-BF16's dot products; float32: AVX-512's FMAs)."""
        if dtype == torch.float32:
            return self.many_rows_fp32 and head_dim % 16 == 0
        return self.many_rows and dtype == torch.bfloat16 and head_dim % 32 == 0

    def max_rows(self, dtype: torch.dtype, head_dim: int) -> int:
        """The most query rows per token one call takes for this dtype and head size."""
        return AMX_MAX_ROWS if self.many_rows_for(dtype, head_dim) else MAX_ROWS

    def fits(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether ``attend`` takes these shapes: ``q [1, H, M, D]`` with at most ``max_rows``
        rows, ``k``/``v`` ``[1, H, L, D]``, float32 or bfloat16 on the CPU, rows contiguous."""
        return (q.device.type == "cpu" and q.dim() == 4 and q.shape[0] == 1 and k.dim() == 4 and k.shape[0] == 1
                and q.shape[2] <= self.max_rows(q.dtype, q.shape[3]) and q.dtype in (torch.float32, torch.bfloat16)
                and k.dtype == q.dtype and v.dtype == q.dtype and k.shape == v.shape and k.shape[1] == q.shape[1]
                and k.shape[3] == q.shape[3] and q.shape[3] % 16 == 0 and q.shape[3] <= MAX_HEAD_DIM
                and k.shape[2] >= 1 and q.stride(3) == 1 and k.stride(3) == 1 and v.stride(3) == 1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``q [1, H, M, D]`` over every key of ``k``/``v`` ``[1, H, L, D]`` (no
        mask): ``(out [1, H, M, D] float32, lse [1, H, M] float32)``. The caller checks ``fits``."""
        _, h, m, d = q.shape
        out = torch.empty((1, h, m, d), dtype=torch.float32)
        lse = torch.empty((1, h, m), dtype=torch.float32)
        self._call(q, (q.stride(1), q.stride(2), 0), k[0], v[0], _whole_view(k.shape[2]), m, scale, out,
                   (m * d, d, 0), lse, (m, 1, 0))
        return out, lse

    def merge_into(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: tuple[tuple[int, int], ...],
                   scale: float, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Rows ``q [H, M, D]`` (contiguous) over the ``runs`` ``(first slot, length)`` of the pool
        layer ``k``/``v`` ``[H, S, D]``, all visible, merged into ``out [H, M, D]`` and ``lse [H, M]``
        (float32, contiguous), which hold the same rows' attention over other keys (lse -inf where
        none): afterwards they hold the attention over both. The caller checks ``fits``' limits."""
        h, m, d = q.shape
        self._call(q, (m * d, d, 0), k, v, _runs_view(runs), m, scale, out, (m * d, d, 0), lse, (m, 1, 0), merge_in=1)

    def attend_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cut: RowsCut, scale: float,
                    out: torch.Tensor, lse: torch.Tensor) -> None:
        """Decode rows of a pack: ``q [Hq, T, D]`` (the pack's queries, ``Hq = g * H``), each row
        ``cut`` names attending over its own runs of the pool layer ``k``/``v`` ``[H, S, D]``;
        writes ``out [Hq, T, D]`` and ``lse [Hq, T]`` (float32, contiguous) at those rows."""
        hq, t, d = q.shape
        g = hq // k.shape[0]
        self._call(q, (g * q.stride(0), q.stride(0), q.stride(1)), k, v, cut, g, scale, out,
                   (g * t * d, t * d, d), lse, (g * t, t, 1))

    def layer_call(self, k_layer: torch.Tensor, cut: RowsCut, q_heads: int, scale: float) -> LayerCall:
        """The attention of ``cut``'s decode rows (pack positions 0..rows-1, each over its own
        runs) for every layer of a step whose pool layers are shaped like ``k_layer`` ``[H, S, D]``
        (float32 or bfloat16, contiguous), with ``q_heads`` query heads; see ``LayerCall``."""
        h, slots, d = k_layer.shape
        rows, pieces = cut
        t, g = rows.shape[0], q_heads // h
        lse = torch.empty((t, q_heads), dtype=torch.float32)
        work = torch.empty(self._work(h, g, d, pieces.shape[0], t), dtype=torch.float32)
        row = q_heads * d  # queries and output: [T][Hq][D], a row's heads side by side
        s = _AttnLayer(q_hs=g * d, q_rs=d, q_ts=row, k_sh=slots * d, k_sl=d, v_sh=slots * d, v_sl=d, keys=slots,
                       rows=rows.data_ptr(), nrows=t, pieces=pieces.data_ptr(), npieces=pieces.shape[0], H=h, M=g, D=d,
                       scale=scale, o_hs=g * d, o_rs=d, o_ts=row, lse=lse.data_ptr(), l_hs=g, l_rs=1, l_ts=q_heads,
                       work=work.data_ptr(), threads=torch.get_num_threads(),
                       bf16=int(k_layer.dtype == torch.bfloat16))
        return LayerCall(self._layer_fn, s, (rows, pieces, lse, work))

    def _call(self, q, q_strides, k, v, cut: RowsCut, m: int, scale: float, out, o_strides, lse, l_strides,
              merge_in: int = 0) -> None:
        h, d = k.shape[0], k.shape[2]
        rows, cuts = cut
        work = torch.empty(self._work(h, m, d, cuts.shape[0], rows.shape[0]), dtype=torch.float32)
        code = self._run(q.data_ptr(), *q_strides, k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0),
                         v.stride(1), min(k.shape[1], v.shape[1]), rows.data_ptr(), rows.shape[0], cuts.data_ptr(),
                         cuts.shape[0], h, m, d, scale,
                         int(q.dtype == torch.bfloat16), out.data_ptr(), *o_strides, lse.data_ptr(), *l_strides,
                         work.data_ptr(), torch.get_num_threads(), merge_in)
        if code:  # a shape it does not take, or pieces outside the keys: nothing was written
            raise abi.NativeRefusal(code, "the native attention kernel",
                                    f"{m} rows of {tuple(q.shape)} over {tuple(k.shape)}")

RowsCut = tuple[torch.Tensor, torch.Tensor]  # rows [R, 3] (position, first piece, end piece), pieces [P, 3]


def cut_rows(rows: Sequence[tuple[int, Sequence[tuple[int, int]]]]) -> RowsCut:
    """Decode rows ``(pack position, runs (first slot, length))`` in the form ``attend_rows``
    takes: each run cut into pieces of at most ``CHUNK`` keys (built once per forward, used by
    every layer)."""
    table, cut = [], []
    for row, (pos, runs) in enumerate(rows):
        first = len(cut)
        cut += [(start + o, min(CHUNK, length - o), row) for start, length in runs for o in range(0, length, CHUNK)]
        table.append((pos, first, len(cut)))
    return torch.tensor(table, dtype=torch.int64).reshape(-1, 3), torch.tensor(cut, dtype=torch.int64).reshape(-1, 3)


@functools.lru_cache(maxsize=64)
def _runs_view(runs: tuple[tuple[int, int], ...]) -> RowsCut:
    """One row over the runs of a shared prefix: the same for every layer of a forward."""
    return cut_rows([(0, runs)])


@functools.lru_cache(maxsize=64)
def _whole_view(length: int) -> RowsCut:
    """One row over every key of a view of ``length`` keys: the same for every layer of a
    forward (a shared prefix's run), so it is cut once, not once per layer."""
    return cut_rows([(0, ((0, length),))])


def kernel() -> DecodeKernel | None:
    """The kernel, built and loaded on the first call; None where it cannot be (``why()``)."""
    return _library.get()


def why() -> str:
    """Why ``kernel()`` is None (empty when it is not, or was not tried)."""
    return _library.why


def reset() -> None:
    """Forget the kernel (tests that change the environment build or refuse it anew)."""
    _library.reset()


_library = OnFirstUse(SOURCE, DecodeKernel)
