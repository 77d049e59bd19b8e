"""Picking the next token: greedy, temperature, top-p, seed, and the loop guards.

Owns: turning one row of logits into one token id. Everything here is a pure
function of the logits, the answer so far and the parameters (plus the
request's own seeded generator), so a token never depends on what else ran in
the same batch or on whether the prompt came from the cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.types import SamplingParams


def banned_by_ngram(history: Sequence[int], n: int) -> set[int]:
    """Tokens that would repeat an ``n``-gram already in ``history``.

    With ``n = 3`` and history ``a b c a b``, ``c`` is banned: ``a b c`` exists.
    """
    if n <= 0 or len(history) < n:
        return set()
    if n == 1:
        return set(history)
    tail = tuple(history[-(n - 1):])
    return {history[i + n - 1] for i in range(len(history) - n + 1) if tuple(history[i:i + n - 1]) == tail}


def guard_logits(logits: torch.Tensor, history: Sequence[int], params: SamplingParams) -> torch.Tensor:
    """``logits`` with the loop guards applied (a new tensor; the input is not changed)."""
    penalty = float(params.repetition_penalty)
    n = int(params.no_repeat_ngram_size)
    if not history or (penalty == 1.0 and n <= 0):
        return logits
    out = logits.clone()
    if penalty != 1.0:
        seen = torch.tensor(sorted(set(history)), device=out.device)
        vals = out[seen]
        out[seen] = torch.where(vals > 0, vals / penalty, vals * penalty)
    banned = banned_by_ngram(history, n)
    if banned and len(banned) < out.shape[-1]:
        out[torch.tensor(sorted(banned), device=out.device)] = float("-inf")
    return out


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           history: Sequence[int] = ()) -> int:
    """One token from fp32 ``logits`` (one row); ``history`` is the answer so far."""
    logits = guard_logits(logits, history, params)
    if params.temperature <= 0:
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.ndim == 1:
            # the same first-of-the-largest index (NaN counted largest, as torch's) without an
            # ATen dispatch: 6 us against 57-150 on one decode step's 49,152 logits here
            return int(logits.numpy().argmax())
        return int(torch.argmax(logits))
    # Shifted by the max first: the same distribution, but a tiny temperature cannot
    # overflow to inf (and NaN after softmax); it tends to greedy instead.
    probs = torch.softmax((logits - logits.max()) / params.temperature, dim=-1)
    if not bool(torch.isfinite(probs).all()):
        return int(torch.argmax(logits))
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < params.top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        probs = probs / probs.sum()
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
