"""The C boundary in one place (issue 47.2): every function our C kernels export, the structs they
read, the constants both sides use and the codes a refusal returns, each code with its message.

Owns: the table below and the two things made from it. The C header ``native_abi.h`` (beside this
file, committed; ``decode_attention.c`` and ``native_linear.c`` include it instead of copies of their
own): the constants, the refusal codes, the structs and every prototype, so the compiler checks each
definition against the table. And the ctypes side: ``load`` opens a built library with every
function's ``argtypes``/``restype`` set, ``struct`` is a struct's ``ctypes.Structure``, ``check``
turns a nonzero code into ``NativeRefusal`` (a ValueError) that says why. Knows nothing of what
the kernels compute (``engine.model.attention.native``, ``engine.model.native_linear``,
``engine.model.fused_decode``, ``engine.model.attention.exact`` call them).

To change a native function's signature, a struct, a constant or a refusal: edit its row here, run
``python -m engine.model.native_abi --write`` (rewrites the header), then the C definition and the
Python call. A refusal in C returns one of the codes (``RADIX_E_...``), never a bare number.
``tests/engine/test_native_abi.py`` checks the committed header is this table's, the C definitions
match it, the built libraries export every function, the structs' offsets agree, and no refusal
returns a number.

Types: a C type is written as C spells it (``const float *``); pointers (and function pointers,
``CALLBACKS``) are ``c_void_p`` on the Python side (an address, a ctypes array or None), the
scalars as ``SCALARS`` says; ``radix_status`` is an int, 0 or a refusal code.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import re
from pathlib import Path
from typing import NamedTuple

HEADER = Path(__file__).with_name("native_abi.h")
LIBRARIES = ("decode_attention", "native_linear")  # the C files' stems (engine.model.native_build names them so)
SCALARS = {"void": None, "int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float,
           "double": ctypes.c_double, "radix_status": ctypes.c_int, "const char *": ctypes.c_char_p}


class Arg(NamedTuple):
    name: str
    c: str  # as C spells the type, normalised (``const float *``)
    doc: str = ""  # a struct field's comment in the header

    @property
    def ctype(self) -> type | None:
        return ctype(self.c)


class Function(NamedTuple):
    library: str  # the C file's stem that defines it (a callback's: "")
    name: str
    returns: str
    args: tuple[Arg, ...]
    doc: str

    def prototype(self) -> str:
        params = ", ".join(declare(a.c, a.name) for a in self.args) or "void"
        return f"{declare(self.returns, self.name)}({params})"


class Struct(NamedTuple):
    name: str
    fields: tuple[Arg, ...]
    doc: str


class Constant(NamedTuple):
    name: str
    value: int
    doc: str


def normal(c: str) -> str:
    """A C type spelled one way: single spaces, ``*`` after a space and before none (``void *const *``)."""
    return re.sub(r"\s*\*\s*", " *", " ".join(c.split())).strip()


def declare(c: str, name: str) -> str:
    """``c name`` as C writes it: ``int64_t rows``, ``const float *x``."""
    return f"{c}{name}" if c.endswith("*") else f"{c} {name}"


def args(text: str) -> tuple[Arg, ...]:
    """``"const float *x, int64_t rows"`` as ``Arg``s (C's own parameter syntax, one name each)."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(.*?[\s*])(\w+)", part)
        if not m or part == "void":
            raise ValueError(f"not a parameter: {part!r}")
        out.append(Arg(m.group(2), normal(m.group(1))))
    return tuple(out)


def fields(*rows: tuple[str, ...]) -> tuple[Arg, ...]:
    """A struct's fields in order: ``(C type, "names of that type"[, comment])`` rows."""
    return tuple(Arg(n, normal(c), doc[0] if doc and i == 0 else "") for c, names, *doc in rows
                 for i, n in enumerate(names.split()))


def ctype(c: str) -> type | None:
    """The ctypes type of the C type ``c`` (pointers and callbacks: ``c_void_p``)."""
    c = normal(c)
    if c in SCALARS:
        return SCALARS[c]
    if c.endswith("*") or c in {f.name for f in CALLBACKS}:
        return ctypes.c_void_p
    raise ValueError(f"no ctypes type for the C type {c!r}: add it to SCALARS")


def _fn(library: str, returns: str, name: str, params: str, doc: str) -> Function:
    return Function(library, name, normal(returns), args(params), doc)


# ---- the table ---------------------------------------------------------------------------------------

CONSTANTS = (
    Constant("RADIX_MAX_ROWS", 8, "query rows per KV head one attention call takes, any dtype (AVX2 or AVX-512)"),
    Constant("RADIX_MANY_ROWS", 64, "the many-rows paths' limit: bf16 on AMX or AVX512-BF16, float32 on AVX-512"),
    Constant("RADIX_MAX_HEAD_DIM", 256, "the largest head size (a multiple of 16)"),
    Constant("RADIX_CHUNK", 256, "keys per piece of the many-rows paths (a multiple of 32), and per piece Python cuts"),
    Constant("RADIX_EXACT_BLOCK", 256, "exact attention: keys per block, by absolute position"),
    Constant("RADIX_EXACT_MAX_G", 16, "exact attention: query heads per KV head"),
    Constant("RADIX_EXACT_MAX_CHUNK", 16, "exact attention: tokens per work item"),
    Constant("RADIX_EXACT_ROWS", 64, "exact attention: query rows computed together over a block"),
)

# The codes a refusal returns, numbered from 1 in this order (0 is RADIX_OK), with what they say.
CODES = (
    ("RADIX_E_ATTN_SHAPE", "attention: a head size that is not a multiple of 16 up to 256, or no query rows, "
                           "tokens, pieces, heads or threads"),
    ("RADIX_E_ATTN_ROWS", "attention: more query rows per KV head than this dtype and head size take "
                          "(8, or 64 on a many-rows path)"),
    ("RADIX_E_ATTN_PIECE", "attention: a piece outside the keys, empty or longer than the path's chunk, "
                           "or of a token that does not exist"),
    ("RADIX_E_ATTN_TOKEN", "attention: a token whose pieces are empty or outside the pieces given"),
    ("RADIX_E_EXACT_SHAPE", "exact attention: a head size that is not a multiple of 16 from 16 to 256, "
                            "or no heads, tokens or threads"),
    ("RADIX_E_EXACT_GROUP", "exact attention: more than 16 query heads per KV head, or none, or a negative "
                            "window or soft-cap"),
    ("RADIX_E_EXACT_RUNS", "exact attention: a token whose runs do not cover its positions from 0, "
                           "or a slot outside the pool"),
    ("RADIX_E_EXACT_CHUNKS", "exact attention: a chunk of tokens empty, out of order or longer than 16, "
                             "or of more than 64 query rows"),
    ("RADIX_E_NO_MEMORY", "out of memory for the kernel's scratch"),
    ("RADIX_E_LINEAR_SHAPE", "linear: no rows or outputs, an input size that is not a multiple of 8, "
                             "or no threads"),
    ("RADIX_E_NORM_SHAPE", "RMSNorm: no rows, a row stride shorter than a row, or a dtype flag not 0 or 1"),
    ("RADIX_E_LAYER_SHAPE", "fused layer: no layer, rows or threads, a dtype flag not 0 or 1, or sizes it "
                            "does not take (hidden, intermediate and query widths multiples of 8, an even "
                            "head size, query heads a multiple of KV heads) or a recipe field out of range"),
    ("RADIX_E_LAYER_SLOT", "fused layer: a row's pool slot outside the pool"),
    ("RADIX_E_LAYER_Q16", "fused layers: a bfloat16 layer without the bf16 query buffer"),
)
CODE = {name: i for i, (name, _) in enumerate(CODES, 1)}
MESSAGE = {i: text for i, (_, text) in enumerate(CODES, 1)}

STRUCTS = (
    Struct("radix_attn_layer", fields(
        ("int64_t", "q_hs q_rs q_ts k_sh k_sl v_sh v_sl keys"), ("const int64_t *", "rows"), ("int64_t", "nrows"),
        ("const int64_t *", "pieces"), ("int64_t", "npieces H M D"), ("double", "scale"),
        ("int64_t", "o_hs o_rs o_ts"), ("float *", "lse"), ("int64_t", "l_hs l_rs l_ts"), ("float *", "work"),
        ("int64_t", "threads"), ("int64_t", "bf16", "queries, keys and values in bfloat16")),
        "one layer's radix_attention call but its keys, values, queries and output (bf16: all in bfloat16)"),
    Struct("radix_exact", fields(
        ("int64_t", "H G D slots ntok"), ("const int64_t *", "tok runs"), ("int64_t", "nruns"),
        ("const int64_t *", "chunks"), ("int64_t", "nchunks"), ("double", "scale"), ("int64_t", "bf16 threads"),
        ("const void *", "k_now v_now", "the layer's keys and values, set per call (not read from the caller)"),
        ("int64_t", "window", "a sliding window: keys at positions above p - window only (0: every key)"),
        ("double", "softcap", "scores soft-capped, cap * tanh(score / cap) (0: none)")),
        "one forward's exact attention (decode_attention.c says how); k_now/v_now are set per call"),
    Struct("radix_layer", fields(
        ("const void *", "norm1 norm2", "[hidden] RMSNorm weights (float32 or bf16)"), ("double", "eps1 eps2"),
        ("const void *", "wq wk wv wo wg wu wd", "nn.Linear weights [out][in], contiguous (float32 or bf16)"),
        ("const float *", "bq bk bv bo bg bu bd", "their biases (float32), or NULL"),
        ("int64_t", "hidden q_heads kv_heads head_dim inter"), ("int64_t", "bf16", "weights and pool in bfloat16"),
        ("const void *", "norm3 norm4", "[hidden] RMSNorms after attention and after the MLP, or NULL (norm1, "
         "norm2 may be NULL too: none)"), ("double", "eps3 eps4"),
        ("const void *", "qnorm knorm", "q/k RMSNorm weights: [head_dim] per head, or [q or kv width]"),
        ("double", "qk_eps"), ("int64_t", "qk_norm", "0 none, 1 per head, 2 over the whole projection"),
        ("int64_t", "norm_offset", "1: every norm weight is float32 holding 1 + w, the product rounded once"),
        ("int64_t", "act", "0 SiLU, 1 GELU (tanh)"),
        ("int64_t", "rope", "the rotary table this layer reads: cos/sin + rope * rows * head_dim")),
        "one decoder layer's weights by address (float32 or bf16; biases float32 or NULL), its sizes and its "
        "family's recipe (engine.model.families)"),
)

CALLBACKS = (
    _fn("", "radix_status", "radix_attend_fn", "const void *ctx, const void *q, const void *k, const void *v, "
        "float *out", "attention between a layer's two halves (radix_attention_layer, radix_exact_attention)"),
)

_ATTN, _LIN = LIBRARIES
FUNCTIONS = (
    _fn(_ATTN, "const char *", "radix_simd", "", "the vector layer it was built with: AVX2 or AVX-512"),
    _fn(_ATTN, "int64_t", "radix_attn_work_floats", "int64_t H, int64_t M, int64_t D, int64_t npieces, "
        "int64_t nrows", "the floats of scratch radix_attention needs"),
    _fn(_ATTN, "int", "radix_amx_ready", "", "whether the AMX path is compiled and allowed"),
    _fn(_ATTN, "int", "radix_bf16_rows_path", "", "many bf16 rows: 2 AMX, 1 AVX512-BF16, 0 none"),
    _fn(_ATTN, "int", "radix_fp32_rows_path", "", "whether many float32 rows have a path (AVX-512)"),
    _fn(_ATTN, "radix_status", "radix_attention",
        "const void *q, int64_t q_hs, int64_t q_rs, int64_t q_ts, const void *k, int64_t k_sh, int64_t k_sl, "
        "const void *v, int64_t v_sh, int64_t v_sl, int64_t keys, const int64_t *rows, int64_t nrows, "
        "const int64_t *pieces, int64_t npieces, int64_t H, int64_t M, int64_t D, float scale, int bf16, "
        "float *out, int64_t o_hs, int64_t o_rs, int64_t o_ts, float *lse, int64_t l_hs, int64_t l_rs, "
        "int64_t l_ts, float *work, int threads, int merge_in", "decode rows over their pieces of the pool"),
    _fn(_ATTN, "radix_status", "radix_attention_layer", "const radix_attn_layer *c, const void *q, const void *k, "
        "const void *v, float *out", "radix_attention with a layer's fixed arguments (a radix_attend_fn)"),
    _fn(_ATTN, "radix_status", "radix_exact_attention", "const radix_exact *cc, const void *q, const void *k, "
        "const void *v, float *out", "exact attention of one layer (a radix_attend_fn)"),
    _fn(_LIN, "radix_status", "radix_linear", "const float *x, int64_t x_rs, int64_t rows, const void *w, "
        "int64_t out, int64_t in, const float *bias, float *y, int64_t y_rs, int bf16, int threads",
        "y = x W^T (+ bias)"),
    _fn(_LIN, "radix_status", "radix_rms_norm", "const float *x, int64_t x_rs, int64_t rows, int64_t n, "
        "const void *w, double eps, float *y, int bf16, int offset", "the RMSNorm of rows (offset: w is float32 "
        "holding 1 + w)"),
    _fn(_LIN, "radix_status", "radix_layer_pre", "const radix_layer *L, const float *h, int64_t h_rs, "
        "int64_t rows, const float *cos, const float *sin, float *q, void *k_pool, void *v_pool, "
        "int64_t pool_slots, const int64_t *write, int threads", "a layer's work before attention (cos/sin: the "
        "rotary tables, [tables][rows][head_dim])"),
    _fn(_LIN, "radix_status", "radix_layer_post", "const radix_layer *L, float *h, int64_t h_rs, int64_t rows, "
        "const float *a, int threads", "a layer's work after attention"),
    _fn(_LIN, "radix_status", "radix_layers", "const radix_layer *const *layers, int64_t n_layers, float *h, "
        "int64_t h_rs, int64_t rows, const float *cos, const float *sin, void *const *k_pools, "
        "void *const *v_pools, int64_t pool_slots, const int64_t *write, float *q, uint16_t *q16, float *a, "
        "radix_attend_fn attend, const void *const *ctxs, int threads, int64_t *failed_layer",
        "every layer of a step, attention through attend(ctxs[layer]); the layer that refused goes to "
        "*failed_layer"),
)
FUNCTION = {f.name: f for f in FUNCTIONS}
VALUE = {c.name: c.value for c in CONSTANTS}


# ---- the header --------------------------------------------------------------------------------------

def header() -> str:
    """The text of ``native_abi.h`` the table makes."""
    out = ["/* native_abi.h: generated by engine/model/native_abi.py (python -m engine.model.native_abi --write);",
           " * do not edit: change the table there and run that. The C boundary of decode_attention.c and",
           " * native_linear.c: constants, refusal codes, structs and prototypes. */",
           "#ifndef RADIX_NATIVE_ABI_H", "#define RADIX_NATIVE_ABI_H", "", "#include <stdint.h>", ""]
    out += [f"#define {c.name} {c.value} /* {c.doc} */" for c in CONSTANTS]
    out += ["", "/* 0, or why a call refused (nothing written): engine.model.native_abi.CODES says it in words */",
            "typedef int radix_status;", "#define RADIX_OK 0"]
    out += [f"#define {name} {CODE[name]}" for name, _ in CODES]
    for s in STRUCTS:
        out += ["", f"/* {s.doc} */", "typedef struct {"]
        out += [f"    {declare(a.c, a.name)};" + (f" /* {a.doc} */" if a.doc else "") for a in s.fields]
        out.append(f"}} {s.name};")
    out.append("")
    for f in CALLBACKS:
        params = ", ".join(declare(a.c, a.name) for a in f.args)
        out += [f"/* {f.doc} */", f"typedef {f.returns} (*{f.name})({params});"]
    for lib in LIBRARIES:
        out += ["", f"/* {lib}.c */"]
        for f in FUNCTIONS:
            if f.library == lib:
                out += [f"/* {f.doc} */", f"{f.prototype()};"]
    out += ["", "#endif", ""]
    return "\n".join(out)


# ---- the ctypes side ---------------------------------------------------------------------------------

def load(path: Path, library: str) -> ctypes.CDLL:
    """The built library ``library`` (a stem of ``LIBRARIES``) at ``path``, each of its functions'
    ``argtypes`` and ``restype`` set from the table. Raises AttributeError where one is missing."""
    lib = ctypes.CDLL(str(path))
    for f in FUNCTIONS:
        if f.library == library:
            fn = getattr(lib, f.name)
            fn.argtypes = [a.ctype for a in f.args]
            fn.restype = ctype(f.returns)
    return lib


@functools.cache
def struct(name: str) -> type[ctypes.Structure]:
    """The ``ctypes.Structure`` of the table's struct ``name`` (the same class every call)."""
    s = next(s for s in STRUCTS if s.name == name)
    return type(name, (ctypes.Structure,), {"_fields_": [(a.name, a.ctype) for a in s.fields], "__doc__": s.doc})


class NativeRefusal(ValueError):
    """A C kernel refused a call (nothing written): ``code``, its ``name`` and ``message``; ``what``
    names the kernel, ``detail`` the call."""

    def __init__(self, code: int, what: str, detail: str = "") -> None:
        self.code, self.name, self.message = code, name_of(code), message(code)
        super().__init__(f"{what} refused{' ' + detail if detail else ''}: {self.message} ({self.name})")


def message(code: int) -> str:
    """Why a call that returned ``code`` refused, in words."""
    return MESSAGE.get(code, f"a code the table does not know ({code})")


def name_of(code: int) -> str:
    """The C name of ``code`` (``RADIX_E_...``)."""
    return "RADIX_OK" if code == 0 else next((n for n, c in CODE.items() if c == code), f"code {code}")


def check(code: int, what: str, detail: str = "") -> None:
    """Raise ``NativeRefusal`` when ``code`` (a ``radix_status``) is not 0 (``RADIX_OK``)."""
    if code:
        raise NativeRefusal(code, what, detail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the C header of the native ABI table")
    parser.add_argument("--write", action="store_true", help=f"rewrite {HEADER.name} (default: print it)")
    parser.add_argument("--check", action="store_true", help="exit 1 where the committed header differs")
    opts = parser.parse_args(argv)
    text = header()
    if opts.check:
        same = HEADER.exists() and HEADER.read_text() == text
        print(f"{HEADER.name} {'matches' if same else 'differs from'} the table")
        return 0 if same else 1
    if opts.write:
        HEADER.write_text(text)
        print(f"wrote {HEADER}")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
