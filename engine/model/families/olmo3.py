"""OLMo 3: OLMo 2's layer (norms after attention and after the MLP, an RMSNorm over the whole query
and key projections) with sliding windows where config.layer_types says and a rotary table per
layer type."""

from engine.model.families.recipe import Norms, Recipe

RECIPE = Recipe("OLMo 3", ("olmo3",),
                norms=Norms(attn_in="", attn_out="post_attention_layernorm", mlp_in="", mlp_out="post_feedforward_layernorm"),
                qk_norm="projection", rotary_by_layer_type=True, sliding_window="layer_types")
