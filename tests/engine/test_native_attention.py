"""Our CPU attention kernel (engine.model.attention.native) against float64 math, the flash
kernel and itself; its build, its refusals and the backend's choice between the two."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from engine.model import native_build
from engine.model.attention import choose_backend, native
from engine.model.attention.cpu_native import CpuNativeBackend
from engine.model.attention.cpu_sdpa import CpuSdpaBackend
from engine.model.paged_attention import merge
from tests.conftest import seed_native

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[2]
FLAGS = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
HAS_SIMD = "avx512f" in FLAGS or {"avx2", "fma"} <= FLAGS  # the kernel's two vector layers
BUILDS = HAS_SIMD and shutil.which("cc") is not None


@pytest.fixture
def kernel(tmp_path, monkeypatch, native_template):
    """The kernel loaded from a folder of this test's own, seeded with the session's build."""
    seed_native(native_template, tmp_path / "native")
    monkeypatch.setenv(native.ENV_DIR, str(tmp_path / "native"))
    native.reset()
    k = native.kernel()
    yield k
    native.reset()


def pool_case(h: int, m: int, length: int, d: int, dtype: torch.dtype, seed: int = 0):
    """q [1, H, M, D]; k, v [1, H, L, D] as views into a larger pool (head stride != L*D)."""
    g = torch.Generator().manual_seed(seed)
    pool_k = torch.randn(h, length + 41, d, generator=g).to(dtype)
    pool_v = torch.randn(h, length + 41, d, generator=g).to(dtype)
    q = (torch.randn(1, h, m, d, generator=g) * 2).to(dtype)
    return q, pool_k[:, 17:17 + length].unsqueeze(0), pool_v[:, 17:17 + length].unsqueeze(0)


def reference(q, k, v, scale):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    return torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1)


def test_it_builds_on_a_machine_with_avx2_or_avx512_and_a_compiler(tmp_path, monkeypatch):
    if not BUILDS:
        pytest.skip("no AVX2/AVX-512 or no cc here: the backend falls back to the flash kernel")
    monkeypatch.setenv(native.ENV_DIR, str(tmp_path / "native"))  # empty: this one builds
    native.reset()
    try:
        kernel = native.kernel()
        assert kernel is not None and native.why() == ""
        assert kernel.path.parent == tmp_path / "native" and kernel.path.exists()
        assert isinstance(choose_backend(CPU), CpuNativeBackend)
    finally:
        native.reset()


@pytest.mark.skipif(not BUILDS, reason="the kernel does not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,m,length,d", [(3, 3, 2323, 64), (1, 1, 1, 16), (2, 2, 17, 16), (3, 8, 700, 64),
                                          (4, 5, 256, 128), (2, 4, 513, 32), (1, 7, 255, 256), (3, 9, 5, 64),
                                          (3, 24, 2323, 64), (3, 48, 6010, 64), (2, 64, 300, 32), (2, 33, 700, 128),
                                          (1, 40, 257, 96), (3, 17, 33, 64)])
def test_it_matches_float64_math_and_the_flash_kernel(kernel, dtype, h, m, length, d):
    if m > kernel.max_rows(dtype, d):
        q, k, v = pool_case(h, m, length, d, dtype)
        assert not kernel.fits(q, k, v)  # more rows than this CPU's path takes: the backend uses flash
        return
    q, k, v = pool_case(h, m, length, d, dtype)
    out, lse = kernel.attend(q, k, v, d ** -0.5)
    assert out.dtype == lse.dtype == torch.float32 and out.shape == (1, h, m, d) and lse.shape == (1, h, m)
    ref_out, ref_lse = reference(q, k, v, d ** -0.5)
    flash_out, flash_lse = CpuSdpaBackend().attend(q, k, v, d ** -0.5)
    flash_err = (flash_out.double() - ref_out).abs().max()
    err = (out.double() - ref_out).abs().max()
    if dtype == torch.float32 or m <= native.MAX_ROWS and not (kernel.many_rows and m >= 5):
        assert err < 2e-5  # float32 products and sums of exact inputs: only the summation order differs
    else:
        assert err < 5e-3 and err < flash_err  # the many-rows path rounds the weights to bf16, as flash does
    assert (lse.double() - ref_lse).abs().max() < 2e-5  # the scores themselves stay float32
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # the flash kernel rounds to bfloat16 on the way
    assert (out - flash_out.float()).abs().max() < tol and (lse - flash_lse).abs().max() < 1e-3


@pytest.mark.skipif(not BUILDS, reason="the kernel does not build here")
def test_two_halves_merged_by_their_lse_equal_the_whole(kernel):
    q, k, v = pool_case(3, 3, 900, 64, torch.bfloat16, seed=3)
    whole, _ = kernel.attend(q, k, v, 0.125)
    a, la = kernel.attend(q, k[:, :, :333], v[:, :, :333], 0.125)
    b, lb = kernel.attend(q, k[:, :, 333:], v[:, :, 333:], 0.125)
    assert (merge([a, b], [la, lb]) - whole).abs().max() < 1e-5


@pytest.mark.skipif(not BUILDS, reason="the kernel does not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 16, 30])  # 3, 48 and 90 folded rows: one call, or parts of 64
def test_a_shared_prefix_merged_in_place_equals_attention_over_every_key(kernel, dtype, tokens):
    """``merge_prefix``: the rows' own keys first (what the plan's rest calls leave in out/lse),
    then a prefix in two runs of the pool read and merged in C, in place, against float64
    attention over all of them; rows whose other part saw no keys (lse -inf) get the prefix's."""
    backend = CpuNativeBackend()
    h, g, d, scale = 3, 3, 64, 0.125
    gen = torch.Generator().manual_seed(tokens)
    k_pool, v_pool = (torch.randn(h, 900, d, generator=gen).to(dtype) for _ in range(2))
    runs = ((100, 300), (500, 250))
    own = slice(800, 840)
    q = (torch.randn(h * g, tokens, d, generator=gen) * 2).to(dtype)  # [Hq, n, D], the plan's view
    folded = q.reshape(1, h, g * tokens, d)
    if not (backend.takes_rows(dtype, g * tokens, d) or (g * tokens > native.AMX_MAX_ROWS
                                                        and kernel.many_rows_for(dtype, d))):
        assert not backend.merge_prefix(q, k_pool, v_pool, runs, scale, torch.zeros(h * g, tokens, d),
                                        torch.zeros(h * g, tokens))
        return  # this CPU's calls of that size go to flash, and so does the merge
    own_out, own_lse = reference(folded, k_pool[:, own].unsqueeze(0), v_pool[:, own].unsqueeze(0), scale)
    out = own_out.float().reshape(h * g, tokens, d).clone()
    lse = own_lse.float().reshape(h * g, tokens).clone()
    lse[0, 0] = float("-inf")  # a row whose other part had no keys
    wide_out, wide_lse = torch.empty(h * g, tokens + 2, d), torch.empty(h * g, tokens + 2)
    wide_out[:, 1:-1], wide_lse[:, 1:-1] = out, lse  # views with a stride, as the plan passes
    assert backend.merge_prefix(q, k_pool, v_pool, runs, scale, wide_out[:, 1:-1], wide_lse[:, 1:-1])
    keys = torch.cat([k_pool[:, a:a + n] for a, n in runs] + [k_pool[:, own]], 1).unsqueeze(0)
    values = torch.cat([v_pool[:, a:a + n] for a, n in runs] + [v_pool[:, own]], 1).unsqueeze(0)
    ref_out, ref_lse = reference(folded, keys, values, scale)
    prefix_out, prefix_lse = reference(folded, keys[:, :, :550], values[:, :, :550], scale)
    ref_out, ref_lse = ref_out.reshape(h * g, tokens, d), ref_lse.reshape(h * g, tokens)
    ref_out[0, 0], ref_lse[0, 0] = prefix_out[0, 0, 0], prefix_lse[0, 0, 0]
    tol = 2e-5 if dtype == torch.float32 else 5e-3  # bf16's many-rows paths round the weights to bf16
    assert (wide_out[:, 1:-1].double() - ref_out).abs().max() < tol
    assert (wide_lse[:, 1:-1].double() - ref_lse).abs().max() < 2e-5


@pytest.mark.skipif(not BUILDS, reason="the kernel does not build here")
@pytest.mark.parametrize("m", [4, 48])
def test_the_result_does_not_depend_on_the_thread_count(kernel, m):
    if m > kernel.max_rows(torch.float32, 64):  # an AVX2 build (RADIX_ISA=avx2, or an AVX2 CPU) takes 8
        pytest.skip(f"{kernel.simd} takes at most {kernel.max_rows(torch.float32, 64)} float32 rows a call")
    q, k, v = pool_case(3, m, 1500, 64, torch.float32, seed=5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.attend(q, k, v, 0.125)
        torch.set_num_threads(2)
        two = kernel.attend(q, k, v, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


@pytest.mark.skipif(not BUILDS, reason="the kernel does not build here")
def test_the_backend_takes_one_requests_rows_and_hands_the_rest_to_flash(kernel):
    backend = CpuNativeBackend()
    few = backend.few_rows
    q, k, v = pool_case(2, few, 300, 16, torch.bfloat16)
    out, _ = backend.attend(q, k, v, 0.25)
    assert out.dtype == torch.float32  # ours
    wide = pool_case(2, few + 1, 300, 16, torch.bfloat16)
    if not kernel.many_rows_for(torch.bfloat16, 16):
        assert backend.attend(*wide, 0.25)[0].dtype == torch.bfloat16  # flash: more rows
    fp32 = pool_case(2, 2, 300, 16, torch.float32)
    ours32 = kernel.attend(*fp32, 0.25)
    got32 = backend.attend(*fp32, 0.25)
    assert torch.equal(got32[0], ours32[0]) and torch.equal(got32[1], ours32[1])  # float32 too: ours
    mask = torch.zeros(1, 1, few, 300)
    assert backend.attend(q, k, v, 0.25, mask=mask)[0].dtype == torch.bfloat16  # a mask: flash


@pytest.mark.skipif(not BUILDS, reason="the kernel does not build here")
def test_a_library_built_for_another_cpu_is_not_loaded(tmp_path, monkeypatch, native_template):
    """The cache folder moved to another CPU (a shared home, a copied image): ``-march=native``
    code from there could die of an illegal instruction here, so the name differs and it builds anew."""
    seed_native(native_template, tmp_path)  # this CPU's build is there; the other CPU's is not
    monkeypatch.setenv(native.ENV_DIR, str(tmp_path))
    native.reset()
    try:
        here = native.kernel().path
        native.reset()
        monkeypatch.setattr(native_build, "cpu_signature", lambda: "model name : another CPU | flags : sse2")
        there = native.kernel().path
        assert there != here and here.exists() and there.exists()
    finally:
        native.reset()


def test_switched_off_it_is_not_built_and_the_flash_kernel_serves(tmp_path, monkeypatch):
    from engine.model.plan import choose_attention, read_settings

    monkeypatch.setenv(native.ENV_DIR, str(tmp_path / "native"))
    native.reset()
    try:
        backend, rejected = choose_attention(CPU, read_settings({"RADIX_NATIVE_ATTENTION": "0"}))
        assert type(backend) is CpuSdpaBackend
        assert rejected == [("attention", "cpu_native", "RADIX_NATIVE_ATTENTION=0")]
        assert not (tmp_path / "native").exists()  # never built: the plan did not ask
    finally:
        native.reset()


@pytest.mark.parametrize("compiler", ["/nonexistent/cc", "false"])
def test_a_missing_or_failing_compiler_leaves_the_flash_kernel(tmp_path, monkeypatch, compiler):
    monkeypatch.setenv(native.ENV_DIR, str(tmp_path / "native"))
    monkeypatch.setenv("CC", compiler)
    native.reset()
    try:
        assert native.kernel() is None and native.why()
        assert type(choose_backend(CPU)) is CpuSdpaBackend
        assert not list((tmp_path / "native").glob("*.so*"))  # no half-written library left behind
    finally:
        native.reset()


@pytest.mark.skipif(not BUILDS, reason="the kernel does not build here")
@pytest.mark.parametrize("damage", ["garbage", "empty", "another library"])
def test_a_damaged_library_file_is_built_again_by_the_next_process(tmp_path, damage, native_template):
    """A process never loads a library file twice, so the second run is another process."""
    seed_native(native_template, tmp_path / "native")  # the first process loads the session's build
    env = {**os.environ, native.ENV_DIR: str(tmp_path / "native"), "PYTHONPATH": str(REPO)}
    probe = ("from engine.model.attention import native; import torch\n"
             "k = native.kernel(); assert k is not None, native.why()\n"
             "q = torch.ones(1, 1, 1, 16); kv = torch.ones(1, 1, 3, 16)\n"
             "out, lse = k.attend(q, kv, kv, 0.25); assert torch.allclose(out, kv[:, :, :1]), out\n"
             "print(k.path)")
    first = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    path = Path(first.stdout.strip())
    path.unlink()
    if damage == "garbage":
        path.write_bytes(b"\x7fELF not really a library")
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        shutil.copy(Path(torch.__file__).parent / "lib" / "libshm.so", path)
    second = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert Path(second.stdout.strip()) == path and path.stat().st_size > 1000


@pytest.mark.skipif(not BUILDS, reason="the kernel does not build here")
def test_many_threads_asking_at_once_build_it_once(tmp_path, monkeypatch):
    monkeypatch.setenv(native.ENV_DIR, str(tmp_path / "native"))
    native.reset()
    try:
        got: list = []
        threads = [threading.Thread(target=lambda: got.append(native.kernel())) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len({id(k) for k in got}) == 1 and got[0] is not None
        assert len(os.listdir(tmp_path / "native")) == 1
    finally:
        native.reset()


@pytest.mark.skipif(not BUILDS, reason="the kernel does not build here")
def test_a_plan_reads_decode_rows_in_place_and_agrees_with_the_gathering_path(kernel):
    """Own rows: every decode row's rest is read in place, all rows in one call; a decode row
    that shares its prefix with no other row is read whole (however fragmented its slots); grouped
    rows still read their shared prefix once, and prefill chunks take the usual calls. Both plans
    give the same attention."""
    from engine.model.paged_attention import PagedPlan, PagedSegment

    gen = torch.Generator().manual_seed(4)
    hkv, g, d, slots = 2, 2, 16, 1400
    k_layer = torch.randn(hkv, slots, d, generator=gen).to(torch.bfloat16)
    v_layer = torch.randn(hkv, slots, d, generator=gen).to(torch.bfloat16)
    shared = list(range(0, 300))
    fragmented = list(range(400, 1000, 2)) + list(range(1001, 1100))  # 399 slots in 301 runs
    segments = [
        PagedSegment([5], 300, shared + [1200]),            # these two share a 300-token prefix
        PagedSegment([6], 301, shared + [1201, 1202]),
        PagedSegment([7], len(fragmented) - 1, fragmented),  # lone: read whole
        PagedSegment([8, 9, 10], 20, list(range(1300, 1323))),  # a prefill chunk: never whole
        PagedSegment([11], 4, [1350, 1351, 1352, 1353, 1354]),  # lone, too short to group: whole
    ]
    backend = CpuNativeBackend()
    whole = PagedPlan(segments, CPU, backend, own_rows=True)
    split = PagedPlan(segments, CPU, backend, own_rows=False)
    rows, pieces = whole.own_rows
    decode_positions = sorted(sum(whole.lens[:whole.order.index(i)]) for i in (0, 1, 2, 4))
    assert sorted(rows[:, 0].tolist()) == decode_positions and split.own_rows is None
    by_position = {int(pos): pieces[a:b] for pos, a, b in rows.tolist()}
    lone = by_position[sum(whole.lens[:whole.order.index(2)])]
    assert int(lone[:, 1].sum()) == len(fragmented)  # read whole: every slot
    grouped = by_position[sum(whole.lens[:whole.order.index(1)])]
    assert grouped[:, 0].tolist() == [1201] and int(grouped[:, 1].sum()) == 2  # only its own two slots
    assert [grp[2] for grp in whole.groups] == [((0, 300),), ((1300, 20),)]
    assert not whole.decode_calls(64) and split.decode_calls(64)
    total = sum(len(s.ids) for s in segments)
    query = torch.randn(1, hkv * g, total, d, generator=gen).to(torch.bfloat16)
    a = whole.attention(k_layer, v_layer, query, d ** -0.5)
    b = split.attention(k_layer, v_layer, query, d ** -0.5)
    # the same rows in the same pack order; the split path rounds to bfloat16 on the way
    assert whole.order == split.order and (a.float() - b.float()).abs().max() < 2e-2


@pytest.mark.skipif(not BUILDS, reason="the kernel does not build here")
def test_a_lone_decode_row_through_the_model_equals_a_forward_with_no_cache(tiny_runner_bf16, monkeypatch):
    from engine.kvcache.kv_pool import KVPool
    from engine.model.paged_attention import PagedSegment

    runner = tiny_runner_bf16
    assert isinstance(runner.attention, CpuNativeBackend)
    assert runner.attention.takes_rows(runner.dtype, runner.query_groups, runner.head_dim)
    pool = KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype, runner.device,
                  1200 * runner.kv_bytes_per_token)
    everything = pool.alloc(1200)
    pool.free(everything[::3])  # fragmented: every third slot free
    seq = torch.randint(10, 1000, (390,), generator=torch.Generator().manual_seed(9)).tolist()
    table = pool.alloc(len(seq) + 1)
    runner.forward_paged(pool, [PagedSegment(seq[:300], 0, table)])
    runner.forward_paged(pool, [PagedSegment(seq[300:], 300, table)])
    seq.append(17)
    ref, _ = runner.reference_prefill(seq)
    # the fused step (every layer in one C call, this attention called from C), then the unfused one
    assert runner.stack.fused is not None
    fused = runner.forward_paged(pool, [PagedSegment([17], len(seq) - 1, table)])[0]
    assert torch.allclose(fused, ref, atol=5e-2), (fused - ref).abs().max()
    monkeypatch.setattr(runner, "plan", dataclasses.replace(runner.plan, layers="stack"))  # the unfused stack
    calls = []
    real = runner.attention.attend_rows
    monkeypatch.setattr(runner.attention, "attend_rows", lambda *a: calls.append(a[3][1].shape) or real(*a))
    row = runner.forward_paged(pool, [PagedSegment([17], len(seq) - 1, table)])[0]
    assert len(calls) == runner.num_layers and calls[0][0] > 2  # many pieces, one call per layer
    assert torch.allclose(row, ref, atol=5e-2), (row - ref).abs().max()


@pytest.mark.skipif(not BUILDS, reason="the kernel does not build here")
def test_with_amx_or_avx512_bf16_the_backend_takes_up_to_64_bf16_rows_of_a_64_wide_head(kernel):
    backend = CpuNativeBackend()
    if not kernel.many_rows:
        assert not backend.takes_rows(torch.bfloat16, 48, 64)
        pytest.skip("neither AMX nor AVX512-BF16 here: only the few-rows path runs")
    assert backend.takes_rows(torch.bfloat16, 48, 64) and backend.takes_rows(torch.bfloat16, 64, 64)
    assert not backend.takes_rows(torch.bfloat16, 65, 64) and not backend.takes_rows(torch.bfloat16, 48, 16)
    # float32: many rows on AVX-512's FMAs (every product kept in float32), else on flash
    assert backend.takes_rows(torch.float32, 48, 64) == kernel.many_rows_fp32
    q, k, v = pool_case(3, 48, 600, 64, torch.bfloat16)
    assert backend.attend(q, k, v, 0.125)[0].dtype == torch.float32  # ours
    q, k, v = pool_case(3, 65, 600, 64, torch.bfloat16)
    assert backend.attend(q, k, v, 0.125)[0].dtype == torch.float32  # ours too, in two calls (the next test)


@pytest.mark.skipif(not BUILDS, reason="the kernel does not build here")
def test_more_bf16_rows_than_one_call_takes_go_in_parts(kernel):
    """A prefill chunk's rows over a shared prefix (150 here) in calls of 64 rows: each part's
    result is what a call for those rows alone gives, and the whole is within the many-rows path's
    bound of float64 math; where the CPU has no many-rows path, the flash kernel takes them."""
    backend = CpuNativeBackend()
    q, k, v = pool_case(3, 150, 700, 64, torch.bfloat16, seed=9)
    out, lse = backend.attend(q, k, v, 0.125)
    if not kernel.many_rows:
        assert out.dtype == torch.bfloat16  # flash
        return
    assert out.dtype == torch.float32 and out.shape == (1, 3, 150, 64) and lse.shape == (1, 3, 150)
    for lo in (0, 64, 128):
        part_out, part_lse = kernel.attend(q[:, :, lo:lo + 64], k, v, 0.125)
        assert torch.equal(out[:, :, lo:lo + 64], part_out) and torch.equal(lse[:, :, lo:lo + 64], part_lse)
    ref_out, ref_lse = reference(q, k, v, 0.125)
    flash_out, _ = CpuSdpaBackend().attend(q, k, v, 0.125)
    err = (out.double() - ref_out).abs().max()
    assert err < 5e-3 and err < (flash_out.double() - ref_out).abs().max()
    assert (lse.double() - ref_lse).abs().max() < 2e-5
    fp32 = pool_case(3, 150, 700, 64, torch.float32, seed=9)
    got32, lse32 = backend.attend(*fp32, 0.125)
    if kernel.many_rows_fp32:  # float32 in parts too, each within float32 rounding of float64 math
        for lo in (0, 64, 128):
            part_out, _ = kernel.attend(fp32[0][:, :, lo:lo + 64], fp32[1], fp32[2], 0.125)
            assert torch.equal(got32[:, :, lo:lo + 64], part_out)
        ref32, ref_lse32 = reference(*fp32, 0.125)
        assert (got32.double() - ref32).abs().max() < 2e-5 and (lse32.double() - ref_lse32).abs().max() < 2e-5
    else:
        assert torch.equal(got32, CpuSdpaBackend().attend(*fp32, 0.125)[0])  # flash
    assert backend.attend(q, k, v, 0.125, mask=torch.zeros(1, 1, 150, 700))[0].dtype == torch.bfloat16  # a mask: flash


@pytest.mark.skipif(not BUILDS, reason="the kernel does not build here")
def test_threads_calling_at_once_get_what_each_gets_alone(kernel):
    """Two engines' compute threads may call the kernel at the same time (each its own OpenMP
    team, each AMX call its own thread-local staging): every result equals the lone call's."""
    rows = (3, 24, 48, 2, 9, 64) if kernel.many_rows else (3, 8, 5, 2, 7, 1)  # else: up to MAX_ROWS
    rows32 = (2, 48, 7, 64) if kernel.many_rows_fp32 else (2, 4)
    cases = [pool_case(3, m, 700 + 50 * i, 64, torch.bfloat16, seed=i) for i, m in enumerate(rows)]
    cases += [pool_case(3, m, 650 + 70 * i, 64, torch.float32, seed=20 + i) for i, m in enumerate(rows32)]
    alone = [kernel.attend(q, k, v, 0.125) for q, k, v in cases]
    got: dict[int, list] = {}

    def worker(t: int) -> None:
        got[t] = [kernel.attend(*cases[(t + j) % len(cases)], 0.125) for j in range(12)]

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for t, results in got.items():
        for j, (out, lse) in enumerate(results):
            ref_out, ref_lse = alone[(t + j) % len(cases)]
            assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@pytest.mark.skipif(not BUILDS, reason="the kernel does not build here")
def test_pieces_outside_the_pool_are_refused_and_write_nothing(kernel):
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(2, 100, 16, generator=gen)
    q = torch.randn(4, 3, 16, generator=gen)  # [Hq, T, D]
    out, lse = torch.zeros(4, 3, 16), torch.zeros(4, 3)
    for runs in ([(90, 20)], [(-1, 5)]):
        with pytest.raises(ValueError, match="refused"):
            kernel.attend_rows(q, k, k, native.cut_rows([(1, runs)]), 0.25, out, lse)
    assert not out.any() and not lse.any()
    kernel.attend_rows(q, k, k, native.cut_rows([(1, [(90, 10)])]), 0.25, out, lse)
    assert out[:, 1].any() and not out[:, 0].any() and not out[:, 2].any()
