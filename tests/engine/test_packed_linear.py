"""oneDNN-packed linears compute what ``nn.Linear`` computes, and packing can be undone or turned off."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from engine.model import packed_linear, plan
from engine.model.packed_linear import PackedLinear, unpack_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")

# These tests pack float32 layers, as ``RADIX_KERNELS=linear=packed`` does (the default packs bf16 only).
BOTH = plan.packed_dtypes(plan.read_settings({"RADIX_KERNELS": "linear=packed"}))


def can_pack(model, dtypes=BOTH):
    return packed_linear.can_pack(model, dtypes)


def pack_linears(model, dtypes=BOTH):
    return packed_linear.pack_linears(model, dtypes)


def _mlp(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 48), nn.ReLU(), nn.Linear(48, 16, bias=False)).to(dtype)


@pytest.mark.parametrize("rows", [1, 3, 8, 130])
def test_packed_equals_plain(rows):
    plain = _mlp()
    packed = copy.deepcopy(plain)
    assert pack_linears(packed) == 2
    assert all(isinstance(m, PackedLinear) for m in (packed[0], packed[2]))
    x = torch.randn(1, rows, 24)
    with torch.inference_mode():
        assert torch.allclose(packed(x), plain(x), atol=1e-5, rtol=1e-5)


def test_weights_stay_shared_and_unpack_restores_linear():
    model = _mlp()
    weight = model[0].weight
    pack_linears(model)
    assert model[0].weight is weight  # state_dict and tied embeddings still see the parameter
    assert set(model.state_dict()) == set(_mlp().state_dict())
    assert unpack_linears(model) == 2
    assert type(model[0]) is nn.Linear and model[0].weight is weight


def test_deepcopy_repacks_and_keeps_ties():
    emb = nn.Embedding(10, 8)
    head = nn.Linear(8, 10, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    pack_linears(model)
    twin = copy.deepcopy(model)
    assert twin["head"].weight is twin["emb"].weight and twin["head"].weight is not emb.weight
    x = torch.randn(2, 8)
    with torch.inference_mode():
        assert torch.allclose(twin["head"](x), model["head"](x))


def test_not_packed_in_fp16_or_when_switched_off():
    assert not can_pack(_mlp(torch.float16)) and pack_linears(_mlp(torch.float16)) == 0
    settings = plan.read_settings({"RADIX_PACKED_LINEAR": "0"})
    assert plan.choose("linear", settings, plan.linear_check(_mlp(), settings))[1][0] == \
        ("linear", "packed", "RADIX_PACKED_LINEAR=0")


def test_gradients_fall_back_to_plain_linear():
    model = _mlp()
    pack_linears(model)
    x = torch.randn(2, 24, requires_grad=True)
    model(x).sum().backward()
    assert x.grad is not None


def test_float32_is_not_packed_by_default_bf16_is(monkeypatch, tiny_runner):
    """Measured: MKL's plain float32 product is as fast as the packed one at any batch size and
    faster for one row, so by default only bfloat16 layers are packed (where the CPU has bf16)."""
    from engine.model.packed_linear import _packing_works

    default = plan.packed_dtypes(plan.read_settings({}))
    assert default == (torch.bfloat16,) and plan.packed_dtypes(plan.read_settings({"RADIX_PACKED_LINEAR": "1"})) == BOTH
    assert not can_pack(_mlp(), default) and pack_linears(_mlp(), default) == 0
    assert packed_linear.refusal(_mlp(), default)  # a reason ("not packed unless named" on x86)
    assert tiny_runner.packed_linears == 0 and not isinstance(tiny_runner.model.lm_head, PackedLinear)
    assert tiny_runner.plan.linear != "packed"
    assert can_pack(_mlp(torch.bfloat16), default) == _packing_works(torch.bfloat16)
    assert plan.read_settings({"RADIX_PACKED_LINEAR": "0"}).refusal("linear", "packed") == "RADIX_PACKED_LINEAR=0"


def test_not_packed_where_a_packed_product_fails(monkeypatch):
    import engine.model.packed_linear as pl

    monkeypatch.setattr(pl, "_packing_works", lambda dtype=torch.float32: False)
    assert pack_linears(_mlp()) == 0


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no native bf16 on this CPU")
def test_bf16_is_packed_where_the_cpu_has_native_bf16():
    """bf16 linears are packed too (plain bf16 ``F.linear`` reorders the weight on every call):
    the packed product matches the plain one to bf16 rounding, and a row's output does not depend
    on how many rows share the call."""
    model = _mlp(torch.bfloat16)
    x = torch.randn(5, 24).to(torch.bfloat16)
    with torch.no_grad():
        plain = model(x).float()
        assert pack_linears(model) > 0
        packed = model(x).float()
        one = torch.cat([model(x[i:i + 1]) for i in range(5)]).float()
    assert torch.allclose(plain, packed, atol=3e-2, rtol=3e-2)
    assert torch.equal(one, packed)
