"""A decoder's weights as its family's recipe names them, looked up once.

Owns: ``DecoderParts.of(model)``: the model's family recipe (``engine.model.families``) read
against the model itself, each decoder layer's linears (a fused q/k/v or gate/up projection split
into views of its rows), its norms in their places (Gemma's ``1 + w`` made once, in float32), its
q/k norms, sizes, attention scale and sliding window, and the model's embedding, rotary tables,
final norm, head and soft-caps; or one sentence saying why not. The fused C layers
(``engine.model.fused_decode``) and the exact forward (``engine.model.decoder_stack``) read these
parts and nothing else of the model; no attribute name outside a recipe is guessed here. Knows
nothing of requests, the cache or the kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.model import families
from engine.model.families import Recipe


@dataclass(frozen=True)
class Linear:
    """A projection's ``[out, in]`` weight (a view of a fused one's rows, perhaps) and its bias."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    @classmethod
    def rows(cls, m: nn.Module, start: int, stop: int) -> Linear:
        bias = None if m.bias is None else m.bias.detach()[start:stop]
        return cls(m.weight.detach()[start:stop], bias)

    @classmethod
    def of(cls, m: nn.Module) -> Linear:
        return cls.rows(m, 0, m.weight.shape[0])


@dataclass(frozen=True)
class Norm:
    """An RMSNorm's weight and epsilon; with ``offset`` the weight is already ``1 + w`` in float32."""

    weight: torch.Tensor
    eps: float
    offset: bool


@dataclass(frozen=True)
class LayerParts:
    """One decoder layer's weights and numbers (module docstring). Norms absent from the recipe are None."""

    index: int
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    gate: Linear
    up: Linear
    down: Linear
    attn_in: Norm | None
    attn_out: Norm | None
    mlp_in: Norm | None
    mlp_out: Norm | None
    q_norm: Norm | None
    k_norm: Norm | None
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    inter: int
    scaling: float
    window: int  # keys at positions above p - window only (0: every key)
    rope: int  # which rotary table (DecoderParts.rotary)


@dataclass(frozen=True)
class DecoderParts:
    """A decoder as the exact forward reads it (module docstring)."""

    recipe: Recipe
    embed: Callable[[torch.Tensor], torch.Tensor]  # ids [1, T] -> [1, T, hidden] (scaled where the recipe says)
    rotary: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # -> cos, sin [tables, T, d]
    layers: tuple[LayerParts, ...]
    norm: Norm
    head: Linear
    attn_softcap: float  # 0: none
    final_softcap: float  # 0: none

    @property
    def plain(self) -> bool:
        """A Llama-shaped decoder with no sliding window in use: the older drivers run it too."""
        return self.recipe.plain and not any(layer.window for layer in self.layers)

    @classmethod
    def of(cls, model: nn.Module) -> DecoderParts | str:
        """``model``'s parts, or why the exact forward cannot read it (one sentence)."""
        recipe = families.recipe_of(model)
        if recipe is None:
            return families.refusal(model)
        try:
            return _resolve(model, recipe)
        except _Refused as why:
            return f"{recipe.name}: {why}"
        except Exception as exc:  # noqa: BLE001 - a model that only looked like its family: say so, never crash
            return f"{recipe.name}: its weights do not read as the recipe says ({type(exc).__name__}: {exc})"


class _Refused(Exception):
    pass


_DYNAMIC_ROPE = ("dynamic", "longrope")  # transformers' rope types recomputed from the positions of each forward
# the config's activation names that are the recipe's activation (families.ACTIVATIONS)
_ACT_NAMES = {"silu": ("silu", "swish"), "gelu_tanh": ("gelu_pytorch_tanh", "gelu_new")}


def _need(obj: object, name: str, what: str) -> object:
    value = getattr(obj, name, None) if name else None
    if value is None:
        raise _Refused(f"no {what} ({name!r})")
    return value


def _norm(module: nn.Module, offset: bool) -> Norm:
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", None)
    eps = getattr(module, "eps", None) if eps is None else eps
    if weight is None or eps is None or weight.ndim != 1:
        raise _Refused(f"{type(module).__name__} is not an RMSNorm with a weight and an epsilon")
    w = weight.detach()
    return Norm((1.0 + w.float()).contiguous() if offset else w, float(eps), offset)


def _resolve(model: nn.Module, r: Recipe) -> DecoderParts:
    cfg = model.config.get_text_config(decoder=True)
    inner = _need(model, "model", "decoder body")
    layers = list(_need(inner, "layers", "decoder layers"))[: cfg.num_hidden_layers]
    if not layers:
        raise _Refused("no decoder layers")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise _Refused("bidirectional attention (an embedding model): the exact attention is causal")
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1) or getattr(cfg, "embedding_multiplier", None):
        raise _Refused("tensor-parallel pretraining slices or an embedding multiplier, which the recipe does not say")
    q_heads, kv_heads = int(cfg.num_attention_heads), int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // q_heads)
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * len(layers))
    tables = sorted(set(types)) if r.rotary_by_layer_type else [""]
    if len(tables) > 2:
        raise _Refused(f"{len(tables)} rotary tables; the C layers take two")
    act = str(getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None) or "")
    if act not in _ACT_NAMES[r.activation]:
        raise _Refused(f"the config's activation is {act!r}, not the recipe's {r.activation}")
    window = int(getattr(cfg, "sliding_window", None) or 0)
    scaling = float(getattr(cfg, r.query_scale)) ** -0.5 if r.query_scale else None
    out = []
    for i, layer in enumerate(layers):
        attn, mlp = _need(layer, "self_attn", "attention"), _need(layer, "mlp", "MLP")
        nq, nkv = q_heads * head_dim, kv_heads * head_dim
        if r.fused_qkv:
            qkv = _need(attn, r.fused_qkv, "fused q/k/v projection")
            q, k, v = Linear.rows(qkv, 0, nq), Linear.rows(qkv, nq, nq + nkv), Linear.rows(qkv, nq + nkv, nq + 2 * nkv)
        else:
            q, k, v = (Linear.of(_need(attn, f"{n}_proj", f"{n} projection")) for n in "qkv")
        if r.fused_gate_up:
            gu = _need(mlp, r.fused_gate_up, "fused gate/up projection")
            half = gu.weight.shape[0] // 2
            gate, up = Linear.rows(gu, 0, half), Linear.rows(gu, half, 2 * half)
        else:
            gate, up = Linear.of(_need(mlp, "gate_proj", "gate projection")), Linear.of(_need(mlp, "up_proj", "up projection"))
        n = r.norms
        norm = {slot: _norm(_need(layer, name, "norm"), r.norm_offset) if name else None
                for slot, name in (("attn_in", n.attn_in), ("attn_out", n.attn_out), ("mlp_in", n.mlp_in),
                                   ("mlp_out", n.mlp_out))}
        qk = (_norm(_need(attn, "q_norm", "q norm"), r.norm_offset), _norm(_need(attn, "k_norm", "k norm"), r.norm_offset)) \
            if r.qk_norm else (None, None)
        sliding = r.sliding_window == "all" or (r.sliding_window == "layer_types" and types[i] == "sliding_attention")
        parts = LayerParts(
            index=int(getattr(attn, "layer_idx", i)), q=q, k=k, v=v, o=Linear.of(_need(attn, "o_proj", "o projection")),
            gate=gate, up=up, down=Linear.of(_need(mlp, "down_proj", "down projection")), **norm,
            q_norm=qk[0], k_norm=qk[1], hidden=int(cfg.hidden_size), q_heads=q_heads, kv_heads=kv_heads,
            head_dim=head_dim, inter=int(gate.weight.shape[0]),
            scaling=scaling if scaling is not None else float(_need(attn, "scaling", "attention scale")),
            window=window if sliding else 0, rope=tables.index(types[i]) if r.rotary_by_layer_type else 0)
        _check_shapes(parts, r)
        out.append(parts)
    rotary_emb = _need(inner, "rotary_emb", "rotary embedding")
    kinds = getattr(rotary_emb, "rope_type", None)
    dynamic = sorted({k for k in (kinds.values() if isinstance(kinds, dict) else [kinds]) if k in _DYNAMIC_ROPE})
    if dynamic:  # its tables follow the longest position in the pack: a row's bits would hang on its batch
        raise _Refused(f"a rotary embedding that changes with the batch's longest position ({', '.join(dynamic)})")

    def rotary(h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not r.rotary_by_layer_type:  # one table: the model's own, as a view (no copy in float32)
            cos, sin = rotary_emb(h, positions)
            return cos.float().contiguous(), sin.float().contiguous()
        pairs = [rotary_emb(h, positions, t) for t in tables]
        return (torch.stack([c[0] for c, _ in pairs]).float().contiguous(),
                torch.stack([s[0] for _, s in pairs]).float().contiguous())

    p = next(model.parameters())
    cos, _ = rotary(torch.zeros((1, 1, int(cfg.hidden_size)), dtype=p.dtype, device=p.device),
                    torch.zeros((1, 1), dtype=torch.long, device=p.device))
    if cos.shape[-1] != head_dim:
        raise _Refused(f"a rotary embedding over {cos.shape[-1]} of the head's {head_dim} dimensions (partial rotary)")
    head = _need(model, "lm_head", "LM head")
    return DecoderParts(recipe=r, embed=_need(inner, "embed_tokens", "embedding").forward, rotary=rotary,
                        layers=tuple(out), norm=_norm(_need(inner, "norm", "final norm"), r.norm_offset),
                        head=Linear.of(head),
                        attn_softcap=float(getattr(cfg, r.attn_softcap, None) or 0.0) if r.attn_softcap else 0.0,
                        final_softcap=float(getattr(cfg, r.final_softcap, None) or 0.0) if r.final_softcap else 0.0)


def _check_shapes(p: LayerParts, r: Recipe) -> None:
    nq, nkv = p.q_heads * p.head_dim, p.kv_heads * p.head_dim
    want = {"q": (p.q, nq, p.hidden), "k": (p.k, nkv, p.hidden), "v": (p.v, nkv, p.hidden), "o": (p.o, p.hidden, nq),
            "gate": (p.gate, p.inter, p.hidden), "up": (p.up, p.inter, p.hidden), "down": (p.down, p.hidden, p.inter)}
    for name, (lin, rows, cols) in want.items():
        if tuple(lin.weight.shape) != (rows, cols):
            raise _Refused(f"layer {p.index}'s {name} projection is {tuple(lin.weight.shape)}, not {(rows, cols)}")
    width = {"head": (p.head_dim, p.head_dim), "projection": (nq, nkv)}.get(r.qk_norm)
    if width and (p.q_norm.weight.shape[0], p.k_norm.weight.shape[0]) != width:
        raise _Refused(f"layer {p.index}'s q/k norms do not match a norm per {r.qk_norm}")
