"""The hosted-API cost estimate follows its rules: a minimum cacheable length,
increments past it, cached input at a fraction of the price, a length factor."""

from __future__ import annotations

import pytest

from analysis.lab.cost_estimate import PricingRules, billed_cached_tokens, estimate_cost
from engine.types import EngineError

RULES = PricingRules(input_usd_per_mtok=2.0, cached_fraction=0.5, min_cacheable_tokens=1024, increment_tokens=128)


@pytest.mark.parametrize("cached,billed", [(0, 0), (1023, 0), (1024, 1024), (1151, 1024), (1152, 1152),
                                           (1300, 1280), (5000, 4992)])
def test_billed_cached_tokens(cached, billed):
    assert billed_cached_tokens(cached, RULES) == billed


def test_cost_follows_the_rules():
    est = estimate_cost([(2000, 1300), (800, 700)], RULES)
    price = 2.0 / 1e6
    expected = (2000 - 1280) * price + 1280 * price * 0.5 + 800 * price  # the second is under the minimum
    assert est.usd_with_caching == pytest.approx(expected)
    assert est.usd_without_caching == pytest.approx(2800 * price)
    assert est.billed_cached_tokens == 1280
    assert est.saving_share == pytest.approx(1 - expected / (2800 * price))
    assert est.per_thousand_requests(est.usd_with_caching) == pytest.approx(expected * 500)


def test_scale_and_edge_rules():
    est = estimate_cost([(500, 450)], RULES, scale=4)  # 2000 prompt tokens, 1800 cached -> 1792 billed
    assert est.prompt_tokens == 2000 and est.billed_cached_tokens == 1792
    free = estimate_cost([(2000, 1999)], PricingRules(1.0, 0.0, 0, 1))
    assert free.usd_with_caching == pytest.approx(1 / 1e6)
    assert estimate_cost([], RULES).usd_without_caching == 0
    for bad in (PricingRules(-1), PricingRules(cached_fraction=1.5), PricingRules(increment_tokens=0),
                PricingRules(min_cacheable_tokens=-5)):
        with pytest.raises(EngineError):
            estimate_cost([(10, 5)], bad)
    with pytest.raises(EngineError):
        estimate_cost([(10, 5)], RULES, scale=0)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_numbers_are_refused(bad):
    with pytest.raises(EngineError):
        estimate_cost([(10, 5)], PricingRules(input_usd_per_mtok=bad))
    with pytest.raises(EngineError):
        estimate_cost([(10, 5)], RULES, scale=bad)
