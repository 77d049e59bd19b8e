"""Gemma 3 (text): Gemma 2's layer with an RMSNorm (1 + w) over each query and key head, a rotary
table per layer type (a local base for the sliding layers) and no attention soft-cap."""

from engine.model.families.recipe import Norms, Recipe

RECIPE = Recipe("Gemma 3", ("gemma3_text", "gemma3"),
                norms=Norms(attn_in="input_layernorm", attn_out="post_attention_layernorm",
                            mlp_in="pre_feedforward_layernorm", mlp_out="post_feedforward_layernorm"),
                norm_offset=True, activation="gelu_tanh", qk_norm="head", rotary_by_layer_type=True,
                sliding_window="layer_types", final_softcap="final_logit_softcapping",
                query_scale="query_pre_attn_scalar", embed_scale=True)
