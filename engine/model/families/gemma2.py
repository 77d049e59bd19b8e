"""Gemma 2: norms before and after attention and the MLP, weights 1 + w; GELU (tanh); every other
layer a sliding window; attention scores and logits soft-capped; scale from query_pre_attn_scalar;
the embedding scaled by sqrt(hidden)."""

from engine.model.families.recipe import Norms, Recipe

RECIPE = Recipe("Gemma 2", ("gemma2",),
                norms=Norms(attn_in="input_layernorm", attn_out="post_attention_layernorm",
                            mlp_in="pre_feedforward_layernorm", mlp_out="post_feedforward_layernorm"),
                norm_offset=True, activation="gelu_tanh", sliding_window="layer_types",
                attn_softcap="attn_logit_softcapping", final_softcap="final_logit_softcapping",
                query_scale="query_pre_attn_scalar", embed_scale=True)
