"""The kernels built for each instruction set this CPU can run (``RADIX_ISA``, issue 48): the
exactness checks of the native kernels (native linear against float64 and PyTorch, attention
against float64 and the flash kernel, batched rows equal lone ones, fused equals unfused) run on
every build, so an AVX2 build is checked on an AVX-512 machine; the builds' names and the tier
fingerprint tell them apart, the default's name is the one of before, and a setting the CPU
cannot run is refused.

Each instruction set is built once per session into a folder of its own (a few seconds each);
the checks reuse the other test files' functions with that build loaded.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import tests.engine.test_batching_exact as batching_tests
import tests.engine.test_bit_exact as exact_tests
import tests.engine.test_fused_decode as fused_tests
import tests.engine.test_native_attention as attention_tests
import tests.engine.test_native_linear as linear_tests
from engine.kvcache.tier_identity import fingerprint
from engine.model import native_build, native_linear
from engine.model.attention import native
from engine.model.attention.cpu_native import CpuNativeBackend
from tests.conftest import make_tiny_runner, seed_native

RUNNABLE = [name for name in native_build.ISAS if not native_build.refused_isa(name)]
pytestmark = pytest.mark.skipif(not attention_tests.BUILDS, reason="our C kernels do not build here")
LIBRARIES = (native_linear._library, native._library)  # the two OnFirstUse of the process


@pytest.fixture(scope="session")
def isa_root(tmp_path_factory, native_template) -> Path:
    """One folder per instruction set under here: each build is made once per session (the
    default's, ``native``, is the session's template build)."""
    root = tmp_path_factory.mktemp("isa-builds")
    seed_native(native_template, root / "native")
    return root


@pytest.fixture(params=RUNNABLE)
def isa(request, isa_root) -> Iterator[str]:
    """``RADIX_ISA`` set to each runnable instruction set, with its build loaded (built into its
    session folder on first use); afterwards the process's libraries are the ones of before."""
    saved = [(lib._value, lib._tried, lib.why, lib.isa) for lib in LIBRARIES]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(native_build.ENV_ISA, request.param)
        mp.setenv(native_build.ENV_DIR, str(isa_root / request.param))
        for lib in LIBRARIES:
            lib.reset()
        if native_linear.kernel() is None or native.kernel() is None:
            pytest.fail(f"the {request.param} build failed: {native_linear.why() or native.why()}")
        try:
            yield request.param
        finally:
            for lib, (value, tried, why, name) in zip(LIBRARIES, saved, strict=True):
                lib.reset()
                lib._value, lib._tried, lib.why, lib.isa = value, tried, why, name


_runners: dict[tuple[str, torch.dtype], object] = {}


@pytest.fixture(params=["float32", "bfloat16"])
def isa_runner(request, isa, tokenizer):
    """The tiny Llama made under ``isa`` (once per session per build and dtype)."""
    dtype = getattr(torch, request.param)
    if (isa, dtype) not in _runners:
        _runners[isa, dtype] = make_tiny_runner(tokenizer, dtype=dtype)
    return _runners[isa, dtype]


def test_each_build_is_the_instruction_set_it_names(isa):
    lin, att = native_linear.kernel(), native.kernel()
    assert native_linear._library.isa == native._library.isa == isa
    assert (f"-{isa}-" in lin.path.name) == (isa != "native") and (f"-{isa}-" in att.path.name) == (isa != "native")
    if isa == "avx2":  # as on an AVX2-only CPU: no AVX-512 path, no bf16 dot products, AVX2's row cap
        assert att.simd == "AVX2" and not (att.amx or att.many_rows or att.many_rows_fp32)
        assert not native_build.bf16_dot_products() and CpuNativeBackend().few_rows == native.MAX_ROWS
        assert "avx2 (RADIX_ISA=avx2" in native_build.describe_isa()
    if isa == "avx512":
        assert att.simd == "AVX-512" and not (att.amx or att.many_rows) and att.many_rows_fp32


@pytest.mark.parametrize("rows", [1, 4, 5, 32])
def test_linear_matches_float64_math_and_pytorch(isa, rows):
    for out_features in (7, 577):
        linear_tests.test_it_matches_float64_math_and_pytorch(native_linear.kernel(), rows, out_features, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_alone_equal_rows_in_a_batch(isa, dtype):
    for out_features in (300, 302):
        linear_tests.test_a_row_alone_equals_the_same_row_in_any_batch_bit_for_bit(native_linear.kernel(), dtype,
                                                                                    True, out_features)


def test_bf16_linears_where_there_are_no_bf16_dot_products(isa):
    if native_build.bf16_dot_products():
        pytest.skip("this build has bf16 dot products: oneDNN's packed product serves bf16")
    linear_tests.test_bfloat16_at_any_rows_and_in_blocks(native_linear.kernel())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_matches_float64_math_and_the_flash_kernel(isa, dtype):
    for shape in ((3, 3, 2323, 64), (3, 8, 700, 64), (4, 5, 256, 128), (3, 24, 2323, 64), (2, 64, 300, 32)):
        attention_tests.test_it_matches_float64_math_and_the_flash_kernel(native.kernel(), dtype, *shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_of_a_shared_prefix_merged_in_place(isa, dtype):
    for tokens in (1, 16, 30):
        attention_tests.test_a_shared_prefix_merged_in_place_equals_attention_over_every_key(native.kernel(), dtype,
                                                                                              tokens)


def test_attention_does_not_depend_on_the_thread_count_or_the_plan(isa):
    for m in (4, 48) if native.kernel().max_rows(torch.float32, 64) >= 48 else (4, 8):
        attention_tests.test_the_result_does_not_depend_on_the_thread_count(native.kernel(), m)
    attention_tests.test_a_plan_reads_decode_rows_in_place_and_agrees_with_the_gathering_path(native.kernel())


def test_fused_steps_give_the_unfused_logits_and_batched_rows_equal_lone_ones(isa, isa_runner, tokenizer):
    assert isa_runner.stack.fused is not None
    assert (isa_runner.packed_linears > 0) == (isa_runner.dtype == torch.bfloat16 and native_build.bf16_dot_products())
    for seed in range(2):
        fused_tests.test_fused_steps_give_the_unfused_logits_and_kv(tokenizer, isa_runner, seed)
    fused_tests.test_batched_fused_rows_equal_lone_ones_bit_for_bit(tokenizer, isa_runner)


def test_paged_rows_joining_and_leaving_equal_forwards_from_scratch(isa, tokenizer):
    batching_tests.test_paged_rows_join_and_leave_exact(make_tiny_runner(tokenizer))


def test_the_exact_forward_gives_every_row_its_bits_alone(isa, isa_runner):
    """Issue 44 on every build: a decode row alone, among sixteen and beside a prefill chunk, and a few
    schedules of reuse and chunks, all ``torch.equal`` to the request run alone."""
    assert isa_runner.runs_exact
    exact_tests.test_a_decode_row_alone_among_sixteen_and_beside_a_long_chunk(isa_runner)
    exact_tests.test_scratch_buffer_paths_and_the_no_reuse_baseline_give_the_pools_bits(isa_runner)
    for case in (([300, 280, 40], [None, 0, 1], 3, [256, 1, 33], [5, 3, 7, 1]), ([520, 9], [None, 0], 4, [7, 300], [3])):
        exact_tests.assert_every_row_alone(isa_runner, *exact_tests.run_schedule(isa_runner, *case))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=exact_tests.schedules())
def test_random_schedules_give_every_row_its_bits_alone_on_every_build(isa, isa_runner, case):
    """The bit-exact schedules of ``test_bit_exact`` (reuse, chunks, rows joining and leaving, KV moved)
    on each build: the AVX2 build's attention has loops of its own (eight-lane tiles)."""
    exact_tests.assert_every_row_alone(isa_runner, *exact_tests.run_schedule(isa_runner, *case))


def test_the_default_name_is_the_one_of_before_and_each_build_has_its_own(monkeypatch):
    monkeypatch.delenv(native_build.ENV_ISA, raising=False)
    compiler = shutil.which("cc") or "cc"
    src = native_linear.SOURCE
    text = src.read_bytes() + src.with_name("native_abi.h").read_bytes()  # the source and the header it includes
    before = hashlib.sha256(text + " ".join(
        (compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", native_build.cpu_signature())).encode())
    assert native_build.isa() == "native" and native_build.flags() == native_build.FLAGS
    assert native_build.library_name(src, compiler) == f"native_linear-{before.hexdigest()[:16]}.so"
    names = {native_build.library_name(src, compiler, name) for name in native_build.ISAS}
    assert len(names) == len(native_build.ISAS)
    assert "-march=x86-64-v3" in native_build.flags("avx2") and "-march=native" not in native_build.flags("avx2")


def test_the_tier_fingerprint_names_a_narrower_build_only(tokenizer):
    args = ("m", torch.float32, tokenizer, 2, 2, 16)
    assert fingerprint(*args) == fingerprint(*args, isa="native")  # the default: the names of before
    assert len({fingerprint(*args), fingerprint(*args, isa="avx2"), fingerprint(*args, isa="avx512")}) == 3


def test_a_setting_the_cpu_cannot_run_is_refused_and_the_native_build_used(monkeypatch, caplog):
    avx2_only = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})
    assert "avx512f" in native_build.refused_isa("avx512", avx2_only)
    assert native_build.refused_isa("avx2", avx2_only) == ""
    assert "not one of" in native_build.refused_isa("sse9")
    monkeypatch.setattr(native_build, "cpu_flags", lambda: avx2_only)
    monkeypatch.setenv(native_build.ENV_ISA, "avx512")
    monkeypatch.setattr(native_build, "_said_isa", set())
    with caplog.at_level(logging.WARNING, logger=native_build.log.name):
        assert native_build.isa() == "native" and native_build.isa() == "native"
    refusals = [r for r in caplog.records if "RADIX_ISA=avx512 needs" in r.getMessage()]
    assert len(refusals) == 1 and "native" in refusals[0].getMessage()  # one line, whatever the calls
