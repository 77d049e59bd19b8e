"""Our float32 linear kernel for decode steps (engine.model.native_linear) against PyTorch's
product and float64 math; a row's result alone and in a batch; where it steps aside."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from engine.model import native_build, native_linear
from engine.model.native_linear import MAX_ROWS, NativeLinear, plain_linears, use_native_linears
from tests.conftest import seed_native
from tests.engine.test_native_attention import BUILDS


@pytest.fixture
def kernel(tmp_path, monkeypatch, native_template):
    """The kernel loaded from a folder of this test's own, seeded with the session's build."""
    seed_native(native_template, tmp_path / "native")
    monkeypatch.setenv(native_build.ENV_DIR, str(tmp_path / "native"))
    native_linear.reset()
    k = native_linear.kernel()
    if k is None:
        pytest.skip(f"the kernel does not build here: {native_linear.why()}")
    yield k
    native_linear.reset()


def model(gen, *shapes, bias=False) -> nn.Sequential:
    layers = [nn.Linear(i, o, bias=bias) for i, o in shapes]
    for layer in layers:
        with torch.no_grad():
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * 0.05)
            if layer.bias is not None:
                layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen))
    return nn.Sequential(*layers)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16, 31, 32])
@pytest.mark.parametrize("out_features", [1, 7, 64, 577])
@pytest.mark.parametrize("bias", [False, True])
def test_it_matches_float64_math_and_pytorch(kernel, rows, out_features, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    lin = model(gen, (576, out_features), bias=bias)[0]
    x = torch.randn(rows, 576, generator=gen)
    ref = x.double() @ lin.weight.double().T + (0 if lin.bias is None else lin.bias.double())
    got = kernel.run(x, lin.weight, lin.bias)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    assert (got.double() - ref).abs().max() < 1e-4
    assert (got - nn.functional.linear(x, lin.weight, lin.bias)).abs().max() < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features", [300, 302])
def test_a_row_alone_equals_the_same_row_in_any_batch_bit_for_bit(kernel, dtype, bias, out_features):
    # up to four rows: one weight row at a time; more: six or eight weight rows side by side, and a
    # block's last outputs that make no tile (300, 302) one at a time again; a batch's last rows fewer
    # than four; past 64 rows, groups of 64 rows (the last one here of two: one weight row at a time)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(out_features, 1536, generator=gen).to(dtype)
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(130, 1536, generator=gen)
    batch = kernel.run(x, w, b)
    for i in range(130):
        assert torch.equal(kernel.run(x[i:i + 1], w, b)[0], batch[i])
    for lo, hi in ((5, 12), (0, 2), (3, 6), (16, 19), (60, 130)):
        assert torch.equal(kernel.run(x[lo:hi], w, b), batch[lo:hi])


def test_the_result_does_not_depend_on_the_thread_count(kernel):
    gen = torch.Generator().manual_seed(4)
    w, x = torch.randn(999, 64, generator=gen), torch.randn(6, 64, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, lone = kernel.run(x, w, None), kernel.run(x[:1], w, None)
        torch.set_num_threads(2)
        assert torch.equal(one, kernel.run(x, w, None)) and torch.equal(lone, kernel.run(x[:1], w, None))
    finally:
        torch.set_num_threads(before)


def test_strided_rows_and_shapes_it_refuses(kernel):
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(10, 64, generator=gen)
    wide = torch.randn(4, 100, generator=gen)
    got = kernel.run(wide[:, 20:84], w, None)  # rows 100 apart
    assert torch.allclose(got, wide[:, 20:84] @ w.T, atol=1e-5)
    with pytest.raises(ValueError, match="refused"):
        kernel.run(torch.randn(2, 12), torch.randn(3, 12), None)  # in not a multiple of 8


def test_a_model_turned_native_computes_what_it_did_and_steps_aside_where_it_should(kernel):
    gen = torch.Generator().manual_seed(6)
    m = model(gen, (64, 96), (96, 13), (13, 40), bias=True)
    x = torch.randn(1, 5, 64, generator=gen)
    plain = copy.deepcopy(m)
    with torch.inference_mode():
        before = m(x)
    assert use_native_linears(m) == 2  # the 13-wide input is not a multiple of 8: stays plain
    assert [type(layer) for layer in m] == [NativeLinear, NativeLinear, nn.Linear]
    with torch.inference_mode():
        after = m(x)
        long = torch.randn(1, MAX_ROWS + 1, 64, generator=gen)
        assert torch.equal(m(long), plain(long))  # a prefill chunk: PyTorch's product, bit for bit
    assert (after - before).abs().max() < 1e-5
    y = m(x)  # grad enabled: PyTorch's product, so autograd still works
    y.sum().backward()
    assert m[0].weight.grad is not None
    assert plain_linears(m) == 2 and all(type(layer) is nn.Linear for layer in m)
    assert list(m.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]


@pytest.mark.skipif(native_build.bf16_dot_products(), reason="native bf16 here: oneDNN's product serves bf16")
def test_bfloat16_at_any_rows_and_in_blocks(kernel):
    """bf16 (on a CPU whose linears were not oneDNN-packed; ``RADIX_ISA=avx2`` on one that has
    them, ``test_isa_builds``): ours at any number of rows, in blocks; products in float32, rounded
    once to bf16 like PyTorch's; a row's result whatever its batch, one row included."""
    gen = torch.Generator().manual_seed(8)
    m = model(gen, (64, 96), bias=True).to(torch.bfloat16)
    plain = copy.deepcopy(m)
    assert use_native_linears(m) == 1
    with torch.inference_mode():
        for rows in (1, 2, 7, native_linear.BF16_BLOCK + 3):
            x = torch.randn(1, rows, 64, generator=gen).to(torch.bfloat16)
            got, ref = m(x), plain(x)
            assert got.dtype == torch.bfloat16 and got.shape == ref.shape
            exact = x.double() @ m[0].weight.double().T + m[0].bias.double()
            assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-6).all()  # one bf16 rounding
        for alone in (m(x[:, 5:6].expand(1, 2, 64))[0, 0], m(x[:, 5:6])[0, 0]):
            assert torch.equal(m(x)[0, 5], alone)  # a row's result does not depend on its batch or block


def test_the_switch_leaves_pytorch(tmp_path, monkeypatch):
    from engine.model import plan

    gen = torch.Generator().manual_seed(7)
    monkeypatch.setenv(native_build.ENV_DIR, str(tmp_path))
    native_linear.reset()
    try:
        settings = plan.read_settings({"RADIX_NATIVE_LINEAR": "0"})
        m = model(gen, (64, 64))
        linear, rejected = plan.choose("linear", settings, plan.linear_check(m, settings))
        assert linear == "torch" and ("linear", "native", "RADIX_NATIVE_LINEAR=0") in rejected
        assert settings.refusal("layers", "fused") == settings.refusal("layers", "exact") == "RADIX_NATIVE_LINEAR=0"
        assert not list(tmp_path.iterdir())  # never built: the plan did not ask
    finally:
        native_linear.reset()


@pytest.mark.skipif(not BUILDS, reason="the kernel does not build here")
def test_the_runner_uses_it_in_float32_and_its_answers_equal_pytorchs(tokenizer, monkeypatch):
    """The tiny Llama with and without our linears: the same greedy tokens, logits within 1e-4;
    the engine info says which linears run, and the second tier's fingerprint tells them apart."""
    from engine.tier_setup import tier_fingerprint
    from tests.conftest import make_tiny_runner

    ours = make_tiny_runner(tokenizer)
    monkeypatch.setenv("RADIX_NATIVE_LINEAR", "0")  # an alias of RADIX_KERNELS=native=off,fused=off,exact=off
    native_linear.reset()
    try:
        theirs = make_tiny_runner(tokenizer)
    finally:
        native_linear.reset()
    assert ours.native_linears > 0 and theirs.native_linears == 0
    assert ("ours at any number of rows" if ours.runs_exact else "ours up to 128 rows") in ours.linear_kernels
    assert "ours" not in theirs.linear_kernels
    assert tier_fingerprint(ours, None) != tier_fingerprint(theirs, None)
    ids = list(range(20, 40))  # 20 rows: ours
    a, b = ours.forward_last(ids, ours.new_request_kv(64)), theirs.forward_last(ids, theirs.new_request_kv(64))
    assert (a - b).abs().max() < 1e-4
