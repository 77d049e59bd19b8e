"""The template linter: flags per-request variables before static text, estimates the
reusable share, suggests an order, and renders safely."""

from __future__ import annotations

import json

import pytest

from analysis.lab.template_lint import (
    TemplateError,
    lint_template,
    parse_values,
    render,
    suggest_order,
    template_variables,
)

STATIC = "You are the assistant of Harbor Air. Follow the baggage and refund rules exactly as written here."
ROWS = [{"time": f"09:0{i}", "question": f"question number {i}?", "brand": "Harbor"} for i in range(4)]


def test_flags_a_variable_before_static_text():
    report = lint_template("Time: {time}\n" + STATIC + "\nQuestion: {question}\nAnswer:", ROWS)
    assert [w.variable for w in report.warnings] == ["time"]
    assert report.warnings[0].static_tokens_after >= 8
    assert "{time}" in report.warnings[0].message


def test_no_warning_when_variables_come_last():
    report = lint_template(STATIC + "\nTime: {time}\nQuestion: {question}\nAnswer:", ROWS)
    assert report.warnings == ()
    assert report.suggested_template is None
    assert report.reusable_share > 0.5


def test_constant_variable_is_static():
    report = lint_template("{brand} support.\n" + STATIC + "\nQ: {question}", ROWS)
    assert report.constant == ("brand",) and "brand" not in report.per_request
    assert report.warnings == ()


def test_without_values_every_variable_is_per_request():
    report = lint_template("{x} " + STATIC)
    assert report.per_request == ("x",) and len(report.warnings) == 1


def test_suggested_order_moves_per_request_lines_and_raises_the_share():
    template = "Request {time}.\n" + STATIC + "\nQuestion: {question}\nAnswer:"
    report = lint_template(template, ROWS)
    assert report.suggested_template == STATIC + "\nRequest {time}.\nQuestion: {question}\nAnswer:"
    assert report.reusable_share_suggested > report.reusable_share
    assert suggest_order(STATIC + "\n{question}", ["question"]) is None


def test_reusable_share_uses_the_token_counter():
    words = lambda s: len(s.split())  # noqa: E731
    report = lint_template("a b c d {q} e", [{"q": "x"}, {"q": "y"}], count_tokens=words)
    assert report.reusable_share == pytest.approx(4 / 6)


def test_render_and_parse_errors():
    assert render("Hi {name}, {{literal}}", {"name": "Ana"}) == "Hi Ana, {literal}"
    assert template_variables("{a} {b} {a}") == ["a", "b"]
    for bad in ("{x.__class__}", "{x[0]}", "{x!r}", "{x:>10}", "{", "}"):
        with pytest.raises(TemplateError):
            render(bad, {"x": "1"})
    with pytest.raises(TemplateError, match="No value"):
        render("{missing}", {})


def test_parse_values():
    assert parse_values('{"a": 1}\n\n{"a": "x"}') == [{"a": "1"}, {"a": "x"}]
    assert parse_values('[{"a": null}]') == [{"a": ""}]
    assert parse_values("  ") == []
    for bad in ("{not json", "[1, 2]", '"text"'):
        with pytest.raises(TemplateError):
            parse_values(bad)


def test_size_limits():
    from analysis.lab.template_lint import MAX_TEMPLATE_CHARS, MAX_VALUE_ROWS, MAX_VALUES_CHARS

    with pytest.raises(TemplateError, match="limit"):
        lint_template("x" * (MAX_TEMPLATE_CHARS + 1))
    with pytest.raises(TemplateError, match="limit"):
        parse_values("{}\n" * (MAX_VALUES_CHARS // 2))
    with pytest.raises(TemplateError, match="limit"):
        parse_values('{"a": 1}\n' * (MAX_VALUE_ROWS + 1))
    with pytest.raises(TemplateError):
        parse_values(["not", "text"])


def _guarded_counter(limit_chars: int = 100_000):
    """A token counter that fails the test if asked to count a text no request should render."""
    def count(text: str) -> int:
        assert len(text) <= limit_chars, f"asked to tokenize {len(text):,} characters"
        return (len(text) + 3) // 4
    return count


def test_amplification_is_refused_before_rendering():
    """The attack: 2,000 occurrences of {a} times a 9,900-character value is 20 million characters
    per request from inputs a few kilobytes long; refused before rendering or counting."""
    from analysis.lab.template_lint import MAX_PLACEHOLDERS, MAX_RENDERED_CHARS, MAX_RENDERED_TOTAL_CHARS

    rows = [{"a": "x" * 9_900}, {"a": "y" * 9_900}]
    with pytest.raises(TemplateError, match="limit"):
        lint_template("{a}" * 2_000, rows, _guarded_counter())
    with pytest.raises(TemplateError, match="limit"):  # under the occurrence cap, still far too much text
        lint_template("{a}" * MAX_PLACEHOLDERS, rows, _guarded_counter())
    with pytest.raises(TemplateError, match="renders"):
        render("{a}" * MAX_PLACEHOLDERS, rows[0])
    with pytest.raises(TemplateError, match="together"):  # each request fits, all of them do not
        many = [{"a": str(i) * (MAX_RENDERED_CHARS - 10)} for i in range(MAX_RENDERED_TOTAL_CHARS
                                                                        // MAX_RENDERED_CHARS + 1)]
        lint_template("Q: {a}", many, _guarded_counter())
    # what fits still renders and lints
    assert len(render("{a}" * 6, rows[0])) == 6 * 9_900
    assert lint_template("{a} static text " * 6, rows, _guarded_counter()).per_request == ("a",)


def test_custom_lab_runs_are_bounded_before_rendering():
    from components.panels.lab.tab import custom_variants

    values = "\n".join(json.dumps({"a": c * 9_000}) for c in "xy")
    with pytest.raises(TemplateError, match="limit"):
        custom_variants("{a}" * 200, "", values)
    with pytest.raises(TemplateError, match="limit"):
        custom_variants("Q: {a}", "{a}" * 200, values)
    assert len(custom_variants("Static text first.\nQ: {a}", "", values)) >= 1
