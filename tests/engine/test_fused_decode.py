"""The fused decode layers (``engine.model.fused_decode``) on real tensors, in float32 and bfloat16: the
logits and the KV of the unfused stack within rounding (in bf16 each layer's outputs equal the unfused
layer's bf16 values but for a rare last-bit flip), batched rows equal to lone ones bit for bit, the
runner dropping them when they differ, and where they do not apply."""

from __future__ import annotations

import random

import pytest
import torch

from engine.kvcache.kv_pool import KVPool
from engine.kvcache.tier_identity import fingerprint
from engine.model import fused_decode
from engine.model.decoder_stack import DecoderStack
from engine.model.fused_decode import FusedLayers
from engine.model.native_linear import kernel
from engine.model.paged_attention import PagedSegment
from tests.conftest import make_tiny_runner

pytestmark = pytest.mark.skipif(kernel() is None, reason="our C kernels do not build here")

ENV_SWITCH = "RADIX_FUSED_DECODE"  # an alias of RADIX_KERNELS=fused=off (engine.model.plan)


def _pool(runner, tokens: int) -> KVPool:
    pool = KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype, runner.device,
                  tokens * runner.kv_bytes_per_token)
    for t in pool.k + pool.v:
        t.zero_()
    return pool


def _run(runner, pool, segments, fused: bool) -> torch.Tensor:
    """A step through the runner's stack, its fused layers or not (the plan's row cap applied, as
    ``forward_paged`` applies it: ``ExecutionPlan.driver_for``)."""
    rows = sum(len(s.ids) for s in segments)
    fused = fused and rows <= runner.stack.fused.max_rows
    return runner.compute.call(torch.inference_mode()(runner._paged), pool, segments, False, runner.stack, fused)


TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # of the largest value (bf16: a flip carried on)


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """Within the tolerance of the model's ``dtype`` (logits come back in float32 either way)."""
    tol = TOLERANCE[dtype]
    return float((a.float() - b.float()).abs().max()) <= tol * max(1.0, float(b.float().abs().max()))


@pytest.fixture(params=["float32", "bfloat16"])
def runner(request):
    return request.getfixturevalue("tiny_runner" if request.param == "float32" else "tiny_runner_bf16")


@pytest.mark.parametrize("seed", range(4))
def test_fused_steps_give_the_unfused_logits_and_kv(tokenizer, runner, seed):
    assert runner.stack.fused is not None  # a Llama on a CPU with the kernel, in either dtype
    rng = random.Random(seed)
    vocab = len(tokenizer)
    bf16 = runner.dtype == torch.bfloat16
    pools = _pool(runner, 200), _pool(runner, 200)
    prefix = [p.alloc(30) for p in pools][0]
    rows = [prefix + [p.alloc(20) for p in pools][0] for _ in range(2 if bf16 else 3)]
    shared = [rng.randrange(10, vocab) for _ in range(30)]
    for pool in pools:
        _run(runner, pool, [PagedSegment(shared, 0, prefix)], fused=False)  # the same prefix KV in both
    past = [30] * len(rows)
    fused_rows = []
    real_pre = FusedLayers.pre
    for _ in range(5):
        n = [rng.choice((1, 1, 2 if bf16 else 3)) for _ in rows]
        segments = [PagedSegment([rng.randrange(10, vocab) for _ in range(k)], p, s)
                    for k, p, s in zip(n, past, rows, strict=True)]
        plain = _run(runner, pools[0], segments, fused=False)
        FusedLayers.pre = lambda self, *a: fused_rows.append(a[1].shape[0]) or real_pre(self, *a)
        try:
            got = _run(runner, pools[1], segments, fused=True)
        finally:
            FusedLayers.pre = real_pre
        assert _close(got, plain, runner.dtype)
        past = [p + k for p, k in zip(past, n, strict=True)]
    assert fused_rows and max(fused_rows) <= runner.stack.fused.max_rows  # the steps did run fused
    for a, b in zip(pools[0].k + pools[0].v, pools[1].k + pools[1].v, strict=True):
        assert _close(b, a, runner.dtype)  # the new tokens' KV written to the same slots, rotated the same way


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart each pair of bf16 values is (same sign assumed where both nonzero)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return (ia - ib).abs()


@pytest.mark.parametrize("rows", [1, 3])
def test_bf16_layers_store_what_the_unfused_bf16_layer_stores(tokenizer, tiny_runner_bf16, rows):
    """Each bf16 layer of the fused step against the unfused stack's ops on the same input, value by
    value: q, the KV written, and h after the layer are the bf16 values PyTorch's bf16 forward stores
    (the C code rounds where it does), but for a value whose float32 sum, in another order, lands
    on the other side of a rounding boundary: one bf16 step off, and rarely."""
    runner = tiny_runner_bf16
    stack, fused = runner.stack, runner.stack.fused
    torch.manual_seed(rows)
    hidden, d = runner.model.config.hidden_size, runner.head_dim
    equal = total = 0
    with torch.inference_mode():
        for i, layer in enumerate(stack.layers):
            h = (torch.randn(1, rows, hidden) * 3).to(torch.bfloat16)
            cos, sin = stack.rotary(h, torch.randint(0, 400, (1, rows)))
            half = d // 2
            c4, s4 = cos.unsqueeze(1), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(1)
            x = layer.norm1(h)
            view = (1, rows, -1, d)
            q, k, v = (f(x).view(view).transpose(1, 2) for f in (layer.q, layer.k, layer.v))
            q, k = q * c4 + q.roll(half, -1) * s4, k * c4 + k.roll(half, -1) * s4
            pool = _pool(runner, 8)
            slots = torch.arange(rows) + 2
            got_q = fused.pre(i, h[0].float().contiguous(), cos[0].float().contiguous(), sin[0].float().contiguous(),
                              pool.k[0], pool.v[0], slots).to(torch.bfloat16)
            a = torch.randn(1, rows, fused.q_width).to(torch.bfloat16)
            want = h + layer.o(a)
            x2 = layer.norm2(want)
            want = want + layer.down(layer.act(layer.gate(x2)) * layer.up(x2))
            got_h = h[0].float().contiguous()
            fused.post(i, got_h, a[0].float().contiguous())
            pairs = [(got_q, q[0].transpose(0, 1).reshape(rows, -1)), (pool.k[0][:, slots], k[0]),
                     (pool.v[0][:, slots], v[0]), (got_h.to(torch.bfloat16), want[0])]
            for got, ref in pairs:
                assert int(_ulps_apart(got.contiguous(), ref.contiguous()).max()) <= 1
                equal += int((got == ref).sum())
                total += got.numel()
    assert equal / total >= 0.99


def test_batched_fused_rows_equal_lone_ones_bit_for_bit(tokenizer, runner):
    """Rows with prompts of their own (a prefix shared by the batch is read once for all and merged
    by log-sum-exp, which moves the last bits against a lone read of it with or without fusion;
    ``test_batching_exact`` checks the answers there)."""
    vocab = len(tokenizer)
    rng = random.Random(7)
    pool = _pool(runner, 400)
    rows = []
    for _ in range(min(9, runner.stack.fused.max_rows)):
        prompt = pool.alloc(24)
        _run(runner, pool, [PagedSegment([rng.randrange(10, vocab) for _ in prompt], 0, prompt)], fused=True)
        rows.append(prompt + pool.alloc(4))
    ids = [[rng.randrange(10, vocab)] for _ in rows]
    together = _run(runner, pool, [PagedSegment(i, 24, s) for i, s in zip(ids, rows, strict=True)], fused=True)
    for r, (i, s) in enumerate(zip(ids, rows, strict=True)):
        alone = _run(runner, pool, [PagedSegment(i, 24, s)], fused=True)
        assert torch.equal(alone[0], together[r])


def test_a_step_of_more_rows_than_the_kernel_takes_runs_unfused(tokenizer, runner, monkeypatch):
    calls = []
    real = FusedLayers.pre
    monkeypatch.setattr(FusedLayers, "pre", lambda self, *a: calls.append(a[1].shape[0]) or real(self, *a))
    pool = _pool(runner, 100)
    most = runner.stack.fused.max_rows
    assert most == (fused_decode.MAX_ROWS if runner.dtype == torch.float32 else fused_decode.BF16_MAX_ROWS)
    _run(runner, pool, [PagedSegment(list(range(10, 10 + most + 1)), 0, pool.alloc(most + 1))], fused=True)
    assert calls == []
    _run(runner, pool, [PagedSegment([5, 6], 0, pool.alloc(2))], fused=True)
    assert calls == [2] * runner.num_layers


def test_switched_off_and_other_layers_run_unfused(tokenizer, monkeypatch):
    monkeypatch.setenv(ENV_SWITCH, "0")
    for dtype in (torch.float32, torch.bfloat16):
        runner = make_tiny_runner(tokenizer, dtype=dtype)
        try:
            assert runner.stack is not None and runner.stack.fused is None
        finally:
            runner.close()
    monkeypatch.delenv(ENV_SWITCH)
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, hidden_act="gelu")).eval()
    why = DecoderStack.build(model)  # not SiLU: outside Llama's recipe (engine.model.families), and says so
    assert isinstance(why, str) and "activation is 'gelu'" in why


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_forward_that_differs_is_dropped_at_start(tokenizer, monkeypatch, dtype):
    real, real_all = FusedLayers.post, FusedLayers.run_all

    factor = 1.01 if dtype == torch.float32 else 1.3  # half of each layer's output a little off (bf16: beyond its noise)

    def skew(h):
        h[:, : h.shape[1] // 2].mul_(factor)

    def off(self, index, h, a):
        real(self, index, h, a)
        skew(h)

    monkeypatch.setattr(FusedLayers, "post", off)
    monkeypatch.setattr(FusedLayers, "run_all", lambda self, h, *a: (real_all(self, h, *a), skew(h)))
    runner = make_tiny_runner(tokenizer, dtype=dtype)
    try:
        assert runner.stack is not None and runner.stack.fused is None
    finally:
        runner.close()


def test_qwen2_projection_biases_are_fused_too(tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from engine.model.loader import LoadedModel
    from engine.model.runner import ModelRunner

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512)).eval()
    for layer in model.model.layers:  # nonzero biases, so that a dropped one would show
        for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            torch.nn.init.normal_(m.bias, std=0.5)
    runner = ModelRunner(LoadedModel(model=model, tokenizer=tokenizer, name="tiny-qwen2", device=torch.device("cpu"),
                                     dtype=torch.float32))
    try:
        assert runner.stack is not None and runner.stack.fused is not None
        pools = _pool(runner, 64), _pool(runner, 64)
        slots = [p.alloc(12) for p in pools][0]
        for pool in pools:
            _run(runner, pool, [PagedSegment(list(range(20, 30)), 0, slots)], fused=False)
        plain = _run(runner, pools[0], [PagedSegment([44], 10, slots)], fused=False)
        assert _close(_run(runner, pools[1], [PagedSegment([44], 10, slots)], fused=True), plain)
    finally:
        runner.close()


def _inputs(runner, rows: int):
    """The fused layers, a small pool, ``rows`` hidden rows and rotary tables of ones."""
    return (runner.stack.fused, _pool(runner, 8), torch.randn(rows, runner.model.config.hidden_size),
            torch.ones(rows, runner.head_dim))


def test_the_kernel_refuses_a_slot_outside_the_pool(tiny_runner):
    fused, pool, h, cs = _inputs(tiny_runner, 1)
    before = [t.clone() for t in pool.k]
    with pytest.raises(ValueError, match="refused"):
        fused.pre(0, h, cs, cs, pool.k[0], pool.v[0], torch.tensor([pool.capacity]))
    assert all(torch.equal(a, b) for a, b in zip(before, pool.k, strict=True))  # nothing written


def test_the_tier_fingerprint_names_the_fused_forward(tokenizer):
    args = ("m", torch.float32, tokenizer, 2, 2, 16)
    assert fingerprint(*args, native_linear=True) != fingerprint(*args, native_linear=True, fused_decode=True)
    assert fingerprint(*args) == fingerprint(*args, fused_decode=False)  # the names tiers had before


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def real_model(request, real_runner):
    if request.param == "float32":
        yield real_runner
        return
    from engine.model.loader import load_model
    from engine.model.runner import ModelRunner

    runner = ModelRunner(load_model("embedded", "cpu", "bfloat16"))
    yield runner
    runner.close()


def _teacher_forced(runner, ids, tokens: list[int], fused: bool, steps: int = 12) -> list[torch.Tensor]:
    """The last row's logits of each of ``steps`` decode steps after ``ids``, reading ``tokens``
    one by one; where ``tokens`` runs out, the step's own greedy pick (appended to ``tokens``)."""
    pool = _pool(runner, 64)
    slots = pool.alloc(len(ids) + steps + 1)
    _run(runner, pool, [PagedSegment(ids, 0, slots)], fused=False)
    out, past, token = [], len(ids), ids[-1]
    for i in range(steps):
        out.append(_run(runner, pool, [PagedSegment([token], past, slots)], fused=fused)[-1].float())
        if i == len(tokens):
            tokens.append(int(out[-1].argmax()))
        past, token = past + 1, tokens[i]
    return out


@pytest.mark.slow
def test_real_model_fused_steps_match_unfused(real_model, real_runner):
    """The embedded model, teacher-forced on the float32 model's greedy tokens. float32: each fused
    step's logits within 1e-4 of the unfused step's, and its pick a top token of them. bfloat16: the
    fused steps are no further from the float32 model than PyTorch's own bf16 steps are (both round
    differently, and where PyTorch's bf16 products run on other kernels, as oneDNN's AMX tiles, the
    two bf16 paths are about as far from each other as each is from float32), and each pick is a
    top token of the float32 logits within bf16's tolerance."""
    runner = real_model
    if runner.stack is None or runner.stack.fused is None:
        pytest.skip("the embedded model runs unfused here (no kernel)")
    ids = runner.text.encode("The three rules of packing a tent are")
    tokens: list[int] = []
    truth = _teacher_forced(real_runner, ids, tokens, fused=False)  # float32, unfused, greedy: the reference
    plain = _teacher_forced(runner, ids, tokens, fused=False)
    got = _teacher_forced(runner, ids, tokens, fused=True)
    tol = TOLERANCE[runner.dtype]
    if runner.dtype == torch.float32:
        assert all(_close(g, p) for g, p in zip(got, plain, strict=True))
    else:
        err_plain = max(float((p - t).abs().max()) for p, t in zip(plain, truth, strict=True))
        err_fused = max(float((g - t).abs().max()) for g, t in zip(got, truth, strict=True))
        assert err_fused <= 1.5 * err_plain, (err_fused, err_plain)
    for g, t in zip(got, truth, strict=True):
        top = float(t.max())
        assert float(t[int(g.argmax())]) >= top - tol * max(1.0, abs(top))


def test_a_restart_without_fusion_never_reads_the_tier_the_fused_run_wrote(tokenizer, runner, tmp_path, monkeypatch,
                                                                           make_engine):
    """The second run, with another forward: KV a fused run wrote to the second tier differs in its last
    bits from what an unfused run computes, so the unfused run reads none of it (a folder of its own;
    the start removes the other configuration's, as it does for any tier it can never read); a
    third run, fused again, starts empty and consistent."""
    from engine.types import GenerationRequest, SamplingParams

    def req(ids):
        return GenerationRequest(prompt_ids=tuple(ids), sampling=SamplingParams(max_new_tokens=3))

    doc = [10 + (i * 7919) % (len(tokenizer) - 10) for i in range(300)]
    kw = dict(budget_bytes=1000 * runner.kv_bytes_per_token, tier_bytes=2**24, tier_dir=str(tmp_path))
    first = make_engine(runner, **kw)
    first.run(req(doc))
    first.close()
    assert first.tier.num_chunks >= 1
    monkeypatch.setenv(ENV_SWITCH, "0")
    unfused = make_tiny_runner(tokenizer, dtype=runner.dtype)
    try:
        assert unfused.stack.fused is None
        second = make_engine(unfused, **kw)
        assert second.tier.folder != first.tier.folder
        assert second.stats().tier_chunks == 0 and second.run(req(doc + [9])).tier_tokens == 0
        second.close()
        second.check_invariants()
    finally:
        unfused.close()
    third = make_engine(runner, **kw)
    assert third.tier.folder == first.tier.folder
    assert third.run(req(doc + [9])).tier_tokens == 0
    third.check_invariants()


def test_wrong_shapes_are_refused_before_the_kernel_runs(tiny_runner):
    fused, pool, h, cs = _inputs(tiny_runner, 2)
    with pytest.raises(ValueError, match="one int64 pool slot per row"):
        fused.pre(0, h, cs, cs, pool.k[0], pool.v[0], torch.tensor([0]))  # two rows, one slot
    with pytest.raises(ValueError, match="contiguous float32"):
        fused.pre(0, h, cs, cs, pool.k[0].transpose(1, 2), pool.v[0], torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="contiguous float32 rows"):
        fused.post(0, h, torch.randn(1, fused.q_width))  # one row of attention for two rows


@pytest.mark.parametrize("streams", [1, 3])
def test_one_c_call_for_every_layer_equals_the_calls_per_layer_bit_for_bit(tokenizer, runner, monkeypatch,
                                                                            streams):
    """Decode rows that share no prefix run every layer in one C call (attention called from C);
    the same rows through the per-layer calls give the same logits and KV, bit for bit."""
    from engine.model.paged_attention import PagedPlan

    vocab = len(tokenizer)
    rng = random.Random(11 + streams)
    pools = _pool(runner, 300), _pool(runner, 300)
    rows = []
    for _ in range(streams):
        prompt = [p.alloc(20 + 7 * len(rows)) for p in pools][0]
        ids = [rng.randrange(10, vocab) for _ in prompt]
        for pool in pools:
            _run(runner, pool, [PagedSegment(ids, 0, prompt)], fused=True)
        rows.append(prompt + [p.alloc(6) for p in pools][0])
    used = []
    real_all = FusedLayers.run_all
    monkeypatch.setattr(FusedLayers, "run_all", lambda self, *a: used.append(a[0].shape[0]) or real_all(self, *a))
    real_call = PagedPlan.rows_call
    for step in range(6):
        segments = [PagedSegment([rng.randrange(10, vocab)], len(s) - 6 + step, s) for s in rows]
        monkeypatch.setattr(PagedPlan, "rows_call", lambda self, *a: None)
        per_layer = _run(runner, pools[0], segments, fused=True)
        monkeypatch.setattr(PagedPlan, "rows_call", real_call)
        one_call = _run(runner, pools[1], segments, fused=True)
        assert torch.equal(one_call, per_layer)
    assert used == [streams] * 6
    for a, b in zip(pools[0].k + pools[0].v, pools[1].k + pools[1].v, strict=True):
        assert torch.equal(a, b)


def test_the_one_call_refuses_pool_layers_it_does_not_take(tiny_runner):
    fused, pool, h, cs = _inputs(tiny_runner, 1)
    n = tiny_runner.num_layers
    with pytest.raises(ValueError, match="one pool layer per decoder layer"):
        fused.run_all(h, cs, cs, pool.k[:1], pool.v[:1], torch.tensor([0]), None)
    with pytest.raises(ValueError, match="of one shape"):
        fused.run_all(h, cs, cs, [pool.k[0].transpose(1, 2)] * n, pool.v, torch.tensor([0]), None)
