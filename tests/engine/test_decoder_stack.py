"""The decoder stack (``engine.model.decoder_stack``) computes bit for bit what transformers' forward
computes over the pool, on real tensors; models it does not know keep transformers' forward. (Its
fused decode layers, which differ in the last bits, are off here: ``test_fused_decode``.)"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from engine.kvcache.kv_pool import KVPool
from engine.model.decoder_stack import DecoderStack
from engine.model.paged_attention import PagedSegment
from tests.conftest import make_tiny_runner

ENV_SWITCH = "RADIX_DECODER_STACK"  # an alias of RADIX_KERNELS=stack=off (engine.model.plan)


def _pools(runner, tokens: int) -> tuple[KVPool, KVPool]:
    def make() -> KVPool:
        pool = KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype, runner.device,
                      tokens * runner.kv_bytes_per_token)
        for t in pool.k + pool.v:
            t.zero_()  # slots never written compare equal
        return pool
    return make(), make()


def _paged(runner, pool, segments, every_position=False, stack=None) -> torch.Tensor:
    """``forward_paged``'s body through transformers (``stack=None``) or the stack, as the runner runs it."""
    return runner.compute.call(torch.inference_mode()(runner._paged), pool, segments, every_position, stack)


def _random_steps(seed: int, vocab: int, pool: KVPool):
    """Steps of a random schedule: a shared prefix, then rows that decode or prefill chunks over
    it or over private prompts, joining at different times (slots from ``pool``)."""
    rng = random.Random(seed)
    prefix = pool.alloc(rng.randint(16, 40))
    shared_ids = [rng.randrange(10, vocab) for _ in prefix]
    steps = [[PagedSegment(shared_ids, 0, prefix)]]
    rows = []  # (slots, past)
    for _ in range(rng.randint(2, 5)):
        own = rng.randint(1, 12)
        base = prefix if rng.random() < 0.7 else []
        rows.append([base + pool.alloc(own + 8), len(base), own])
    for _ in range(4):
        step = []
        for row in rows:
            slots, past, todo = row
            n = todo if todo > 1 and rng.random() < 0.5 else 1
            if past + n > len(slots):
                continue
            step.append(PagedSegment([rng.randrange(10, vocab) for _ in range(n)], past, slots))
            row[1], row[2] = past + n, max(1, todo - n)
        if step:
            steps.append(step)
    return steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_stack_equals_transformers_forward(tokenizer, tiny_runner, tiny_runner_bf16, dtype, seed, monkeypatch):
    runner = tiny_runner if dtype == torch.float32 else tiny_runner_bf16
    assert runner.stack is not None  # a Llama: the runner took the stack
    monkeypatch.setattr(runner.stack, "fused", None)
    plain_pool, stack_pool = _pools(runner, 400)
    steps = _random_steps(seed, len(tokenizer), plain_pool)
    _random_steps(seed, len(tokenizer), stack_pool)  # the same slots in the twin pool
    for segments in steps:
        plain = _paged(runner, plain_pool, segments)
        direct = _paged(runner, stack_pool, segments, stack=runner.stack)
        assert torch.equal(plain, direct)
    for a, b in zip(plain_pool.k + plain_pool.v, stack_pool.k + stack_pool.v, strict=True):
        assert torch.equal(a, b)  # the same KV in the same slots


def test_every_position_and_engine_path_use_the_stack(tiny_runner, monkeypatch):
    monkeypatch.setattr(tiny_runner, "plan", dataclasses.replace(tiny_runner.plan, layers="stack"))
    plain_pool, stack_pool = _pools(tiny_runner, 64)
    seg = [PagedSegment(list(range(20, 45)), 0, plain_pool.alloc(25))]
    stack_pool.alloc(25)
    plain = _paged(tiny_runner, plain_pool, seg, every_position=True)
    assert torch.equal(tiny_runner.forward_paged(stack_pool, seg, every_position=True), plain)
    assert plain.shape[0] == 25


def _qwen_like(tokenizer, q_norm: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    kw = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    if q_norm:
        return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **kw)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**kw)).eval()


def test_qwen2_with_projection_biases_takes_the_stack_qwen3_only_the_exact_forward(tokenizer):
    assert DecoderStack.build(_qwen_like(tokenizer, q_norm=False)).plain
    qwen3 = DecoderStack.build(_qwen_like(tokenizer, q_norm=True))  # per-head norms: another layer
    assert not qwen3.plain and qwen3.parts.recipe.qk_norm == "head"


def test_switched_off_or_differing_keeps_transformers_forward(tokenizer, monkeypatch):
    monkeypatch.setenv(ENV_SWITCH, "0")
    runner = make_tiny_runner(tokenizer)
    try:
        assert runner.stack is None
    finally:
        runner.close()
    monkeypatch.delenv(ENV_SWITCH)
    real = DecoderStack.forward
    monkeypatch.setattr(DecoderStack, "forward", lambda self, *a: real(self, *a) * (1 + 1e-6))
    runner = make_tiny_runner(tokenizer)
    try:
        assert runner.stack is None  # the probe saw a difference in the last bits
        assert runner.forward_paged(_pools(runner, 8)[0], [PagedSegment([3, 4], 0, [0, 1])]).shape[0] == 1
    finally:
        runner.close()
