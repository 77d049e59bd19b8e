"""The runner and cache work for every family of the registry and one outside it (tiny random configs)."""

from __future__ import annotations

import pytest
import torch

from engine.model.loader import LoadedModel
from engine.model.runner import ModelRunner
from engine.types import GenerationRequest, SamplingParams
from tests.family_models import FAMILIES, tiny_model


def tiny(family: str, vocab: int):
    """A tiny model of ``family``: one of the registry's (``tests/family_models.py``), or GPT-2 (outside it)."""
    import transformers as tf

    if family == "gpt2":
        torch.manual_seed(0)
        cfg = tf.GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=512)
        return tf.GPT2LMHeadModel(cfg)
    return tiny_model(family, vocab)


@pytest.mark.parametrize("family", [*FAMILIES, "gpt2"])
def test_reuse_is_exact_for_family(tokenizer, family, make_engine):
    model = tiny(family, len(tokenizer)).eval()
    runner = ModelRunner(LoadedModel(model, tokenizer, f"tiny-{family}", torch.device("cpu"), torch.float32))
    engine = make_engine(runner, budget_bytes=1000 * runner.kv_bytes_per_token)
    off = make_engine(runner, enable_cache=False)
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(10, len(tokenizer), (30,), generator=gen).tolist()
    for i in range(3):
        ids = shared + torch.randint(10, len(tokenizer), (5 + i,), generator=gen).tolist()
        req = GenerationRequest(prompt_ids=tuple(ids), sampling=SamplingParams(max_new_tokens=5))
        on_m, off_m = engine.run(req), off.run(req)
        assert on_m.output_ids == off_m.output_ids
        assert on_m.cached_tokens == (0 if i == 0 else 30)
        # logits too, on the engine's own prefill path
        kv = runner.new_request_kv(len(ids))
        res = engine.prefill(engine.cache_key(ids, req), kv)
        ref, _ = runner.reference_prefill(ids)
        assert torch.allclose(res.logits, ref, atol=1e-4)
    engine.check_invariants()
