"""Hosted-API cost estimate: what a run's prompts would cost with a provider's prompt caching.

An ESTIMATE, labelled as such wherever it is shown. It applies pricing rules of
the kind hosted APIs document for automatic prompt caching, every one a
parameter. The defaults follow OpenAI's documented rules for automatic prompt
caching (it starts at 1,024 prompt tokens and cache hits count in 128-token
increments); the cached-input fraction differs by model and provider (from 10%
to 50% of the input price at the time of writing), so check the current
pricing page and edit the parameters:

- ``input_usd_per_mtok``: price of one million uncached input tokens;
- ``cached_fraction``: cached input tokens cost this fraction of that price;
- ``min_cacheable_tokens``: a prefix shorter than this is never billed as cached;
- ``increment_tokens``: beyond the minimum, the billed cached length grows in
  steps of this many tokens (a match is rounded down to a step).

So a request whose longest cached prefix is ``c`` tokens is billed::

    cached = 0                                          if c < min_cacheable
           = min + floor((c - min) / increment) * increment   otherwise
    cost   = (prompt - cached) * price + cached * price * cached_fraction

Token counts can be scaled first (``scale``): the demo's prompts are shorter than
most production prompts, and the minimum length matters. Output tokens are not
included. Knows nothing about the UI.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from engine.types import EngineError


@dataclass(frozen=True)
class PricingRules:
    input_usd_per_mtok: float = 2.50
    cached_fraction: float = 0.5
    min_cacheable_tokens: int = 1024
    increment_tokens: int = 128

    def validated(self) -> PricingRules:
        numbers = (self.input_usd_per_mtok, self.cached_fraction, self.min_cacheable_tokens, self.increment_tokens)
        if not all(isinstance(x, int | float) and math.isfinite(x) for x in numbers):
            raise EngineError("Every pricing parameter must be a finite number.")
        if self.input_usd_per_mtok < 0:
            raise EngineError("The input price cannot be negative.")
        if not 0 <= self.cached_fraction <= 1:
            raise EngineError("The cached-input fraction must be between 0 and 1.")
        if self.min_cacheable_tokens < 0:
            raise EngineError("The minimum cacheable length cannot be negative.")
        if self.increment_tokens < 1:
            raise EngineError("The increment must be at least 1 token.")
        return self


@dataclass(frozen=True)
class CostEstimate:
    requests: int
    prompt_tokens: int  # after scaling
    billed_cached_tokens: int
    usd_without_caching: float
    usd_with_caching: float

    @property
    def saving_share(self) -> float:
        return 1 - self.usd_with_caching / self.usd_without_caching if self.usd_without_caching else 0.0

    def per_thousand_requests(self, usd: float) -> float:
        return usd * 1000 / self.requests if self.requests else 0.0


def billed_cached_tokens(cached_tokens: int, rules: PricingRules) -> int:
    """The part of a ``cached_tokens`` prefix hit that the rules bill at the cached price."""
    if cached_tokens < max(1, rules.min_cacheable_tokens):
        return 0
    extra = cached_tokens - rules.min_cacheable_tokens
    return rules.min_cacheable_tokens + extra - extra % rules.increment_tokens


def estimate_cost(requests: Sequence[tuple[int, int]], rules: PricingRules = PricingRules(),
                  scale: float = 1.0) -> CostEstimate:
    """``requests``: ``(prompt_tokens, cached_tokens)`` per request, as measured."""
    rules = rules.validated()
    if not (isinstance(scale, int | float) and math.isfinite(scale)) or not 0 < scale <= 1000:
        raise EngineError("The prompt-length factor must be a number between 0 and 1,000.")
    price = rules.input_usd_per_mtok / 1e6
    prompt_total = cached_total = 0
    with_cache = 0.0
    for prompt, cached in requests:
        p, c = round(prompt * scale), round(min(cached, prompt) * scale)
        billed = billed_cached_tokens(c, rules)
        prompt_total += p
        cached_total += billed
        with_cache += (p - billed) * price + billed * price * rules.cached_fraction
    return CostEstimate(len(requests), prompt_total, cached_total, prompt_total * price, with_cache)
