"""The model families the exact forward knows, one file each, and their registry.

Owns: ``Recipe``, what a family's decoder layer is (norms and their offset, activation, q/k norms,
fused projections, rotary tables, sliding windows, soft-capping, embedding scale), and ``REGISTRY``,
``model_type`` (a transformers config's) to recipe. ``engine.model.decoder_parts`` reads a recipe to
find the weights; the C layers (``native_linear.c``) and the exact attention compute what it says;
the plan (``engine.model.plan``) asks ``refusal`` first. Knows nothing of requests, the cache or
the kernels themselves.

To add a family: a file here that declares its ``RECIPE`` (copy the nearest one: ``llama.py`` for a
plain decoder, ``gemma3.py`` for everything at once) and one line in ``_FAMILIES`` below; then
``tests/engine/test_family_exact.py`` takes its tiny config (``tests/engine/families.py``).
"""

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


def _families() -> tuple[Recipe, ...]:
    from engine.model.families import gemma2, gemma3, llama, mistral, olmo2, phi3, qwen2, qwen3

    return (llama.RECIPE, qwen2.RECIPE, qwen3.RECIPE, mistral.RECIPE, gemma2.RECIPE, gemma3.RECIPE, phi3.RECIPE,
            olmo2.RECIPE)


_FAMILIES = _families()
REGISTRY: dict[str, Recipe] = {t: r for r in _FAMILIES for t in r.model_types}
NEEDS = ("an entry in engine.model.families: a file declaring its Recipe (norms, activation, q/k norms, fused "
         "projections, rotary, window, soft-caps) and one registry line")


def model_type(model) -> str:
    """The text decoder's ``model_type`` of a transformers model ("" where it has none)."""
    config = getattr(model, "config", None)
    if config is None:
        return ""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return str(getattr(text, "model_type", "") or getattr(config, "model_type", ""))


def recipe_of(model) -> Recipe | None:
    """The registered recipe of ``model``, or None."""
    return REGISTRY.get(model_type(model))


def refusal(model) -> str:
    """Why ``model``'s family is not one the exact forward knows ("" where it is), with what it would need."""
    if recipe_of(model) is not None:
        return ""
    kind = model_type(model) or type(model).__name__
    return (f"the family {kind!r} is not in the registry (engine.model.families knows "
            f"{', '.join(r.name for r in _FAMILIES)}): it would need {NEEDS}")
