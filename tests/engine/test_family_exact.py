"""Every family of ``engine.model.families`` on the exact, batched forward (issue 59), on tiny random
models built from transformers' own config classes (``tests/family_models.py``): the plan chooses
``layers=exact``; the logits are transformers' own forward's up to the reference's tolerance; and
the bit-exact schedules of ``test_bit_exact`` (random chunking, decode rows joining and leaving,
reuse in place, KV moved) give every row its bits alone, ``torch.equal``, sliding windows and
soft-caps included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import tests.engine.test_bit_exact as bit_exact
from engine.model import families, native_linear
from engine.model.attention import native
from engine.model.loader import LoadedModel
from engine.model.runner import ModelRunner
from engine.types import GenerationRequest, SamplingParams
from tests.family_models import FAMILIES, WINDOW, tiny_model

ROOT = Path(__file__).resolve().parents[2]
_RUNNERS: dict[tuple[str, torch.dtype], ModelRunner] = {}


def family_runner(tokenizer, family: str, dtype: torch.dtype = torch.float32) -> ModelRunner:
    """One runner per family and dtype for the whole session (closed at exit with the process)."""
    key = (family, dtype)
    if key not in _RUNNERS:
        model = tiny_model(family, len(tokenizer), dtype=dtype)
        _RUNNERS[key] = ModelRunner(LoadedModel(model, tokenizer, f"tiny-{family}", torch.device("cpu"), dtype))
    return _RUNNERS[key]


@pytest.fixture(params=FAMILIES)
def runner(request, tokenizer):
    if native.kernel() is None or native_linear.kernel() is None:
        pytest.skip("the exact forward does not run here (no C compiler, or a CPU without AVX2)")
    return family_runner(tokenizer, request.param)


def test_the_registry_has_one_file_per_family_and_each_recipe_says_what_it_is():
    files = sorted(p.stem for p in (ROOT / "engine/model/families").glob("*.py") if p.stem not in ("__init__", "recipe"))
    assert files == sorted(FAMILIES) == sorted(families.FAMILY_FILES)
    for recipe in families.REGISTRY.values():
        assert recipe.describe().startswith(recipe.name + ": ")
    # one registry line a family: its file's name alone on a line, named nowhere else in the registry
    source = (ROOT / "engine/model/families/__init__.py").read_text()
    registry = source[source.index("__all__"):].splitlines()  # the code, past the docstring's examples
    for name in files:
        assert registry.count(f'    "{name}",') == 1, name
        assert sum(name in line for line in registry) == 1, f"{name} is named on more than its registry line"


def test_every_family_plans_the_exact_forward(runner):
    assert runner.plan.layers == "exact", runner.plan.lines()
    assert runner.runs_exact and runner.family == families.recipe_of(runner.model).describe()


def test_logits_are_transformers_own_forward(runner):
    """A 70-token prompt (past every sliding window) in three chunks, against transformers' forward of
    it from nothing: the reference's tolerance (``test_model_families``)."""
    from transformers import DynamicCache

    ids = torch.randint(10, len(runner.text.tokenizer), (70,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.inference_mode():
        ref = runner.model(input_ids=torch.tensor([ids]), cache=DynamicCache()).logits[0].float()
    kv = runner.new_request_kv(len(ids))
    got = torch.cat([runner.forward(ids[:33], kv), runner.forward(ids[33:69], kv), runner.forward(ids[69:], kv)])
    assert torch.allclose(got, ref, atol=1e-4), float((got - ref).abs().max())


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=bit_exact.schedules())
def test_any_schedule_gives_every_row_its_bits_alone(runner, case):
    bit_exact.assert_every_row_alone(runner, *bit_exact.run_schedule(runner, *case))


def test_a_decode_row_alone_among_sixteen_and_beside_a_long_chunk(runner):
    bit_exact.test_a_decode_row_alone_among_sixteen_and_beside_a_long_chunk(runner)


def test_scratch_buffers_and_the_no_reuse_baseline_give_the_pools_bits(runner):
    bit_exact.test_scratch_buffer_paths_and_the_no_reuse_baseline_give_the_pools_bits(runner)


def test_kv_moved_to_other_slots_gives_the_same_bits(runner):
    bit_exact.test_kv_moved_to_other_slots_gives_the_same_bits(runner)


def test_reuse_and_batching_give_the_logprobs_of_no_cache(runner, make_engine):
    """Through the engine: three prompts behind a shared 40-token prefix (five windows long), run
    together with the cache on, give the answers and logprobs of each run alone with no cache."""
    gen = torch.Generator().manual_seed(6)
    vocab = len(runner.text.tokenizer)
    shared = torch.randint(10, vocab, (5 * WINDOW,), generator=gen).tolist()
    prompts = [shared + torch.randint(10, vocab, (3 + i,), generator=gen).tolist() for i in range(3)]
    sampling = SamplingParams(max_new_tokens=6, ignore_eos=True)
    cached = make_engine(runner, budget_bytes=2000 * runner.kv_bytes_per_token)
    plain = make_engine(runner, enable_cache=False)
    cached.run(GenerationRequest(prompt_ids=tuple(prompts[0]), sampling=sampling))  # the prefix cached
    with runner.lock:  # submitted while the model is busy: admitted in one step, batched
        handles = [cached.submit(GenerationRequest(prompt_ids=tuple(p), sampling=sampling, logprobs=3))
                   for p in prompts]
    together = [list(h)[-1].metrics for h in handles]
    for p, got in zip(prompts, together, strict=True):
        alone = plain.run(GenerationRequest(prompt_ids=tuple(p), sampling=sampling, logprobs=3))
        assert got.cached_tokens >= len(shared)
        assert got.output_ids == alone.output_ids and got.output_logprobs == alone.output_logprobs
    assert max(m.batch_size_max for m in together) >= 2


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_runs_exact_and_batched_rows_equal_lone_ones(tokenizer, family):
    r = family_runner(tokenizer, family, torch.bfloat16)
    assert r.plan.layers == "exact", r.plan.lines()
    bit_exact.test_a_decode_row_alone_among_sixteen_and_beside_a_long_chunk(r)


def test_a_family_outside_the_registry_says_so_and_what_it_would_need(tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=1, n_head=4)).eval()
    r = ModelRunner(LoadedModel(model, tokenizer, "tiny-gpt2", torch.device("cpu"), torch.float32))
    try:
        why = r.plan.why_not("exact")
        assert r.plan.layers != "exact" and "'gpt2' is not in the registry" in why and families.NEEDS in why
        assert why in r.forward_kind and r.family == why  # the engine info and --explain-kernels say it
    finally:
        r.close()


@pytest.mark.slow
def test_explain_kernels_names_the_exact_forward_for_every_family(tokenizer, tmp_path):
    """``python app.py --model DIR --explain-kernels`` on each family saved to a folder."""
    for family in FAMILIES:
        folder = tmp_path / family
        tiny_model(family, len(tokenizer)).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        out = subprocess.run([sys.executable, "app.py", "--model", str(folder), "--explain-kernels", "--dtype",
                              "float32"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
        assert out.returncode == 0, out.stderr[-2000:]
        assert "plan: layers=exact " in out.stdout, (family, out.stdout)
        assert f"family: {families.REGISTRY[tiny_model(family, 64).config.model_type].name}: " in out.stdout


def test_a_recipe_reads_the_weights_in_place_and_names_what_it_cannot_read(tokenizer):
    """Phi-3's fused projections become views of their rows (no copy); Gemma's norms ``1 + w`` once, in
    float32; Gemma 3's sliding layers read their own rotary table; a Llama with another activation is
    outside its recipe, in one sentence."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.model.decoder_parts import DecoderParts

    phi3 = tiny_model("phi3", 256)
    parts = DecoderParts.of(phi3)
    qkv, nq = phi3.model.layers[0].self_attn.qkv_proj.weight, 4 * 16
    layer = parts.layers[0]
    assert layer.q.weight.data_ptr() == qkv.data_ptr()
    assert layer.k.weight.data_ptr() == qkv.data_ptr() + nq * 64 * qkv.element_size()
    assert layer.window == WINDOW and parts.recipe.name == "Phi-3"
    gemma3 = DecoderParts.of(tiny_model("gemma3", 256, dtype=torch.bfloat16))
    norm = gemma3.layers[0].attn_in
    assert norm.offset and norm.weight.dtype == torch.float32
    assert [(p.window, p.rope) for p in gemma3.layers] == [(WINDOW, 1), (0, 0), (WINDOW, 1)]
    assert gemma3.final_softcap == 3.0 and not gemma3.plain
    gelu = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, hidden_act="gelu"))
    assert DecoderParts.of(gelu) == "Llama: the config's activation is 'gelu', not the recipe's silu"


def test_a_rotary_table_that_follows_the_batch_is_not_exact():
    """Phi-3's long-context ``longrope`` picks its factors from the longest position of each forward: a
    row's bits would hang on its batch, so the recipe refuses it and says why (the plan falls back)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    from engine.model.decoder_parts import DecoderParts

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 4096}
    cfg = Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2, num_hidden_layers=1, max_position_embeddings=8192,
                     original_max_position_embeddings=4096, pad_token_id=0, rope_parameters=rope)
    assert DecoderParts.of(Phi3ForCausalLM(cfg)) == (
        "Phi-3: a rotary embedding that changes with the batch's longest position (longrope)")
