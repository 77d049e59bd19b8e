"""Why a replayed request missed: the causes, tracked request by request in bounded memory.

Owns: ``CAUSES`` (each kind in plain words, and what to do), ``EXPECTED`` (the kinds that are
nobody's fault), ``MissExample`` and ``CauseSummary``, and ``MissTracker``, which runs
``analysis.lab.miss_explainer.explain_miss`` on every request against a shadow tree (``SimCache``
with ``SHADOW_FACTOR`` times the budget, no TTL; see ``replay_stats``' docstring for the rule) and
keeps per cause the requests, the computed tokens and the worst examples. ``replay_stats`` owns
the rest of what a replay keeps, and re-exports these. Knows nothing about plotting or the UI.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from analysis.lab.miss_explainer import explain_miss
from analysis.replay.sim_cache import SimCache

SHADOW_FACTOR = 4


EXAMPLES_PER_CAUSE = 3


CONTEXT_BEFORE, CONTEXT_AFTER = 24, 40


# kind -> (what it is, in plain words; what to do)
CAUSES: dict[str, tuple[str, str]] = {
    "per-request-value": ("a value that changes per request sits before static text",
                          "move timestamps, ids and questions after the static text"),
    "reordered": ("the same blocks arrive in a different order",
                  "keep shared blocks (examples, documents) in one fixed order"),
    "rewritten": ("content differs from everything cached (rewritten or new per request)",
                  "keep earlier content verbatim and append new content at the end"),
    "whitespace": ("only whitespace differs", "normalise whitespace when you build prompts"),
    "template": ("the same text is tokenized differently (template differences)",
                 "build every prompt through the same template code"),
    "evicted": ("prefixes were evicted before they were reused (budget too small)",
                "a larger cache budget would keep them"),
    "expired": ("prefixes expired (time-to-live) before they were reused",
                "a longer TTL, or more frequent requests, would keep them"),
    "new-content": ("each request's own new content at the end (expected)", ""),
    "cold": ("the first request (nothing cached yet)", ""),
    "full-hit": ("nothing: the whole prompt came from the cache but its last token", ""),
}
EXPECTED = ("new-content", "cold", "full-hit")


# ------------------------------------------------------------------ miss causes
@dataclass(frozen=True)
class MissExample:
    line: int
    request: int  # 1-based order in the replay
    kind: str
    reason: str
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    before_ids: tuple[int, ...]  # served from the cache, just before the miss
    after_ids: tuple[int, ...]  # computed, from the miss on
    cached_after_ids: tuple[int, ...]  # what the cache held there instead
    before_pieces: tuple[str, ...] = ()  # filled by ``finish`` (token by token, for display)
    after_pieces: tuple[str, ...] = ()
    cached_after_pieces: tuple[str, ...] = ()


@dataclass(frozen=True)
class CauseSummary:
    kind: str
    label: str
    advice: str
    requests: int
    computed_tokens: int
    share_of_computed: float
    recomputed_identical_tokens: int  # per-request values: identical text computed again
    examples: tuple[MissExample, ...]


class MissTracker:
    """Explains every request's miss against a shadow of the cache (see module docstring)."""

    def __init__(self, budget_tokens: int | None, decode: Callable[[Sequence[int]], str],
                 special_ids: Collection[int] = (), ttl_s: float | None = None) -> None:
        shadow_budget = None if budget_tokens is None else budget_tokens * SHADOW_FACTOR
        self.shadow = SimCache(shadow_budget)
        self.decode, self.special_ids, self.ttl_s = decode, frozenset(special_ids), ttl_s
        self.tokens: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        self.identical: Counter[str] = Counter()
        self._worst: dict[str, list[tuple[int, int, MissExample]]] = {}
        self._seq = itertools.count()

    def observe(self, index: int, line: int, ids: Sequence[int], inserted: Sequence[int], cached: int,
                namespace: str, now: float) -> str:
        """Explain one request (``cached`` tokens were served), then record it in the shadow."""
        computed = len(ids) - cached
        if not self.shadow.tree.num_tokens:
            kind, reason, ex = "cold", CAUSES["cold"][0], None
        else:
            known, ref = self.shadow.continuation(ids, namespace)
            ex = explain_miss(ids, [ref], self.decode, cached_tokens=cached, special_ids=self.special_ids,
                              context_tokens=8)
            kind, reason = ex.kind, ex.reason
            if kind == "evicted" and self.ttl_s is not None:
                last = self.shadow.last_access_of(ids, namespace)
                if last is not None and now - last > self.ttl_s:
                    kind = "expired"
                    reason = (f"The cache had held {known - cached:,} more tokens of this prompt, but nobody used "
                              f"them for {now - last:,.0f} s, longer than the {self.ttl_s:,.0f} s time-to-live: "
                              "they expired before this request.")
            self._keep_example(kind, MissExample(
                line, index, kind, reason, len(ids), cached, computed,
                tuple(ids[max(0, cached - CONTEXT_BEFORE):cached]), tuple(ids[cached:cached + CONTEXT_AFTER]),
                tuple(ref[cached:cached + CONTEXT_AFTER]) if len(ref) > cached else ()))
        rest_kind = None
        if ex is not None and kind in ("evicted", "expired") and known < len(ids):
            # Only the evicted stretch is the eviction's fault; what comes after it is explained
            # as if the stretch had been served (for example new content, or a changed value).
            rest = explain_miss(ids, [ref], self.decode, cached_tokens=known, special_ids=self.special_ids,
                                context_tokens=8)
            rest_kind = rest.kind
            self.tokens[rest_kind] += len(ids) - known
            self.identical[rest_kind] += rest.recomputed_identical_tokens
            computed = known - cached
        self.tokens[kind] += computed
        self.requests[kind] += 1
        if ex is not None and rest_kind is None:
            self.identical[kind] += ex.recomputed_identical_tokens
        self.shadow.record(inserted, namespace, now)
        return kind

    def _keep_example(self, kind: str, example: MissExample) -> None:
        if kind == "full-hit":
            return
        heap = self._worst.setdefault(kind, [])
        item = (example.computed_tokens, -next(self._seq), example)  # ties: the earliest stays
        if len(heap) < EXAMPLES_PER_CAUSE:
            heapq.heappush(heap, item)
        elif item[:2] > heap[0][:2]:
            heapq.heapreplace(heap, item)

    def summaries(self, pieces: Callable[[Sequence[int]], list[str]]) -> list[CauseSummary]:
        total = sum(self.tokens.values())
        out = []
        for kind, tokens in self.tokens.most_common():
            worst = sorted(self._worst.get(kind, []), reverse=True)
            examples = tuple(_with_pieces(e, pieces) for _, _, e in worst)
            label, advice = CAUSES.get(kind, (kind, ""))
            out.append(CauseSummary(kind, label, advice, self.requests[kind], tokens,
                                    tokens / total if total else 0.0, self.identical[kind], examples))
        return out


def _with_pieces(e: MissExample, pieces: Callable[[Sequence[int]], list[str]]) -> MissExample:
    return MissExample(**{**e.__dict__, "before_pieces": tuple(pieces(e.before_ids)),
                          "after_pieces": tuple(pieces(e.after_ids)),
                          "cached_after_pieces": tuple(pieces(e.cached_after_ids))})
