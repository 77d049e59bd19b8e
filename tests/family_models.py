"""Tiny random-weight models of every family in ``engine.model.families``, built from transformers'
own config classes (no download): two or three layers, hidden 64, head size 16, small sliding
windows where the family has them (so a 40-token prompt crosses them) and soft-caps where it has
them. Shared by the per-family tests (``tests/engine/test_family_*.py``, ``tests/app``)."""

from __future__ import annotations

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "olmo2", "olmo3")
WINDOW = 8  # the sliding window of the families that have one (keys above p - 8)


def tiny_model(family: str, vocab: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny ``family`` causal LM over ``vocab`` tokens, in eval mode."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, num_hidden_layers=2,
                  initializer_range=0.1)
    three = dict(common, num_hidden_layers=3)
    if family == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**three, use_sliding_window=True, sliding_window=WINDOW,
                                                   max_window_layers=1))
    elif family == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=16))
    elif family == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=WINDOW))
    elif family == "gemma2":
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(**common, head_dim=16, sliding_window=WINDOW,
                                                     query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                                     final_logit_softcapping=3.0))
    elif family == "gemma3":
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
            **three, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24, final_logit_softcapping=3.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"]))
    elif family == "phi3":
        model = tf.Phi3ForCausalLM(tf.Phi3Config(**common, sliding_window=WINDOW, pad_token_id=0))
    elif family == "olmo2":
        model = tf.Olmo2ForCausalLM(tf.Olmo2Config(**common))
    elif family == "olmo3":  # its default layers (three sliding in four); YaRN on the full ones, as OLMo 3 ships
        model = tf.Olmo3ForCausalLM(tf.Olmo3Config(
            **dict(common, num_hidden_layers=4), sliding_window=WINDOW,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0,
                                                "original_max_position_embeddings": 256}}))
    else:
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    with torch.no_grad():  # norms away from 1 (0 for Gemma's 1 + w): a misread norm must show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model.to(dtype).eval()
