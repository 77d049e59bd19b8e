"""The fused decode layers (``engine.model.fused_decode``) on real tensors: the logits and the KV of the
unfused stack within float32 rounding, batched rows equal to lone ones bit for bit, the runner
dropping them when they differ, and where they do not apply."""

from __future__ import annotations

import random

import pytest
import torch

from engine.kvcache.kv_pool import KVPool
from engine.kvcache.tier_identity import fingerprint
from engine.model import fused_decode
from engine.model.decoder_stack import DecoderStack
from engine.model.fused_decode import ENV_SWITCH, FusedLayers
from engine.model.native_linear import kernel
from engine.model.paged_attention import PagedSegment
from tests.conftest import make_tiny_runner

pytestmark = pytest.mark.skipif(kernel() is None, reason="our C kernels do not build here")


def _pool(runner, tokens: int) -> KVPool:
    pool = KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype, runner.device,
                  tokens * runner.kv_bytes_per_token)
    for t in pool.k + pool.v:
        t.zero_()
    return pool


def _run(runner, pool, segments, fused: bool) -> torch.Tensor:
    stack = runner.stack
    keep, stack.fused = stack.fused, stack.fused if fused else None
    try:
        return runner.compute.call(torch.inference_mode()(runner._paged), pool, segments, False, stack)
    finally:
        stack.fused = keep


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max()) <= 1e-4 * max(1.0, float(b.abs().max()))


@pytest.mark.parametrize("seed", range(4))
def test_fused_steps_give_the_unfused_logits_and_kv(tokenizer, tiny_runner, seed):
    assert tiny_runner.stack.fused is not None  # a float32 Llama on a CPU with the kernel
    rng = random.Random(seed)
    vocab = len(tokenizer)
    pools = _pool(tiny_runner, 200), _pool(tiny_runner, 200)
    prefix = [p.alloc(30) for p in pools][0]
    rows = [prefix + [p.alloc(20) for p in pools][0] for _ in range(3)]
    shared = [rng.randrange(10, vocab) for _ in range(30)]
    for pool in pools:
        _run(tiny_runner, pool, [PagedSegment(shared, 0, prefix)], fused=False)  # the same prefix KV in both
    past = [30] * 3
    for _ in range(5):
        n = [rng.choice((1, 1, 3)) for _ in rows]
        segments = [PagedSegment([rng.randrange(10, vocab) for _ in range(k)], p, s)
                    for k, p, s in zip(n, past, rows, strict=True)]
        plain = _run(tiny_runner, pools[0], segments, fused=False)
        got = _run(tiny_runner, pools[1], segments, fused=True)
        assert _close(got, plain)
        past = [p + k for p, k in zip(past, n, strict=True)]
    for a, b in zip(pools[0].k + pools[0].v, pools[1].k + pools[1].v, strict=True):
        assert _close(b, a)  # the new tokens' KV written to the same slots, rotated the same way


def test_batched_fused_rows_equal_lone_ones_bit_for_bit(tokenizer, tiny_runner):
    """Rows with prompts of their own (a prefix shared by the batch is read once for all and merged
    by log-sum-exp, which moves the last bits against a lone read of it with or without fusion;
    ``test_batching_exact`` checks the answers there)."""
    vocab = len(tokenizer)
    rng = random.Random(7)
    pool = _pool(tiny_runner, 400)
    rows = []
    for _ in range(9):
        prompt = pool.alloc(24)
        _run(tiny_runner, pool, [PagedSegment([rng.randrange(10, vocab) for _ in prompt], 0, prompt)], fused=True)
        rows.append(prompt + pool.alloc(4))
    ids = [[rng.randrange(10, vocab)] for _ in rows]
    together = _run(tiny_runner, pool, [PagedSegment(i, 24, s) for i, s in zip(ids, rows, strict=True)], fused=True)
    for r, (i, s) in enumerate(zip(ids, rows, strict=True)):
        alone = _run(tiny_runner, pool, [PagedSegment(i, 24, s)], fused=True)
        assert torch.equal(alone[0], together[r])


def test_a_step_of_more_rows_than_the_kernel_takes_runs_unfused(tokenizer, tiny_runner, monkeypatch):
    calls = []
    real = FusedLayers.pre
    monkeypatch.setattr(FusedLayers, "pre", lambda self, *a: calls.append(a[1].shape[0]) or real(self, *a))
    pool = _pool(tiny_runner, 100)
    _run(tiny_runner, pool, [PagedSegment(list(range(10, 10 + fused_decode.MAX_ROWS + 1)), 0, pool.alloc(33))],
         fused=True)
    assert calls == []
    _run(tiny_runner, pool, [PagedSegment([5, 6], 0, pool.alloc(2))], fused=True)
    assert calls == [2] * tiny_runner.num_layers


def test_switched_off_bf16_and_other_layers_run_unfused(tokenizer, tiny_runner_bf16, monkeypatch):
    assert tiny_runner_bf16.stack.fused is None  # float32 only
    monkeypatch.setenv(ENV_SWITCH, "0")
    runner = make_tiny_runner(tokenizer)
    try:
        assert runner.stack is not None and runner.stack.fused is None
    finally:
        runner.close()
    monkeypatch.delenv(ENV_SWITCH)
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, hidden_act="gelu")).eval()
    assert DecoderStack.build(model) is not None and DecoderStack.build(model).fused is None  # not SiLU


def test_a_fused_forward_that_differs_is_dropped_at_start(tokenizer, monkeypatch):
    real = FusedLayers.post

    def off(self, index, h, a):
        real(self, index, h, a)
        h.mul_(1.01)

    monkeypatch.setattr(FusedLayers, "post", off)
    runner = make_tiny_runner(tokenizer)
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


@pytest.mark.slow
def test_real_model_fused_steps_match_unfused(real_runner):
    if real_runner.stack is None or real_runner.stack.fused is None:
        pytest.skip("the embedded model runs unfused here (not float32, or no kernel)")
    ids = real_runner.text.encode("The three rules of packing a tent are")
    pools = _pool(real_runner, 64), _pool(real_runner, 64)
    slots = [p.alloc(len(ids) + 12) for p in pools][0]
    for pool in pools:
        _run(real_runner, pool, [PagedSegment(ids, 0, slots)], fused=False)
    past, token = len(ids), ids[-1]
    for _ in range(12):  # teacher-forced: both read the same tokens
        plain = _run(real_runner, pools[0], [PagedSegment([token], past, slots)], fused=False)
        got = _run(real_runner, pools[1], [PagedSegment([token], past, slots)], fused=True)
        assert _close(got, plain) and int(got.argmax()) == int(plain.argmax())
        past, token = past + 1, int(plain.argmax())


def test_a_restart_without_fusion_never_reads_the_tier_the_fused_run_wrote(tokenizer, tiny_runner, tmp_path,
                                                                          monkeypatch):
    """The second run, with another forward: KV a fused run wrote to the second tier differs in its last
    bits from what an unfused run computes, so the unfused run reads none of it (a folder of its own;
    the start removes the other configuration's, as it does for any tier it can never read); a
    third run, fused again, starts empty and consistent."""
    from engine.engine import Engine
    from engine.types import GenerationRequest, SamplingParams

    def req(ids):
        return GenerationRequest(prompt_ids=tuple(ids), sampling=SamplingParams(max_new_tokens=3))

    doc = [10 + (i * 7919) % (len(tokenizer) - 10) for i in range(300)]
    kw = dict(budget_bytes=1000 * tiny_runner.kv_bytes_per_token, tier_bytes=2**24, tier_dir=str(tmp_path))
    first = Engine(tiny_runner, **kw)
    first.run(req(doc))
    first.close()
    assert first.tier.num_chunks >= 1
    monkeypatch.setenv(ENV_SWITCH, "0")
    unfused = make_tiny_runner(tokenizer)
    try:
        assert unfused.stack.fused is None
        second = Engine(unfused, **kw)
        assert second.tier.folder != first.tier.folder
        assert second.stats().tier_chunks == 0 and second.run(req(doc + [9])).tier_tokens == 0
        second.close()
        second.check_invariants()
    finally:
        unfused.close()
    third = Engine(tiny_runner, **kw)
    assert third.tier.folder == first.tier.folder
    assert third.run(req(doc + [9])).tier_tokens == 0
    third.check_invariants()
    third.close()


def test_wrong_shapes_are_refused_before_the_kernel_runs(tiny_runner):
    fused, pool, h, cs = _inputs(tiny_runner, 2)
    with pytest.raises(ValueError, match="one int64 pool slot per row"):
        fused.pre(0, h, cs, cs, pool.k[0], pool.v[0], torch.tensor([0]))  # two rows, one slot
    with pytest.raises(ValueError, match="contiguous float32"):
        fused.pre(0, h, cs, cs, pool.k[0].transpose(1, 2), pool.v[0], torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="contiguous float32 rows"):
        fused.post(0, h, torch.randn(1, fused.q_width))  # one row of attention for two rows


@pytest.mark.parametrize("streams", [1, 3])
def test_one_c_call_for_every_layer_equals_the_calls_per_layer_bit_for_bit(tokenizer, tiny_runner, monkeypatch,
                                                                            streams):
    """Decode rows that share no prefix run every layer in one C call (attention called from C);
    the same rows through the per-layer calls give the same logits and KV, bit for bit."""
    from engine.model.paged_attention import PagedPlan

    vocab = len(tokenizer)
    rng = random.Random(11 + streams)
    pools = _pool(tiny_runner, 300), _pool(tiny_runner, 300)
    rows = []
    for _ in range(streams):
        prompt = [p.alloc(20 + 7 * len(rows)) for p in pools][0]
        ids = [rng.randrange(10, vocab) for _ in prompt]
        for pool in pools:
            _run(tiny_runner, pool, [PagedSegment(ids, 0, prompt)], fused=True)
        rows.append(prompt + [p.alloc(6) for p in pools][0])
    used = []
    real_all = FusedLayers.run_all
    monkeypatch.setattr(FusedLayers, "run_all", lambda self, *a: used.append(a[0].shape[0]) or real_all(self, *a))
    real_call = PagedPlan.rows_call
    for step in range(6):
        segments = [PagedSegment([rng.randrange(10, vocab)], len(s) - 6 + step, s) for s in rows]
        monkeypatch.setattr(PagedPlan, "rows_call", lambda self, *a: None)
        per_layer = _run(tiny_runner, pools[0], segments, fused=True)
        monkeypatch.setattr(PagedPlan, "rows_call", real_call)
        one_call = _run(tiny_runner, pools[1], segments, fused=True)
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
