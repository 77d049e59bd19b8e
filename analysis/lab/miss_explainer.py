"""The miss explainer: where a request left the longest cached path, and why.

Owns: finding the first computed token of a request against the sequences that
were cached before it, the text around that point, and a plain-language reason
when one can be detected from the token ids:

- ``per-request-value``: a short stretch differs, then the two prompts agree
  again for a while (a timestamp, a request id, a question placed before static
  text): the identical text after it was computed again;
- ``reordered``: the text that follows is in the cached prompt too, elsewhere
  (shuffled examples, documents in a per-request order);
- ``whitespace``: only whitespace differs;
- ``template``: the same text split into different tokens, or two different
  template markers (special tokens) face each other;
- ``new-content`` / ``rewritten``: the request's own new text (expected), or a
  large part that differs from everything cached (rewritten per request);
- ``cold``, ``full-hit``, ``evicted``: nothing cached yet, nothing missed, or the
  prefix was cached once but evicted.

Pure: works on token ids and a ``decode`` callable. Knows nothing about the UI.
::

    request:  [ .... served from cache .... ) [ computed from here ...
    cached:   [ .... same tokens ........... ) [ what the cache had next ...
                                              ^ position
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from engine.kvcache.radix_tree import common_prefix_len

VALUE_MAX_TOKENS = 24  # a "value" that differs is at most this long ...
RESYNC_MIN_TOKENS = 12  # ... and is followed by at least this many identical tokens
BLOCK_TOKENS = 8  # n-gram used to find a block again elsewhere
REORDER_MIN_TOKENS = 16  # a moved block shares at least this many tokens


@dataclass(frozen=True)
class MissExplanation:
    position: int  # index of the first computed prompt token
    prompt_tokens: int
    cached_tokens: int
    kind: str
    reason: str
    before_text: str  # text just before ``position`` (served from the cache)
    after_text: str  # the request's text from ``position`` on (computed)
    cached_after_text: str  # what the cached path continued with at ``position``
    reference_index: int | None  # which reference the request shared its longest prefix with
    changed_text: str = ""  # for per-request values: this request's value ...
    cached_changed_text: str = ""  # ... and the cached prompt's
    recomputed_identical_tokens: int = 0  # identical tokens after a changed value, computed anyway


def explain_miss(ids: Sequence[int], references: Sequence[Sequence[int]], decode: Callable[[Sequence[int]], str],
                 cached_tokens: int | None = None, special_ids: Collection[int] = (),
                 context_tokens: int = 24) -> MissExplanation:
    """Explain where ``ids`` left the cache. ``references`` are the sequences cached
    before it (in order); ``cached_tokens`` is the engine's measured count, if known
    (it wins over the count recomputed from the references)."""
    ids = list(ids)
    n = len(ids)
    best_i, best_len = None, 0
    for i, ref in enumerate(references):
        k = common_prefix_len(ids, ref)
        if best_i is None or k > best_len:
            best_i, best_len = i, k
    pos = min(best_len, max(0, n - 1)) if cached_tokens is None else int(cached_tokens)
    ref = list(references[best_i]) if best_i is not None else []

    def ctx(seq: Sequence[int], start: int, end: int) -> str:
        return decode(seq[max(0, start):max(0, end)]) if end > start else ""

    base = dict(position=pos, prompt_tokens=n, cached_tokens=pos, before_text=ctx(ids, pos - context_tokens, pos),
                after_text=ctx(ids, pos, pos + context_tokens), reference_index=best_i,
                cached_after_text=ctx(ref, pos, pos + context_tokens) if best_len >= pos else "")

    def result(kind: str, reason: str, **extra) -> MissExplanation:
        return MissExplanation(kind=kind, reason=reason, **{**base, **extra})

    if best_i is None:
        return result("cold", "Nothing was cached before this request, so every token was computed "
                              "(a cold start: the first request of a run always pays the full prefill).")
    if pos >= n - 1 and n > 0:
        return result("full-hit", "The whole prompt was served from the cache except its last token, which is "
                                  "always computed to produce the logits for the first output token.")
    if best_len > pos:
        return result("evicted", f"The cache had held {best_len - pos:,} more tokens of this prompt (from an earlier "
                                 "request), but they were evicted before this request ran: the cache budget was "
                                 "too small to keep them.")
    a, b = ids[pos:], ref[pos:]
    if not b:
        return _new_or_rewritten(result, len(a), n, appended=True)

    ta, tb = decode(a[:16]), decode(b[:16])
    k = min(len(ta), len(tb))
    if k > 0 and ta[:k] == tb[:k]:
        return result("template", "The text here is the same as in the cached prompt, but it was split into "
                                  "different tokens (for example '\\n\\n' against '\\n' + '\\n', or text glued to a "
                                  "template marker). Prefix caches match token ids, not text: build every prompt "
                                  "through the same template code.")
    if a[0] in special_ids and b[0] in special_ids:
        return result("template", f"A chat-template marker differs here: this request has {_q(decode(a[:1]))} "
                                  f"where the cached prompt has {_q(decode(b[:1]))}. The two prompts were built with "
                                  "a different message layout or template.")
    na, nb = _squash(decode(a[:32])), _squash(decode(b[:32]))
    k = min(len(na), len(nb), 40)
    if k >= 4 and na[:k] == nb[:k]:
        return result("whitespace", "Only whitespace differs here (a space, a newline or indentation): invisible on "
                                    "screen, but a different token, so everything after it was computed again. "
                                    "Normalise whitespace when you build prompts.")

    value = _resync(a, b)
    moved = _moved_block(a, b)
    if value is not None and (moved is None or max(value[0], value[1]) <= VALUE_MAX_TOKENS // 2):
        i, j, run = value
        mine, theirs = decode(a[:i]).strip(), decode(b[:j]).strip()
        return result("per-request-value",
                      f"Text that changes per request sits here ({_q(mine)} in this request, {_q(theirs)} in the "
                      f"cached prompt), and the {run:,} tokens after it are identical to the cached prompt but were "
                      "computed again: a prefix cache reuses only up to the first difference. Move values that "
                      "change per request (timestamps, ids, the question) after the static text.",
                      changed_text=mine, cached_changed_text=theirs, recomputed_identical_tokens=run)
    if moved is not None:
        return result("reordered", f"The text that follows here also appears in the cached prompt, but in another "
                                   f"place ({moved:,} tokens in common as a block): the same blocks in a different "
                                   "order (shuffled examples, documents sorted per request). Keep shared blocks in "
                                   "one fixed order.")
    return _new_or_rewritten(result, len(a), n, appended=False)


def _new_or_rewritten(result, remaining: int, n: int, appended: bool) -> MissExplanation:
    if remaining <= max(64, n // 4):
        start = "This request extends a cached prompt" if appended else "This is where the request's own content starts"
        return result("new-content", f"{start}: its last {remaining:,} tokens are new. That miss is expected; "
                                     "everything before it came from the cache.")
    return result("rewritten", f"From here on ({remaining:,} tokens, {remaining / n:.0%} of the prompt) the request "
                               "differs from everything cached. Content that is rewritten for every request (a "
                               "re-summarised history, regenerated context) cannot be reused: keep earlier content "
                               "verbatim and append new content at the end.")


def _resync(a: Sequence[int], b: Sequence[int]) -> tuple[int, int, int] | None:
    """Smallest skips ``(i, j)`` (each <= VALUE_MAX_TOKENS) after which ``a`` and ``b``
    agree again for at least RESYNC_MIN_TOKENS tokens; returns ``(i, j, run)``."""
    window = VALUE_MAX_TOKENS
    grams: dict[tuple[int, ...], list[int]] = {}
    for j in range(min(window, len(b) - RESYNC_MIN_TOKENS) + 1):
        grams.setdefault(tuple(b[j:j + RESYNC_MIN_TOKENS]), []).append(j)
    best = None
    for i in range(min(window, len(a) - RESYNC_MIN_TOKENS) + 1):
        for j in grams.get(tuple(a[i:i + RESYNC_MIN_TOKENS]), []):
            if i == 0 and j == 0:
                continue
            if best is None or i + j < best[0] + best[1]:
                best = (i, j)
    if best is None:
        return None
    i, j = best
    return i, j, common_prefix_len(a[i:], b[j:])


def _moved_block(a: Sequence[int], b: Sequence[int]) -> int | None:
    """If the block starting ``a`` occurs later in ``b`` (or the block starting ``b``
    later in ``a``), the length of the longer such shared run."""
    best = 0
    for x, y in ((a, b), (b, a)):
        if len(x) < BLOCK_TOKENS:
            continue
        gram = tuple(x[:BLOCK_TOKENS])
        for j in range(1, len(y) - BLOCK_TOKENS + 1):
            if tuple(y[j:j + BLOCK_TOKENS]) == gram:
                best = max(best, common_prefix_len(x, y[j:]))
    return best if best >= REORDER_MIN_TOKENS else None


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _q(text: str, limit: int = 60) -> str:
    text = " ".join(text.split())
    return "“" + (text if len(text) <= limit else text[: limit - 1] + "…") + "”"
