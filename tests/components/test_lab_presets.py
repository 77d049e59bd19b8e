"""Every preset's good ordering gets a higher hit rate than its bad one, run for real
through the engine on the embedded model (and so does the custom template's suggested
order). Small N keeps this quick; counts, never timings, are compared."""

from __future__ import annotations

import pytest

from analysis.lab.ordering_runs import run_lab_to_end
from analysis.lab.template_lint import lint_template, parse_values
from components.lab_presets import CUSTOM_TEMPLATE, CUSTOM_VALUES, PRESETS, scheduling_queue
from components.panels.lab.tab import custom_variants
from engine.engine import Engine


@pytest.fixture(scope="module")
def engine(real_runner, make_module_engine) -> Engine:
    return make_module_engine(real_runner)


@pytest.mark.slow
@pytest.mark.parametrize("title", list(PRESETS))
def test_good_ordering_beats_bad_on_the_real_model(engine, title):
    good, bad = run_lab_to_end(engine, PRESETS[title].variants(3), max_new_tokens=1, measure_baseline=False)
    assert good.complete and bad.complete
    assert good.prompt_tokens > 0 and bad.prompt_tokens > 0
    assert good.hit_rate > bad.hit_rate + 0.1, (title, good.hit_rate, bad.hit_rate)
    assert good.requests[-1].cached_tokens > bad.requests[-1].cached_tokens
    engine.check_invariants()


@pytest.mark.slow
def test_custom_template_suggested_order_beats_the_original(engine):
    values = "\n".join(CUSTOM_VALUES.splitlines()[:3])
    mine, suggested = custom_variants(CUSTOM_TEMPLATE, "", values)
    assert suggested.name == "Suggested order"
    res_mine, res_suggested = run_lab_to_end(engine, [mine, suggested], measure_baseline=False)
    assert res_suggested.hit_rate > res_mine.hit_rate
    report = lint_template(CUSTOM_TEMPLATE, parse_values(values), lambda s: len(engine.runner.text.encode(s)))
    assert report.warnings and report.reusable_share_suggested > report.reusable_share


def test_presets_are_well_formed():
    for preset in PRESETS.values():
        good, bad = preset.variants(preset.max_requests)
        assert len(good.prompts) == len(bad.prompts) == preset.max_requests
        assert good.name.startswith("Good") and bad.name.startswith("Bad")
        assert good.prompts != bad.prompts
    queue = scheduling_queue(3, 3)
    assert [p.label for p in queue][:4] == ["A1", "B1", "C1", "A2"]
