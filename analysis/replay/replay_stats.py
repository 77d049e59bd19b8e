"""What a replay keeps about a log: small aggregates that a report is drawn from.

Owns the report's data, gathered request by request in bounded memory whatever
the log's length:

- totals (cached tokens count both tiers: memory and, when the replay has one, the
  second tier, whose share is also kept on its own) and a per-request series that halves its resolution when it grows
  past ``Series.max_points`` (buckets of 1, 2, 4 ... requests);
- the miss causes: ``analysis.lab.miss_explainer.explain_miss`` run on every
  request against what the cache held before it. The "cached prompt" it is
  compared with comes from a shadow tree (``SimCache`` with ``SHADOW_FACTOR``
  times the budget, no TTL): the path the request shares, then what the tree
  held after it. A prefix that the shadow still holds but the cache no longer
  does was evicted (or expired, under a TTL): that stretch counts as evicted,
  and the rest of the request is explained from where the stretch ends. Per
  cause: requests (by their first miss), computed tokens, and the three worst
  examples as token ids around the miss;
- block granularity: what 16- and 64-token blocks would reuse. A block engine
  matches the same cached sequences, but only whole blocks of them, so its hit
  is this cache's hit rounded down to a block (``analysis.lab.granularity``'s rule;
  exact without eviction, an estimate when the budget evicts, since a block
  engine keeps slightly different tokens);
- the hosted-API cost estimate (``analysis.lab.cost_estimate``), summed chunk by chunk;
- a bounded sample of prompt texts, for template inference and the linter;
- the lines skipped and why.

The miss causes and their tracker live in ``miss_causes.py`` (re-exported here).
``finish()`` turns all that into a ``ReplayReport`` (plain data) and
``summary_text`` into the plain-words summary. Knows nothing about plotting or
the UI; the figures are drawn in ``components.views.replay_report``.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from analysis.lab.cost_estimate import CostEstimate, PricingRules, estimate_cost
from analysis.lab.template_lint import LintReport, TemplateError, lint_template
from analysis.replay.log_formats import LogRecord, SkippedLine
from analysis.replay.miss_causes import (  # noqa: F401 (re-exported: the report's old import paths)
    CAUSES,
    EXPECTED,
    CauseSummary,
    MissExample,
    MissTracker,
)
from analysis.replay.template_infer import InferredTemplate, infer_template
from engine.text.detokenizer import token_pieces
from engine.types import TreeSnapshot

BLOCK_SIZES = (16, 64)
MAX_SKIPPED_KEPT = 200
TEMPLATE_SAMPLES = 48
MAX_SHAPES = 64
COST_CHUNK = 1024
_FIRST_WORDS = re.compile(r"\w+")


# ------------------------------------------------------------------ per-request series
@dataclass
class Series:
    """Per-request numbers in at most ``max_points`` buckets of ``per_bucket`` requests."""

    max_points: int = 2000
    per_bucket: int = 1
    count: list[int] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    prefill_ms: list[float] = field(default_factory=list)
    baseline_ms: list[float] = field(default_factory=list)
    baseline_count: list[int] = field(default_factory=list)

    def add(self, prompt: int, cached: int, prefill_ms: float | None = None, baseline_ms: float | None = None) -> None:
        if not self.count or self.count[-1] >= self.per_bucket:
            if len(self.count) >= self.max_points:
                self._halve()
            for col in self._columns():
                col.append(0)
        self.count[-1] += 1
        self.prompt[-1] += prompt
        self.cached[-1] += cached
        self.prefill_ms[-1] += prefill_ms or 0.0
        if baseline_ms is not None:
            self.baseline_ms[-1] += baseline_ms
            self.baseline_count[-1] += 1

    def _columns(self) -> list[list]:
        return [self.count, self.prompt, self.cached, self.prefill_ms, self.baseline_ms, self.baseline_count]

    def _halve(self) -> None:
        for col in self._columns():
            col[:] = [sum(col[i:i + 2]) for i in range(0, len(col), 2)]
        self.per_bucket *= 2

    def first_request(self) -> list[int]:
        """1-based index of each bucket's first request."""
        return list(itertools.accumulate([1] + self.count[:-1]))


# ------------------------------------------------------------------ the report's data
@dataclass(frozen=True)
class TemplateFinding:
    shape: str  # which prompts it covers: roles and first words, e.g. "system, user: You are the"
    requests_seen: int  # requests of that shape in the sample
    inferred: InferredTemplate
    lint: LintReport


@dataclass(frozen=True)
class ReplayReport:
    mode: str  # "simulation" (no model: hits, tokens, cost) or "measured" (real model: also timings)
    model: str
    log_name: str
    budget_tokens: int | None
    kv_bytes_per_token: int
    ttl_s: float | None
    requests: int
    prompt_tokens: int
    cached_tokens: int
    evicted_tokens: int
    expired_tokens: int
    peak_cached_tokens: int
    series: Series
    causes: tuple[CauseSummary, ...]
    granularity: dict[int, int]  # block size -> cached tokens (1 = this cache)
    cost: CostEstimate
    pricing: PricingRules
    templates: tuple[TemplateFinding, ...]
    skipped: tuple[SkippedLine, ...]  # the first MAX_SKIPPED_KEPT
    skipped_count: int
    late_count: int  # requests replayed out of timestamp order (beyond the reorder window)
    formats: dict[str, int]
    tree: TreeSnapshot | None
    stopped: bool  # Ctrl-C: covers the requests replayed so far
    elapsed_s: float
    prefill_ms: float | None = None  # measured mode only
    baseline_prefill_ms: float | None = None  # summed over requests that measured it
    reuse_prefill_ms_measured: float | None = None  # with reuse, over those same requests
    notes: tuple[str, ...] = ()
    tier_tokens: int = 0  # of ``cached_tokens``, served from the second tier
    tier_budget_bytes: int | None = None  # None: the replay had no second tier

    @property
    def has_tier(self) -> bool:
        return self.tier_budget_bytes is not None

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


class ReplayStats:
    """Collects a replay request by request; ``finish`` gives the ``ReplayReport``."""

    def __init__(self, budget_tokens: int | None, decode: Callable[[Sequence[int]], str],
                 count_tokens: Callable[[str], int], special_ids: Collection[int] = (), ttl_s: float | None = None,
                 pricing: PricingRules = PricingRules()) -> None:
        self.budget_tokens, self.decode, self.count_tokens, self.ttl_s = budget_tokens, decode, count_tokens, ttl_s
        self.pricing = pricing.validated()
        self.misses = MissTracker(budget_tokens, decode, special_ids, ttl_s)
        self.block_cached = dict.fromkeys(BLOCK_SIZES, 0)
        self.series = Series()
        self.requests = self.prompt_tokens = self.cached_tokens = self.tier_tokens = 0
        self.prefill_ms = self.baseline_ms = self.reuse_ms_measured = 0.0
        self.baseline_n = 0
        self.formats: Counter[str] = Counter()
        self.skipped: list[SkippedLine] = []
        self.skipped_count = 0
        self._cost_chunk: list[tuple[int, int]] = []
        self._cost: list[CostEstimate] = []
        self._samples: dict[str, list[str]] = {}
        self._shape_counts: Counter[str] = Counter()

    def skip(self, skipped: SkippedLine) -> None:
        self.skipped_count += 1
        if len(self.skipped) < MAX_SKIPPED_KEPT:
            self.skipped.append(skipped)

    def observe(self, record: LogRecord, ids: Sequence[int], inserted: Sequence[int], cached: int, text: str,
                now: float, prefill_ms: float | None = None, baseline_ms: float | None = None,
                tier_tokens: int = 0) -> str:
        """One replayed request (``cached`` tokens from both tiers, ``tier_tokens`` of them from
        the second); returns its miss cause."""
        self.requests += 1
        self.prompt_tokens += len(ids)
        self.cached_tokens += cached
        self.tier_tokens += tier_tokens
        self.formats[record.fmt] += 1
        self.series.add(len(ids), cached, prefill_ms, baseline_ms)
        if prefill_ms is not None:
            self.prefill_ms += prefill_ms
            if baseline_ms is not None:
                self.baseline_ms += baseline_ms
                self.reuse_ms_measured += prefill_ms
                self.baseline_n += 1
        kind = self.misses.observe(self.requests, record.line, ids, inserted, cached, record.session, now)
        for b in BLOCK_SIZES:  # a block engine reuses the same match, rounded down to whole blocks
            self.block_cached[b] += cached - cached % b
        self._cost_chunk.append((len(ids), cached))
        if len(self._cost_chunk) >= COST_CHUNK:
            self._flush_cost()
        self._sample(record, text)
        return kind

    def _flush_cost(self) -> None:
        if self._cost_chunk:
            self._cost.append(estimate_cost(self._cost_chunk, self.pricing))
            self._cost_chunk = []

    def _sample(self, record: LogRecord, text: str) -> None:
        """Keep a few prompt texts per shape: single-turn prompts grouped by their roles and
        the first words of their first message (a multi-turn chat only appends, which is
        what a prefix cache wants: no template to lint there)."""
        if record.messages is None:
            shape = "raw prompt: " + " ".join(_FIRST_WORDS.findall(record.prompt or "")[:3])
        elif sum(m["role"] == "user" for m in record.messages) == 1:
            first = " ".join(_FIRST_WORDS.findall(record.messages[0]["content"])[:3])
            shape = ", ".join(m["role"] for m in record.messages) + f": {first}"
        else:
            return
        if shape not in self._samples and len(self._samples) >= MAX_SHAPES:
            return
        self._shape_counts[shape] += 1
        bucket = self._samples.setdefault(shape, [])
        if len(bucket) < TEMPLATE_SAMPLES and text not in bucket:
            bucket.append(text)

    def templates(self, max_shapes: int = 3) -> list[TemplateFinding]:
        out = []
        for shape, n in self._shape_counts.most_common(max_shapes):
            inferred = infer_template(self._samples.get(shape, []))
            if inferred is None:
                continue
            try:
                lint = lint_template(inferred.template, inferred.values, self.count_tokens)
            except TemplateError:
                continue
            out.append(TemplateFinding(shape, n, inferred, lint))
        return out

    def finish(self, mode: str, model: str, log_name: str, kv_bytes_per_token: int, tree: TreeSnapshot | None,
               stopped: bool, elapsed_s: float, late_count: int = 0, evicted_tokens: int = 0,
               expired_tokens: int = 0, peak_cached_tokens: int = 0, notes: Sequence[str] = (),
               tier_budget_bytes: int | None = None) -> ReplayReport:
        self._flush_cost()
        cost = CostEstimate(sum(c.requests for c in self._cost), sum(c.prompt_tokens for c in self._cost),
                            sum(c.billed_cached_tokens for c in self._cost),
                            sum(c.usd_without_caching for c in self._cost), sum(c.usd_with_caching for c in self._cost))
        measured = mode == "measured"
        return ReplayReport(
            mode=mode, model=model, log_name=log_name, budget_tokens=self.budget_tokens,
            kv_bytes_per_token=kv_bytes_per_token, ttl_s=self.ttl_s, requests=self.requests,
            prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens, evicted_tokens=evicted_tokens,
            expired_tokens=expired_tokens, peak_cached_tokens=peak_cached_tokens, series=self.series,
            causes=tuple(self.misses.summaries(lambda ids: token_pieces(self.decode, ids))),
            granularity={1: self.cached_tokens, **self.block_cached}, cost=cost, pricing=self.pricing,
            templates=tuple(self.templates()), skipped=tuple(self.skipped), skipped_count=self.skipped_count,
            late_count=late_count, formats=dict(self.formats), tree=tree, stopped=stopped, elapsed_s=elapsed_s,
            prefill_ms=self.prefill_ms if measured else None,
            baseline_prefill_ms=self.baseline_ms if measured and self.baseline_n else None,
            reuse_prefill_ms_measured=self.reuse_ms_measured if measured and self.baseline_n else None,
            notes=tuple(notes), tier_tokens=self.tier_tokens, tier_budget_bytes=tier_budget_bytes)


# ------------------------------------------------------------------ plain words
def biggest_loss(report: ReplayReport) -> CauseSummary | None:
    """The cause with the most computed tokens that a change could avoid."""
    return next((c for c in report.causes if c.kind not in EXPECTED and c.computed_tokens > 0), None)


def percent(share: float) -> str:
    """A share for people: "under 1%" rather than a rounded "0%" or "1%" for small ones."""
    return "under 1%" if 0 < share < 0.01 else f"{max(0.0, share):.0%}"


def summary_text(report: ReplayReport) -> str:
    """The report's first paragraph, in plain words."""
    if not report.requests:
        return ("No request was replayed" + (f": all {report.skipped_count:,} lines were skipped (see the list "
                                             "below)." if report.skipped_count else "."))
    verb = "would serve" if report.mode == "simulation" else "served"
    text = (f"On this log, prefix caching {verb} {report.hit_rate:.0%} of prompt tokens from cache "
            f"({report.cached_tokens:,} of {report.prompt_tokens:,} over {report.requests:,} requests).")
    if report.has_tier:
        text += (f" Of those, {report.tier_tokens:,} ({percent(report.tier_tokens / report.prompt_tokens)} of "
                 f"prompt tokens) came back from the {report.tier_budget_bytes / 2**20:,.0f} MiB second tier "
                 "instead of being recomputed after eviction.")
    loss = biggest_loss(report)
    if loss is None:
        text += " Nothing avoidable was lost: the computed tokens are each request's own new content."
    else:
        text += (f" The biggest loss is {loss.label}: {loss.share_of_computed:.0%} of computed tokens "
                 f"({loss.computed_tokens:,} tokens in {loss.requests:,} requests)")
        text += f"; {loss.advice}." if loss.advice else "."
    if report.baseline_prefill_ms and report.reuse_prefill_ms_measured:
        text += (f" Measured prefill: {report.reuse_prefill_ms_measured / 1000:,.1f} s with reuse vs "
                 f"{report.baseline_prefill_ms / 1000:,.1f} s without.")
    if report.cost.billed_cached_tokens > 0:
        text += (f" On a hosted API with prompt caching (estimate), input would cost "
                 f"{percent(report.cost.saving_share)} less.")
    elif report.cost.requests:
        text += (f" A hosted API would bill nothing as cached: no cached prefix reached its "
                 f"{report.pricing.min_cacheable_tokens:,}-token minimum.")
    if report.stopped:
        text += f" Stopped early: this covers the first {report.requests:,} requests."
    return text
