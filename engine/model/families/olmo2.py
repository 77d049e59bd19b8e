"""OLMo 2: norms after attention and after the MLP only (none before), and an RMSNorm over the whole
query and key projections before the rotary embedding."""

from engine.model.families.recipe import Norms, Recipe

RECIPE = Recipe("OLMo 2", ("olmo2",),
                norms=Norms(attn_in="", attn_out="post_attention_layernorm", mlp_in="", mlp_out="post_feedforward_layernorm"),
                qk_norm="projection")
