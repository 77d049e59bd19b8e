"""Template inference from logged prompts: what differs becomes a part, outliers are passed over."""

from __future__ import annotations

from analysis.lab.template_lint import lint_template
from analysis.replay.template_infer import infer_template

STATIC = "You are the support assistant of ACME Networks. Answer in two sentences and never promise refunds."


def test_a_value_before_static_text_is_found_and_linted():
    samples = [f"Current time: 2026-03-0{d} 10:1{d}. {STATIC}\nQuestion: {q}" for d, q in
               enumerate(["How do I reset it?", "Why is the light orange?", "Guest wifi, please.", "Speed?"], 1)]
    samples.append("Something else entirely, a prompt of another kind that shares nothing much.")
    t = infer_template(samples)
    # whole words differ ("01" vs "02"); shared text shorter than 12 characters joins the part next to it
    assert t is not None and t.template == f"Current time: 2026-03-{{part1}}{STATIC}\n{{part2}}"
    assert t.matched == 4 and t.samples == 5
    assert t.values[1] == {"part1": "02 10:12. ", "part2": "Question: Why is the light orange?"}
    report = lint_template(t.template, t.values)
    assert [w.variable for w in report.warnings] == ["part1"] and report.reusable_share < 0.2


def test_literal_braces_are_escaped_and_no_template_without_shared_text():
    t = infer_template([f'Return JSON like {{"id": {i}}} for the record. {STATIC}' for i in range(3)])
    assert t is not None and '{{"id": {part1}}}' in t.template
    assert infer_template(["alpha", "beta", "gamma"]) is None
    assert infer_template(["same", "same"]) is None
