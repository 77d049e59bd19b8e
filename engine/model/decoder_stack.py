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
probe forward (``engine.model.layer_checks``), and keeps transformers' forward on any difference.

Which models: every family of the registry (``engine.model.families``), through its
``engine.model.decoder_parts.DecoderParts``. The exact forward (``forward_exact``) runs all of
them; the PyTorch layers (``forward``, the ``stack`` and ``fused`` drivers) only the Llama-shaped
ones with no sliding window in use (``DecoderParts.plain``: Llama, Mistral, Qwen 2 and kin), whose
modules ``_Layer`` calls by the names transformers gives them. Whether to try it at all is the
execution plan's (``engine.model.plan``: ``stack=off``, alias ``RADIX_DECODER_STACK=0``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.held_signals import release_signals
from engine.model.decoder_parts import DecoderParts
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
    """One Llama-shaped decoder layer's parts, looked up once (their ``forward`` methods: no module hooks)."""

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
    """A direct forward of a decoder of the registry (module docstring)."""

    def __init__(self, model: nn.Module, parts: DecoderParts, fused: bool = True) -> None:
        inner = model.model
        self.parts = parts
        self.plain = parts.plain  # the PyTorch layers (forward) run it too
        self.embed = parts.embed
        self.head = model.lm_head.forward
        modules = list(inner.layers[: model.config.get_text_config().num_hidden_layers])
        if self.plain:
            self.rotary = inner.rotary_emb
            self.norm = _rms_norm(inner.norm)
            self.rotate = getattr(sys.modules.get(type(modules[0].self_attn).__module__), "apply_rotary_pos_emb", None)
            self.layers: list = [_Layer(layer) for layer in modules]
        else:
            self.layers = list(parts.layers)  # index, scaling and head_dim: what forward_exact reads
        # A step of a few rows in two C calls per layer (engine.model.fused_decode), where the plan
        # may use them; the runner drops them unless they check out on a probe (engine.model.layer_checks).
        p = next(model.parameters())
        self.fused: FusedLayers | None = FusedLayers.build(parts, p.dtype, p.device) if fused else None
        self.one_scale = len({(layer.scaling, layer.head_dim) for layer in self.layers}) == 1  # one C call takes one
        self.windows = [layer.window for layer in parts.layers]

    @classmethod
    def build(cls, model: nn.Module, fused: bool = True) -> DecoderStack | str:
        """The stack for ``model``, or why not (its family is not in the registry, or its parts do
        not read: one sentence); with its fused layers where ``fused`` (the plan may use them) and
        they take the model."""
        parts = DecoderParts.of(model)
        if isinstance(parts, str):
            return parts
        stack = cls(model, parts, fused)
        if stack.plain and stack.rotate is None:
            return "its modeling module has no apply_rotary_pos_emb"
        return stack

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, write_index: torch.Tensor,
                k_pool: list[torch.Tensor], v_pool: list[torch.Tensor], attend: Callable,
                keep: torch.Tensor | int, rows_call: Callable | None = None, fused: bool = False) -> torch.Tensor:
        """Logits of the kept rows: ``input_ids``/``positions`` ``[1, T]``; token ``i``'s KV goes to
        slot ``write_index[i]`` of every layer's ``k_pool``/``v_pool`` ``[Hkv, S, D]``;
        ``attend(k_layer, v_layer, query [1, Hq, T, D], scale) -> [1, T, Hq, D]`` reads them (the
        plan's attention); ``keep`` is transformers' ``logits_to_keep`` (0: every row, or the rows'
        indices). With ``fused`` (the caller's choice, from the plan: ``ExecutionPlan.driver_for``) the
        layers run in the fused C calls, and where ``rows_call(k_layer, q_heads, scale)`` (the plan's
        ``rows_call``) offers that attention for C to call, every layer in one C call. Returns
        ``[1, kept, vocab]`` in the model's dtype. Llama-shaped decoders only (``plain``)."""
        h = self.embed(input_ids)
        cos, sin = self.rotary(h, positions)
        if fused:
            h = self._fused(h, cos, sin, write_index, k_pool, v_pool, attend, rows_call)
        else:
            h = self._layers(h, cos, sin, write_index, k_pool, v_pool, attend)
        h = self.norm(h)
        if not (isinstance(keep, int) and keep == 0):
            h = h[:, keep]
        return self.head(h)

    def forward_exact(self, input_ids: torch.Tensor, positions: torch.Tensor, write_index: torch.Tensor,
                      k_pool: list[torch.Tensor], v_pool: list[torch.Tensor], plan: object,
                      keep: torch.Tensor | int) -> torch.Tensor:
        """``forward`` with every row's bits its own (issue 44): whatever the number of rows, every
        layer runs the fused C calls (``FusedLayers.run_all``) with the exact attention of ``plan``
        (an ``engine.model.attention.exact.ExactPlan``: each layer its window, the recipe's soft-cap)
        between them, and the final norm and the head run on our kernels (``FusedLayers.tail``).
        Needs ``exact_ready``. Same arguments and result as ``forward``."""
        h = self.embed(input_ids)
        cos, sin = self.parts.rotary(h, positions)  # [tables, T, d] float32
        dtype, flat = h.dtype, h[0].float().contiguous()
        first = self.layers[0]
        call = plan.call(k_pool[first.index], self.fused.q_width // first.head_dim, first.scaling, self.windows,
                         self.parts.attn_softcap)
        release_signals()  # the consumers' Python runs beside the kernels (compute_thread)
        self.fused.run_all(flat, cos, sin, [k_pool[layer.index] for layer in self.layers],
                           [v_pool[layer.index] for layer in self.layers], write_index.contiguous(), call)
        if not (isinstance(keep, int) and keep == 0):
            flat = flat[keep].contiguous()
        return self.fused.tail.logits(flat).to(dtype).unsqueeze(0)

    @property
    def exact_ready(self) -> bool:
        """Whether ``forward_exact`` can run: the fused layers and their tail built, one attention
        scale for every layer, one head size (the rotary embedding over whole heads: ``DecoderParts``)."""
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
