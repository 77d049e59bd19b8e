"""What a model family's decoder layer is: ``Recipe`` and its ``Norms`` (``engine.model.families``
holds one per family and the registry). Knows nothing of models or kernels."""

from __future__ import annotations

from dataclasses import dataclass

ACTIVATIONS = ("silu", "gelu_tanh")  # what the C layers compute (native_linear.c: act)


@dataclass(frozen=True)
class Norms:
    """Which RMSNorm module of a decoder layer sits where ("" for none): before and after attention,
    before and after the MLP. Llama has the two ``before``s (its second is called
    ``post_attention_layernorm``), Gemma 2/3 all four, OLMo 2 the two ``after``s."""

    attn_in: str = "input_layernorm"
    attn_out: str = ""
    mlp_in: str = "post_attention_layernorm"
    mlp_out: str = ""


@dataclass(frozen=True)
class Recipe:
    """One family's decoder layer, as the exact forward computes it (module docstring). Sizes,
    epsilons, biases, the window's length and the soft-caps' values come from the model itself."""

    name: str  # in words: "Qwen 3"
    model_types: tuple[str, ...]  # transformers' config.model_type values it covers
    norms: Norms = Norms()
    norm_offset: bool = False  # Gemma: the weight is 1 + w, the product taken in float32 and rounded once
    activation: str = "silu"  # the MLP's gate: silu(gate) * up, or gelu_tanh(gate) * up
    qkv_bias: bool = False  # whether the family's q/k/v projections carry biases (Qwen 2); read from the linears
    qk_norm: str = ""  # "head": an RMSNorm over each head (Qwen 3, Gemma 3); "projection": over all heads (OLMo 2)
    fused_qkv: str = ""  # one q/k/v projection, split at load by rows (Phi-3: "qkv_proj")
    fused_gate_up: str = ""  # one gate/up projection, gate rows first (Phi-3: "gate_up_proj")
    rotary_by_layer_type: bool = False  # a rotary table per layer type (Gemma 3: a local base for sliding layers)
    sliding_window: str = ""  # "layer_types": the layers config.layer_types marks; "all": every layer
    attn_softcap: str = ""  # the config field of the attention scores' soft-cap (Gemma 2)
    final_softcap: str = ""  # the config field of the logits' soft-cap (Gemma 2/3)
    query_scale: str = ""  # the config field the attention scale is taken from (Gemma: query_pre_attn_scalar)
    embed_scale: bool = False  # the embedding is multiplied by sqrt(hidden) (Gemma: its embedding module does it)
    notes: str = ""  # anything else worth saying in --explain-kernels

    @property
    def plain(self) -> bool:
        """A Llama-shaped layer (pre-norms, SiLU, no q/k norm, nothing fused, no cap): the ones the
        older drivers (``stack``, ``fused``) also run, where the model uses no sliding window."""
        return self == Recipe(self.name, self.model_types, qkv_bias=self.qkv_bias, sliding_window=self.sliding_window,
                              notes=self.notes)

    def describe(self) -> str:
        """The recipe in one line of words (for ``--explain-kernels``)."""
        n = self.norms
        parts = [f"norms {'+'.join(s for s, m in (('pre', n.attn_in or n.mlp_in), ('post', n.attn_out or n.mlp_out)) if m)}"
                 + (" (1 + w)" if self.norm_offset else ""), self.activation.replace("_", "-")]
        parts += [w for w, on in (("QKV bias", self.qkv_bias), (f"q/k norm per {self.qk_norm}", self.qk_norm),
                                  (f"{self.fused_qkv}/{self.fused_gate_up} split at load", self.fused_qkv),
                                  ("rotary table per layer type", self.rotary_by_layer_type),
                                  (f"sliding window ({self.sliding_window})", self.sliding_window),
                                  ("attention soft-cap", self.attn_softcap), ("logit soft-cap", self.final_softcap),
                                  ("scaled embedding", self.embed_scale)) if on]
        return f"{self.name}: " + ", ".join(parts)
