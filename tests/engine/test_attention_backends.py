"""Attention backends (``engine.model.attention``): chosen once by device or by name, equal to
a plain reference attention (float64) and to each other for many shapes, the math backend
within its workspace cap whatever the sizes, and an out-of-memory error in attention failing
the forward with a clear error and an unchanged cache (tiny random Llama)."""

from __future__ import annotations

import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from engine.kvcache.kv_pool import KVPool
from engine.model.attention import AttentionBackend, Causal, choose_backend
from engine.model.attention.cpu_sdpa import CpuSdpaBackend
from engine.model.attention.math_chunked import MathChunkedBackend, block_bytes
from engine.model.paged_attention import PagedPlan, PagedSegment
from engine.types import EngineError, EngineFault
from tests.conftest import fast_paths

CPU = torch.device("cpu")


def reference(q_heads: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention in float64, heads unfolded: query head ``h`` reads KV head ``h // g``.
    ``q_heads`` [Hq, n, D], ``k``/``v`` [Hkv, L, D], ``hidden`` bool [n, L] (True: masked)."""
    g = q_heads.shape[0] // k.shape[0]
    kr, vr = k.double().repeat_interleave(g, 0), v.double().repeat_interleave(g, 0)
    scores = q_heads.double() @ kr.transpose(-1, -2) * scale
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.softmax(scores, -1) @ vr, lse


def folded_call(backend: AttentionBackend, q_heads: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                causal: Causal | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The call the plan makes for a prefill chunk: grouped heads folded into the rows."""
    hq, n, d = q_heads.shape
    hkv = k.shape[0]
    out, lse = backend.attend(q_heads.reshape(1, hkv, hq // hkv * n, d), k.unsqueeze(0), v.unsqueeze(0), scale,
                              causal=causal)
    return out.reshape(hq, n, d), lse.reshape(hq, n)


def random_case(seed: int, hkv: int, g: int, n: int, keys: int, d: int = 8):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(hkv * g, n, d, generator=gen), torch.randn(hkv, keys, d, generator=gen),
            torch.randn(hkv, keys, d, generator=gen))


# ------------------------------------------------------------------ the choice

def test_the_choice_is_by_device_and_a_name_overrides_it(monkeypatch):
    from engine.model.plan import choose_attention, read_settings

    assert isinstance(choose_backend(CPU), CpuSdpaBackend)
    assert isinstance(choose_backend(torch.device("cuda")), MathChunkedBackend)  # a name, no device needed
    assert isinstance(choose_backend(torch.device("mps")), MathChunkedBackend)
    assert isinstance(choose_backend(CPU, "math_chunked"), MathChunkedBackend)
    assert isinstance(choose_attention(CPU, read_settings({"RADIX_ATTENTION_BACKEND": "math_chunked"}))[0],
                      MathChunkedBackend)  # the plan's choice: the old switch names it
    with pytest.raises(EngineError, match="unknown attention backend"):
        choose_backend(CPU, "flash9")
    with pytest.raises(EngineError, match="does not run on cuda"):
        choose_backend(torch.device("cuda"), "cpu_sdpa")


def test_the_runner_takes_its_backend_once_at_start(tokenizer, monkeypatch):
    from tests.conftest import make_tiny_runner

    monkeypatch.setenv("RADIX_KERNELS", "attention=math_chunked")
    monkeypatch.setenv("RADIX_EXACT", "0")  # the backends serve the fast paths (issue 44: exact mode has its own)
    runner = make_tiny_runner(tokenizer)
    try:
        assert isinstance(runner.attention, MathChunkedBackend)
        pool = KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype, runner.device,
                      64 * runner.kv_bytes_per_token)
        before = runner.attention.blocks_run
        runner.forward_paged(pool, [PagedSegment(list(range(10, 30)), 0, pool.alloc(20))])
        assert runner.attention.blocks_run > before  # forward_paged went through it
    finally:
        runner.close()


# ------------------------------------------------------------------ exactness

@settings(max_examples=60, deadline=None)
@given(hkv=st.integers(1, 3), g=st.integers(1, 3), n=st.integers(2, 40), before=st.integers(0, 60),
       shared=st.integers(0, 30), cap_rows=st.integers(1, 9), cap_keys=st.integers(1, 17), seed=st.integers(0, 99))
def test_a_prefill_chunk_equals_plain_attention_on_both_backends(hkv, g, n, before, shared, cap_rows, cap_keys, seed):
    """A chunk of ``n`` tokens at position ``past``, over its rest segment starting at ``k_start``
    (positions before it lie in a shared segment, read by another call): causal rule, GQA fold,
    and a math workspace cap that forces blocks smaller than the rows and the keys."""
    past = before + shared
    k_start = shared
    keys = past + n - k_start
    q, k, v = random_case(seed, hkv, g, n, keys)
    causal = Causal(q_start=past, k_start=k_start, period=n, length=keys, device=CPU)
    hidden = causal.hidden(range(n), range(keys))
    ref_out, ref_lse = reference(q, k, v, 0.3, hidden)
    cap = block_bytes(1, hkv, cap_rows, cap_keys, 8)
    for backend in (CpuSdpaBackend(), MathChunkedBackend(), MathChunkedBackend(workspace_bytes=cap)):
        out, lse = folded_call(backend, q, k, v, 0.3, causal)
        assert torch.allclose(out.double(), ref_out, atol=1e-5), (backend.name, (out - ref_out).abs().max())
        assert torch.allclose(lse.double(), ref_lse, atol=1e-5), backend.name


@pytest.mark.parametrize("workspace", [None, 2_000, 20_000])
def test_decode_rows_with_padding_and_a_shared_segment_equal_plain_attention(workspace):
    """Decode rows (batched, padded to the widest rest by an additive mask) and a shared
    segment with no mask: both backends, any block size, against the reference."""
    gen = torch.Generator().manual_seed(3)
    b, hkv, g, width, d = 7, 2, 3, 33, 8
    q = torch.randn(b, hkv, g, d, generator=gen)
    k, v = torch.randn(b, hkv, width, d, generator=gen), torch.randn(b, hkv, width, d, generator=gen)
    lens = torch.tensor([33, 1, 5, 20, 33, 2, 17])
    mask = torch.zeros(b, width).masked_fill_(torch.arange(width)[None, :] >= lens[:, None], float("-inf"))
    mask = mask.view(b, 1, 1, width)
    scores = (q.double() @ k.double().transpose(-1, -2)) * 0.25 + mask.double()
    ref_out, ref_lse = torch.softmax(scores, -1) @ v.double(), torch.logsumexp(scores, -1)
    math = MathChunkedBackend(workspace_bytes=workspace)
    for backend in (CpuSdpaBackend(), math):
        out, lse = backend.attend(q, k, v, 0.25, mask=mask)
        assert torch.allclose(out.double(), ref_out, atol=1e-5) and torch.allclose(lse.double(), ref_lse, atol=1e-5)
        shared_out, shared_lse = backend.attend(q, k, v, 0.25)  # no mask: every key
        full = (q.double() @ k.double().transpose(-1, -2)) * 0.25
        assert torch.allclose(shared_out.double(), torch.softmax(full, -1) @ v.double(), atol=1e-5)
        assert torch.allclose(shared_lse.double(), torch.logsumexp(full, -1), atol=1e-5)
    if workspace is not None:
        assert math.blocks_run > 2


def test_bfloat16_inputs_come_back_in_bfloat16_close_to_the_cpu_kernel():
    q, k, v = (t.to(torch.bfloat16) for t in random_case(5, 2, 2, 12, 30))
    causal = Causal(q_start=18, k_start=0, period=12, length=30, device=CPU)
    o1, l1 = folded_call(CpuSdpaBackend(), q, k, v, 0.3, causal)
    o2, l2 = folded_call(MathChunkedBackend(workspace_bytes=3_000), q, k, v, 0.3, causal)
    assert o2.dtype == torch.bfloat16 and l2.dtype == torch.float32
    assert torch.allclose(o1.float(), o2.float(), atol=2e-2) and torch.allclose(l1, l2, atol=2e-2)


def test_the_whole_forward_with_a_tiny_workspace_equals_the_cpu_kernel(tiny_runner, monkeypatch):
    """``forward_paged`` on the math backend with blocks of a few rows and keys: logits equal
    the default backend's to 1e-5 (fp32), over a shared prefix, chunks and decodes."""
    runner = tiny_runner
    fast_paths(runner, monkeypatch)  # the backends serve the fast paths
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(10, 1000, (48,), generator=gen).tolist()
    seqs = [shared + torch.randint(10, 1000, (5 + 9 * i,), generator=gen).tolist() for i in range(3)]

    def run() -> list[torch.Tensor]:
        pool = KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype, runner.device,
                      400 * runner.kv_bytes_per_token)
        prefix = pool.alloc(48)
        tables = [prefix + pool.alloc(len(s) - 48 + 2) for s in seqs]
        outs = [runner.forward_paged(pool, [PagedSegment(shared, 0, prefix)], every_position=True)]
        outs.append(runner.forward_paged(pool, [PagedSegment(s[48:], 48, t) for s, t in zip(seqs, tables, strict=True)]))
        outs.append(runner.forward_paged(pool, [PagedSegment([9], len(s), t) for s, t in zip(seqs, tables, strict=True)]))
        return outs

    expected = run()
    math = MathChunkedBackend(workspace_bytes=block_bytes(1, runner.num_kv_heads, 4, 8, runner.head_dim))
    monkeypatch.setattr(runner, "attention", math)
    got = run()
    assert math.blocks_run > 50
    for a, b in zip(expected, got, strict=True):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def test_a_plan_with_a_capped_backend_splits_its_decode_rows_and_attends_the_same():
    """One pack of decode rows of different lengths, a prefill chunk over a gathered rest and a
    group sharing a prefix, on pool layers of random KV: the math backend with a small cap
    reads the decode rows in several calls (their gathered KV within the cap) and every output
    equals the CPU kernel's plan."""
    gen = torch.Generator().manual_seed(21)
    hkv, g, d, size = 2, 2, 8, 400
    k_layer, v_layer = torch.randn(hkv, size, d, generator=gen), torch.randn(hkv, size, d, generator=gen)
    prefix = list(range(0, 30))
    segments = [PagedSegment([1], 30 + i, prefix + list(range(100 + 20 * i, 100 + 20 * i + i + 1))) for i in range(6)]
    segments += [PagedSegment([1], 12 + 3 * i, list(range(250 + 20 * i, 250 + 20 * i + 13 + 3 * i))) for i in range(4)]
    segments += [PagedSegment([1, 2, 3, 4, 5], 20, list(range(340, 370, 2)) + list(range(371, 381)))]
    cap = block_bytes(1, hkv, 4, 6, d)
    plans = [PagedPlan(segments, CPU, CpuSdpaBackend()), PagedPlan(segments, CPU, MathChunkedBackend(cap))]
    total = plans[0].total
    query = torch.randn(1, hkv * g, total, d, generator=gen)
    outs = [plan.attention(k_layer, v_layer, query, 0.35) for plan in plans]
    calls = plans[1].decode_calls(2 * hkv * d * 4)
    assert len(calls) > 3 and all(c.pos.numel() * c.width * 2 * hkv * d * 4 <= cap or c.pos.numel() == 1
                                  for c in calls)
    assert len(plans[0].decode_calls(2 * hkv * d * 4)) == 1  # uncapped: one call, as before
    assert torch.allclose(outs[0], outs[1], atol=1e-5), (outs[0] - outs[1]).abs().max()


# ------------------------------------------------------------------ the workspace

class LiveBytes(TorchDispatchMode):
    """Counts the bytes of every storage an op creates while it lives (inputs and views of
    them excluded): ``peak`` is the most scratch memory alive at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._alive: set[int] = set()

    def _free(self, ptr: int, nbytes: int) -> None:
        self._alive.discard(ptr)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or ptr in inputs or ptr in self._alive:
                continue
            self._alive.add(ptr)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, ptr, nbytes)
        return out


def test_the_math_backend_stays_within_its_cap_whatever_the_sizes():
    """A 300-token chunk over 1,500 keys, 2 KV heads of 3 query heads each: full scores would
    be 10.8 MB (and as much again for the probabilities); with a 256 KiB cap the peak scratch
    alive at once, measured op by op, stays under it, and the output is still exact."""
    q, k, v = random_case(9, 2, 3, 300, 1500, d=16)
    causal = Causal(q_start=1200, k_start=0, period=300, length=1500, device=CPU)
    cap = 256 << 10
    math = MathChunkedBackend(workspace_bytes=cap)
    with LiveBytes() as scratch:
        out, lse = folded_call(math, q, k, v, 0.3, causal)
    outputs = out.numel() * 4 + lse.numel() * 4
    assert scratch.peak - outputs <= cap, (scratch.peak, outputs)
    assert math.blocks_run > 20 and math.peak_block_bytes <= cap
    ref_out, ref_lse = reference(q, k, v, 0.3, causal.hidden(range(300), range(1500)))
    assert torch.allclose(out.double(), ref_out, atol=1e-5) and torch.allclose(lse.double(), ref_lse, atol=1e-5)
    with LiveBytes() as whole:  # the measure sees an unblocked attention's scores
        reference(q.float(), k, v, 0.3, None)
    assert whole.peak > 10 * cap


def test_a_cap_too_small_for_one_row_is_a_clear_error():
    q, k, v = random_case(1, 2, 2, 4, 10)
    with pytest.raises(EngineFault, match="workspace"):
        folded_call(MathChunkedBackend(workspace_bytes=100), q, k, v, 0.3, None)


# ------------------------------------------------------------------ out of memory

class OutOfMemoryOnce(CpuSdpaBackend):
    """The CPU kernel, except that the call ``fail_at`` runs out of memory."""

    def __init__(self, fail_at: int) -> None:
        self.calls, self.fail_at = 0, fail_at

    def attend(self, q, k, v, scale, mask=None, causal=None):
        self.calls += 1
        if self.calls == self.fail_at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 600.00 MiB")
        return super().attend(q, k, v, scale, mask=mask, causal=causal)


def test_out_of_memory_in_attention_fails_the_forward_clearly_and_leaves_the_cache_as_it_was(tiny_runner,
                                                                                                monkeypatch):
    runner = tiny_runner
    fast_paths(runner, monkeypatch)  # the backends serve the fast paths
    pool = KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype, runner.device,
                  200 * runner.kv_bytes_per_token)
    gen = torch.Generator().manual_seed(4)
    shared = torch.randint(10, 1000, (40,), generator=gen).tolist()
    prefix = pool.alloc(40)
    runner.forward_paged(pool, [PagedSegment(shared, 0, prefix)])

    def prefix_kv() -> torch.Tensor:
        return torch.stack([torch.stack([k[:, prefix], v[:, prefix]]) for k, v in zip(pool.k, pool.v, strict=True)])

    cached = prefix_kv()
    seqs = [shared + torch.randint(10, 1000, (6 + i,), generator=gen).tolist() for i in range(3)]
    tables = [prefix + pool.alloc(len(s) - 40 + 1) for s in seqs]
    segments = [PagedSegment(s[40:], 40, t) for s, t in zip(seqs, tables, strict=True)]
    monkeypatch.setattr(runner, "attention", OutOfMemoryOnce(fail_at=5))  # in the second layer
    with pytest.raises(EngineFault, match="out of cpu memory in attention") as failed:
        runner.forward_paged(pool, segments)
    assert failed.value.__context__ is None and failed.value.__cause__ is None  # the failed call's tensors go
    assert torch.equal(prefix_kv(), cached)
    logits = runner.forward_paged(pool, segments)  # the same requests again: exact
    for row, seq in zip(logits, seqs, strict=True):
        ref, _ = runner.reference_prefill(seq)
        assert torch.allclose(row, ref, atol=1e-4)
