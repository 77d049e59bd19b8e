"""The scheduler's forward for Llama-family decoders, written out layer by layer over the pool.

Owns: ``DecoderStack``, a forward of the whole decoder (embeddings, every layer, the final
norm, the LM head) that calls the model's own modules and functions in the order
transformers calls them, with the KV written straight to its pool slots and attention read
through the step's ``PagedPlan``. Knows nothing about requests or the tree: the runner hands
it the plan's token ids, positions and the rows to keep.

Why: on a CPU a decode step for one or a few requests is short (tens of milliseconds), and
transformers' generic machinery around each layer (keyword plumbing, output capturing,
cache objects, mask creation, the attention registry, per-module hooks) and its many small
ops are a measurable part of it. Here each layer is a few direct calls, and two of its
pieces take fewer ops for the same arithmetic:

- RMSNorm: ``weight * rms_norm(x in float32).to(dtype)`` (PyTorch's one fused kernel) for
  transformers' seven ops (upcast, square, mean, add, rsqrt, multiply, downcast);
- rotary embedding: ``x * cos + roll(x, d/2) * sin'`` where ``sin'`` is ``sin`` with its first
  half negated, once per forward, for ``rotate_half``'s slices, negation and concatenation per
  layer (``-a * b`` and ``a * -b`` are the same float).

The logits are bit-identical to the transformers path: the runner checks so at start on a
probe forward (``ModelRunner._check_stack``), and keeps transformers' forward on any difference.

Which models: a causal LM whose ``model.layers`` are decoder layers with ``self_attn``
(``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, no per-head norms), ``mlp`` (``gate_proj``,
``up_proj``, ``down_proj``, ``act_fn``), ``input_layernorm`` and
``post_attention_layernorm``, a ``rotary_emb`` on the model, and ``apply_rotary_pos_emb``
in its modeling module: Llama, Mistral (without a sliding window), Qwen2 and their kin.
``DecoderStack.build`` returns None for anything else, and the runner keeps transformers'
forward. Whether to try it at all is the execution plan's (``engine.model.plan``: ``stack=off``,
alias ``RADIX_DECODER_STACK=0``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.held_signals import release_signals
from engine.model.fused_decode import FusedLayers, plain_rms_norm


def _rms_norm(norm: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``norm``'s forward as one fused kernel where it is a plain RMSNorm (a ``weight`` and a
    ``variance_epsilon``, no offset), else its own forward."""
    plain = plain_rms_norm(norm)
    if plain is None:
        return norm.forward
    weight, eps = plain
    shape = (weight.shape[0],)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return weight * F.rms_norm(x.float(), shape, eps=eps).to(x.dtype)

    return forward


class _Layer:
    """One decoder layer's parts, looked up once (their ``forward`` methods: no module hooks)."""

    def __init__(self, layer: nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.index = attn.layer_idx
        self.norm1, self.norm2 = _rms_norm(layer.input_layernorm), _rms_norm(layer.post_attention_layernorm)
        self.q, self.k, self.v, self.o = (attn.q_proj.forward, attn.k_proj.forward, attn.v_proj.forward,
                                          attn.o_proj.forward)
        self.gate, self.up, self.down, self.act = (mlp.gate_proj.forward, mlp.up_proj.forward,
                                                   mlp.down_proj.forward, mlp.act_fn)
        self.scaling = float(attn.scaling)
        self.head_dim = int(attn.head_dim)


class DecoderStack:
    """A direct forward of a Llama-family decoder (module docstring)."""

    def __init__(self, model: nn.Module, rotate: Callable, fused: bool = True) -> None:
        inner = model.model
        self.embed = inner.embed_tokens.forward
        self.rotary = inner.rotary_emb
        self.norm = _rms_norm(inner.norm)
        self.head = model.lm_head.forward
        self.rotate = rotate
        modules = list(inner.layers[: model.config.get_text_config().num_hidden_layers])
        self.layers = [_Layer(layer) for layer in modules]
        # A step of a few rows in two C calls per layer (engine.model.fused_decode), where the plan
        # may use them; the runner drops them unless they check out on a probe (ModelRunner._check_fused).
        self.fused: FusedLayers | None = FusedLayers.build(model, modules) if fused else None
        self.one_scale = len({(layer.scaling, layer.head_dim) for layer in self.layers}) == 1  # one C call takes one

    @classmethod
    def build(cls, model: nn.Module, fused: bool = True) -> DecoderStack | None:
        """The stack for ``model``, or None when it is not a decoder this forward knows; with its
        fused layers where ``fused`` (the plan may use them) and they take the model."""
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if inner is None or not layers or getattr(model, "lm_head", None) is None:
            return None
        for name in ("embed_tokens", "rotary_emb", "norm"):
            if getattr(inner, name, None) is None:
                return None
        rotate = getattr(sys.modules.get(type(layers[0].self_attn).__module__), "apply_rotary_pos_emb", None)
        if rotate is None or not all(cls._knows(layer) for layer in layers):
            return None
        cfg = model.config.get_text_config()
        if getattr(cfg, "pretraining_tp", 1) not in (None, 1) or getattr(cfg, "embedding_multiplier", None):
            return None
        return cls(model, rotate, fused)

    @staticmethod
    def _knows(layer: nn.Module) -> bool:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None:
            return False
        if any(getattr(attn, n, None) is None for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim")):
            return False
        if getattr(attn, "q_norm", None) is not None or getattr(attn, "k_norm", None) is not None:
            return False  # per-head norms (Qwen3, OLMo 2): another layer shape
        if any(getattr(mlp, n, None) is None for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return False
        extra = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
        names = {n for n, _ in layer.named_children()}
        return names == extra  # any other part (a pre-feedforward norm, a router) is not this layer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, write_index: torch.Tensor,
                k_pool: list[torch.Tensor], v_pool: list[torch.Tensor], attend: Callable,
                keep: torch.Tensor | int, rows_call: Callable | None = None) -> torch.Tensor:
        """Logits of the kept rows: ``input_ids``/``positions`` ``[1, T]``; token ``i``'s KV goes to
        slot ``write_index[i]`` of every layer's ``k_pool``/``v_pool`` ``[Hkv, S, D]``;
        ``attend(k_layer, v_layer, query [1, Hq, T, D], scale) -> [1, T, Hq, D]`` reads them (the
        plan's attention); ``keep`` is transformers' ``logits_to_keep`` (0: every row, or the rows'
        indices); ``rows_call(k_layer, q_heads, scale)`` (the plan's ``rows_call``), where given,
        may offer that attention for C to call, and then a fused step runs every layer in one C
        call. Returns ``[1, kept, vocab]`` in the model's dtype."""
        h = self.embed(input_ids)
        cos, sin = self.rotary(h, positions)
        if (self.fused is not None and input_ids.shape[1] <= self.fused.max_rows
                and cos.shape[-1] == self.layers[0].head_dim):
            h = self._fused(h, cos, sin, write_index, k_pool, v_pool, attend, rows_call)
        else:
            h = self._layers(h, cos, sin, write_index, k_pool, v_pool, attend)
        h = self.norm(h)
        if not (isinstance(keep, int) and keep == 0):
            h = h[:, keep]
        return self.head(h)

    def forward_exact(self, input_ids: torch.Tensor, positions: torch.Tensor, write_index: torch.Tensor,
                      k_pool: list[torch.Tensor], v_pool: list[torch.Tensor], call: object,
                      keep: torch.Tensor | int) -> torch.Tensor:
        """``forward`` with every row's bits its own (issue 44): whatever the number of rows, every
        layer runs the fused C calls (``FusedLayers.run_all``) with the exact attention ``call``
        (``engine.model.attention.exact.ExactCall``) between them, and the final norm and the head
        run on our kernels (``FusedLayers.tail``). Needs ``exact_ready``. Same arguments and result."""
        h = self.embed(input_ids)
        cos, sin = self.rotary(h, positions)
        dtype, flat = h.dtype, h[0].float().contiguous()
        release_signals()  # the consumers' Python runs beside the kernels (compute_thread)
        self.fused.run_all(flat, cos[0].float().contiguous(), sin[0].float().contiguous(),
                           [k_pool[layer.index] for layer in self.layers], [v_pool[layer.index] for layer in self.layers],
                           write_index.contiguous(), call)
        if not (isinstance(keep, int) and keep == 0):
            flat = flat[keep].contiguous()
        return self.fused.tail.logits(flat).to(dtype).unsqueeze(0)

    @property
    def exact_ready(self) -> bool:
        """Whether ``forward_exact`` can run: the fused layers and their tail built, one attention
        scale for every layer, and the rotary embedding over whole heads."""
        fused = self.fused
        return (fused is not None and fused.tail is not None and self.one_scale
                and all(layer.head_dim == self.layers[0].head_dim for layer in self.layers))

    def _fused(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, write_index: torch.Tensor,
               k_pool: list[torch.Tensor], v_pool: list[torch.Tensor], attend: Callable,
               rows_call: Callable | None) -> torch.Tensor:
        """Every layer for a few rows: the work around attention in C (module docstring), all of it
        in one call where the attention can be called from C too. The C code takes float32 rows
        (in bfloat16 they hold bf16 values: widened here, and narrowed at the end, exactly)."""
        fused, rows, dtype = self.fused, h.shape[1], h.dtype
        h = h.float().contiguous()
        flat, cos, sin, write_index = h[0], cos[0].float().contiguous(), sin[0].float().contiguous(), \
            write_index.contiguous()
        first = self.layers[0]
        call = rows_call(k_pool[first.index], fused.q_width // first.head_dim, first.scaling) \
            if rows_call is not None and self.one_scale else None
        release_signals()  # the consumers' Python runs beside the kernels (compute_thread)
        if call is not None:
            fused.run_all(flat, cos, sin, [k_pool[layer.index] for layer in self.layers],
                          [v_pool[layer.index] for layer in self.layers], write_index, call)
            return h.to(dtype)
        for i, layer in enumerate(self.layers):
            k_layer, v_layer = k_pool[layer.index], v_pool[layer.index]
            q = fused.pre(i, flat, cos, sin, k_layer, v_layer, write_index).to(dtype)
            a = attend(k_layer, v_layer, q.view(1, rows, -1, layer.head_dim).transpose(1, 2), layer.scaling)
            fused.post(i, flat, a.reshape(rows, -1).float().contiguous())
        return h.to(dtype)

    def _layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, write_index: torch.Tensor,
                k_pool: list[torch.Tensor], v_pool: list[torch.Tensor], attend: Callable) -> torch.Tensor:
        """Every layer through the model's own modules (module docstring)."""
        release_signals()
        shape = h.shape[:-1]
        half = cos.shape[-1] // 2
        rolled = cos.shape[-1] == self.layers[0].head_dim and cos.shape[-1] % 2 == 0
        if rolled:  # the rotary embedding in four ops per tensor (module docstring)
            cos, sin = cos.unsqueeze(1), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(1)
        for layer in self.layers:
            x = layer.norm1(h)
            view = (*shape, -1, layer.head_dim)
            q = layer.q(x).view(view).transpose(1, 2)
            k = layer.k(x).view(view).transpose(1, 2)
            v = layer.v(x).view(view).transpose(1, 2)
            if rolled:
                q = q * cos + q.roll(half, -1) * sin
                k = k * cos + k.roll(half, -1) * sin
            else:
                q, k = self.rotate(q, k, cos, sin)
            k_pool[layer.index].index_copy_(1, write_index, k[0])
            v_pool[layer.index].index_copy_(1, write_index, v[0])
            a = attend(k_pool[layer.index], v_pool[layer.index], q, layer.scaling)
            h = h + layer.o(a.reshape(*shape, -1).contiguous())
            x = layer.norm2(h)
            h = h + layer.down(layer.act(layer.gate(x)) * layer.up(x))
        return h
