"""transformers' own forward reading the KV pool: the ``transformers`` layer driver's attention.

Owns: the attention function registered in transformers under ``PAGED_ATTENTION`` (inside
``reading_pool`` every request attends over its slots in the pool through the step's
``PagedPlan``; outside it, plain SDPA), ``enable(model)`` (that driver's start-up check: switch the
model to it where that is exact), and ``cache_argument``, the name of a forward's cache argument on
this transformers line. Knows nothing of the runner, requests or the tree.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator

import torch

from engine.types import EngineError

PAGED_ATTENTION = "radix_paged"
_batch = threading.local()  # the plan and pool of the paged forward running on this thread, if any


def _paged_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA, except inside ``reading_pool``: there every request attends over its slots in the pool
    (``engine.model.paged_attention``: a shared prefix read once for all). Outside it, plain SDPA with
    SDPA's masks: single-request paths are unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    paged = getattr(_batch, "paged", None)
    if paged is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        raise EngineError("this model's attention (soft-capping or position bias) cannot read the KV pool")
    plan, pool = paged
    scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
    return plan.attention(pool.k[module.layer_idx], pool.v[module.layer_idx], query, scale), None


@contextlib.contextmanager
def reading_pool(plan, pool) -> Iterator[None]:
    """transformers' forwards on this thread attend over ``pool`` through ``plan`` (a ``PagedPlan``)."""
    _batch.paged = (plan, pool)
    try:
        yield
    finally:
        _batch.paged = None


def enable(model: torch.nn.Module) -> str:
    """Switch ``model`` to the pool-reading attention, where that is exact: SDPA models with full
    attention in every layer (no sliding window, no logit soft-capping); "" then, else why not."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    cfg = model.config.get_text_config(decoder=True)
    if getattr(cfg, "sliding_window", None) or getattr(cfg, "attn_logit_softcapping", None):
        return "a sliding window or logit soft-capping: attention over the pool would not be exact"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
        return "a layer without full attention"
    if model.config._attn_implementation not in ("sdpa", PAGED_ATTENTION):
        return f"the model's attention is {model.config._attn_implementation}, not SDPA"
    try:
        AttentionInterface.register(PAGED_ATTENTION, _paged_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(PAGED_ATTENTION, sdpa_mask)
        model.set_attn_implementation(PAGED_ATTENTION)
    except Exception as exc:  # noqa: BLE001 - an architecture that does not take registered attention
        return f"the model does not take registered attention ({exc})"
    if model.config._attn_implementation != PAGED_ATTENTION:
        return "the model does not take registered attention"
    return ""


def cache_argument(model: torch.nn.Module) -> str:
    """The name of the forward's cache argument: ``cache`` on the transformers line this project pins
    (5.24), ``past_key_values`` on older ones (5.17, the GPU machine's). Read off the signature once,
    never tried: an old forward takes an unknown ``cache=`` into its ``**kwargs`` and runs on a cache
    of its own, silently, while a new one only warns about ``past_key_values=``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
