"""Log-probabilities of chosen tokens, and their most likely alternatives, from logits rows.

Owns: turning fp32 logits rows (the very rows ``sampling`` picks tokens from, or a prompt's
rows) into ``TokenLogprob``s: ``log_softmax`` in float32 over the whole vocabulary, the chosen
token's entry, and the ``top`` most likely by ``torch.topk``. Only requests that ask come
here (the scheduler checks first), so a request without logprobs pays nothing. Like
``sampling``, a pure function of its rows: what else ran in the batch is not an input.
Knows nothing about requests, text or the HTTP shapes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.types import TokenLogprob

# Rows turned into log-probabilities at once: a prompt chunk's [rows, vocab] log-softmax is
# made in blocks, so its scratch stays near ROWS_PER_BLOCK * vocab * 4 bytes (6 MiB at 49,152).
ROWS_PER_BLOCK = 32


def token_logprob(logits: torch.Tensor, token_id: int, top: int) -> TokenLogprob:
    """``token_id``'s log-probability under one row of ``logits`` ``[vocab]``, with the ``top``
    most likely tokens of that row."""
    return logprobs_of(logits.unsqueeze(0), [token_id], top)[0]


def logprobs_of(logits: torch.Tensor, token_ids: Sequence[int], top: int) -> list[TokenLogprob]:
    """Row ``i`` of ``logits`` ``[n, vocab]`` scored for ``token_ids[i]``: n ``TokenLogprob``s."""
    if logits.ndim != 2 or logits.shape[0] != len(token_ids):
        raise ValueError(f"{len(token_ids)} token ids for logits of shape {tuple(logits.shape)}")
    top = max(0, min(int(top), logits.shape[-1]))
    out: list[TokenLogprob] = []
    for start in range(0, len(token_ids), ROWS_PER_BLOCK):
        rows = torch.log_softmax(logits[start:start + ROWS_PER_BLOCK].float(), dim=-1)
        ids = torch.tensor(token_ids[start:start + ROWS_PER_BLOCK], device=rows.device)
        chosen = rows.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
        if top:
            values, indices = torch.topk(rows, top, dim=-1)
            tops = [tuple(zip(i, v, strict=True)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)]
        else:
            tops = [()] * len(chosen)
        out.extend(TokenLogprob(int(t), float(c), tp) for t, c, tp in zip(ids.tolist(), chosen, tops, strict=True))
    return out
