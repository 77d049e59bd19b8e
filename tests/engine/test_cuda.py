"""The same engine on CUDA in bf16: the pool, attention over it (float32 math path there) and the
scheduler, exact against the same requests with no cache. Skipped without a GPU;
``tools/gpu_check.sh`` runs these with the benches on the day a device is there."""

from __future__ import annotations

import pytest
import torch

from engine.kvcache.kv_pool import KVPool
from engine.model.paged_attention import PagedSegment
from engine.types import GenerationRequest, SamplingParams
from tests.engines import rand_ids

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")]


@pytest.fixture(scope="module")
def cuda_runner(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.model.loader import LoadedModel
    from engine.model.runner import ModelRunner

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval().to(device="cuda", dtype=torch.bfloat16)
    return ModelRunner(LoadedModel(model, tokenizer, "tiny-cuda", torch.device("cuda"), torch.bfloat16))


def test_pool_forward_matches_no_cache_on_cuda(cuda_runner):
    r = cuda_runner
    pool = KVPool(r.num_layers, r.num_kv_heads, r.head_dim, r.dtype, r.device, 500 * r.kv_bytes_per_token)
    shared = rand_ids(1, 40)
    prefix = pool.alloc(40)
    r.forward_paged(pool, [PagedSegment(shared, 0, prefix)])
    seqs = [shared + rand_ids(2 + i, 4 + i) for i in range(4)]
    tables = [prefix + pool.alloc(len(s) - 40) for s in seqs]
    logits = r.forward_paged(pool, [PagedSegment(s[40:], 40, t) for s, t in zip(seqs, tables, strict=True)])
    for row, s in zip(logits, seqs, strict=True):
        ref, _ = r.reference_prefill(s)
        assert torch.allclose(row, ref, atol=5e-2), (row - ref).abs().max()


def test_engine_answers_equal_no_cache_on_cuda(cuda_runner, make_engine):
    shared = rand_ids(9, 48)
    engine, plain = make_engine(cuda_runner, budget_bytes=64 * 2**20), make_engine(cuda_runner, enable_cache=False)
    for i in range(3):
        req = GenerationRequest(prompt_ids=tuple(shared + rand_ids(10 + i, 6)),
                                sampling=SamplingParams(max_new_tokens=8))
        got, want = engine.run(req), plain.run(req)
        assert got.cached_tokens == (0 if i == 0 else 48)
        assert got.output_ids == want.output_ids
    engine.check_invariants()
