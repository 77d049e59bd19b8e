"""The template linter: where a prompt template puts its per-request parts.

Owns: parsing templates with ``{variables}`` (``{{`` and ``}}`` are literal
braces), rendering them safely (plain names only: no attribute or index access),
reading per-request values (JSON lines or a JSON list of objects), bounding
what rendering can produce, and the lint:

- a variable is *per-request* when its value differs between requests (with no
  values given, every variable is assumed to be);
- a warning for each per-request variable followed by static text: a prefix
  cache reuses a prompt only up to its first difference, so that static text is
  computed again on every request;
- an estimate of the share of each prompt that later requests can reuse (the
  rendered text before the first per-request variable), now and with the
  per-request lines moved last (the suggested template).

Rendering is bounded before anything is rendered or tokenized: a template holds
at most ``MAX_PLACEHOLDERS`` variables, and one rendered prompt (static text plus,
for every occurrence, its value) at most ``MAX_RENDERED_CHARS`` characters, all
requests together ``MAX_RENDERED_TOTAL_CHARS``. Without it, 2,000 ``{a}`` times a
9,900-character value renders 20 million characters per request from inputs a few
kilobytes long.

Token counts come from a ``count_tokens`` callable (the model's tokenizer in the
app), or roughly 4 characters per token without one. Knows nothing about the UI.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from engine.types import EngineError

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
STATIC_TOKENS_WORTH_A_WARNING = 8
MAX_TEMPLATE_CHARS = 20_000
MAX_VALUES_CHARS = 100_000
MAX_VALUE_ROWS = 32
MAX_PLACEHOLDERS = 256  # variable occurrences in one template
MAX_RENDERED_CHARS = 64_000  # one rendered prompt: far over the model's context already
MAX_RENDERED_TOTAL_CHARS = 256_000  # every request of one lint or lab run together


class TemplateError(EngineError):
    """The template or its values cannot be used; the message says why."""


@dataclass(frozen=True)
class Segment:
    text: str  # literal text, or the variable's name
    is_variable: bool


@dataclass(frozen=True)
class LintWarning:
    variable: str
    static_tokens_after: int
    message: str


@dataclass(frozen=True)
class LintReport:
    variables: tuple[str, ...]  # in order of first appearance
    per_request: tuple[str, ...]
    constant: tuple[str, ...]  # same value in every request: static content
    warnings: tuple[LintWarning, ...]
    reusable_share: float  # estimate, mean over requests: tokens before the first per-request part / all
    reusable_share_suggested: float | None  # the same for ``suggested_template``
    mean_prompt_tokens: float
    suggested_template: str | None  # per-request lines moved last; None if nothing to improve


def parse_template(template: str) -> list[Segment]:
    if not isinstance(template, str):
        raise TemplateError("The template must be text.")
    if len(template) > MAX_TEMPLATE_CHARS:
        raise TemplateError(f"The template is {len(template):,} characters long; the limit is "
                            f"{MAX_TEMPLATE_CHARS:,}.")
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise TemplateError(f"The template has unbalanced braces ({exc}); write {{{{ and }}}} for literal "
                            "braces.") from None
    out: list[Segment] = []
    for literal, name, spec, conv in parsed:
        if literal:
            out.append(Segment(literal, False))
        if name is None:
            continue
        if not _NAME.match(name) or spec or conv:
            raise TemplateError(f"{{{name}}} is not a plain variable name: use letters, digits and _ only, "
                                "like {question}.")
        out.append(Segment(name, True))
    placeholders = sum(seg.is_variable for seg in out)
    if placeholders > MAX_PLACEHOLDERS:
        raise TemplateError(f"The template uses variables {placeholders:,} times; the limit is {MAX_PLACEHOLDERS}.")
    return out


def rendered_chars(segments: Sequence[Segment], values: Mapping[str, object]) -> int:
    """Length of the text ``segments`` render to with ``values``, without rendering it."""
    return sum(len(str(values.get(s.text, ""))) if s.is_variable else len(s.text) for s in segments)


def check_render_size(template: str, rows: Sequence[Mapping[str, object]]) -> None:
    """Refuse, before rendering, values that would make ``template`` render too much text:
    occurrences times value length per request, and all requests together."""
    segments = parse_template(template)
    total = 0
    for i, row in enumerate(rows):
        n = rendered_chars(segments, row)
        if n > MAX_RENDERED_CHARS:
            raise TemplateError(f"With request {i + 1}'s values the template renders {n:,} characters; the limit "
                                f"is {MAX_RENDERED_CHARS:,}. Use shorter values or fewer {{variables}}.")
        total += n
    if total > MAX_RENDERED_TOTAL_CHARS:
        raise TemplateError(f"All requests together render {total:,} characters; the limit is "
                            f"{MAX_RENDERED_TOTAL_CHARS:,}. Use fewer requests or shorter values.")


def template_variables(template: str) -> list[str]:
    seen: list[str] = []
    for seg in parse_template(template):
        if seg.is_variable and seg.text not in seen:
            seen.append(seg.text)
    return seen


def render(template: str, values: Mapping[str, object]) -> str:
    """``template`` with every variable replaced by its value (refused if too long, see above)."""
    segments = parse_template(template)
    n = rendered_chars(segments, values)
    if n > MAX_RENDERED_CHARS:
        raise TemplateError(f"With these values the template renders {n:,} characters; the limit is "
                            f"{MAX_RENDERED_CHARS:,}. Use shorter values or fewer {{variables}}.")
    out = []
    for seg in segments:
        if not seg.is_variable:
            out.append(seg.text)
        elif seg.text in values:
            out.append(str(values[seg.text]))
        else:
            raise TemplateError(f"No value for {{{seg.text}}}: give it in every request's values.")
    return "".join(out)


def parse_values(text: str) -> list[dict[str, str]]:
    """Per-request values: one JSON object per line, or one JSON list of objects."""
    text = (text or "").strip() if isinstance(text, str) or text is None else None
    if text is None:
        raise TemplateError("The values must be text: one JSON object per line.")
    if not text:
        return []
    if len(text) > MAX_VALUES_CHARS:
        raise TemplateError(f"The values are {len(text):,} characters long; the limit is {MAX_VALUES_CHARS:,}.")
    try:
        data = json.loads(text) if text.startswith("[") else [json.loads(line) for line in text.splitlines()
                                                               if line.strip()]
    except json.JSONDecodeError as exc:
        raise TemplateError(f"The values are not valid JSON (line {exc.lineno}: {exc.msg}). Write one object per "
                            'line, like {"question": "How do I reset my password?"}.') from None
    if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
        raise TemplateError('Each request\'s values must be a JSON object, like {"question": "..."}.')
    if len(data) > MAX_VALUE_ROWS:
        raise TemplateError(f"Values for {len(data):,} requests; the limit is {MAX_VALUE_ROWS}.")
    return [{str(k): "" if v is None else str(v) for k, v in d.items()} for d in data]


def per_request_variables(variables: Sequence[str], values: Sequence[Mapping[str, object]]) -> list[str]:
    if len(values) < 2:
        return list(variables)
    return [v for v in variables if len({str(row.get(v, "")) for row in values}) > 1]


def suggest_order(template: str, per_request: Sequence[str], count_tokens: Callable[[str], int] | None = None
                  ) -> str | None:
    """Move the lines that use a per-request variable after the last line of
    substantial static text, keeping every group's order; short static lines after
    that (like ``Answer:``) stay last. None if that changes nothing.
    ::

        S1 V1 S2 V2 s3   ->   S1 S2 V1 V2 s3      (S: static, V: per-request, s: short static tail)
    """
    count = count_tokens or _rough_tokens
    lines = template.split("\n")
    varying = [any(s.is_variable and s.text in per_request for s in _safe_parse(ln)) for ln in lines]
    last_static = max((i for i, ln in enumerate(lines)
                       if not varying[i] and count(ln) >= STATIC_TOKENS_WORTH_A_WARNING), default=-1)
    head = [ln for i, ln in enumerate(lines[:last_static + 1]) if not varying[i]]
    moved = [ln for i, ln in enumerate(lines[:last_static + 1]) if varying[i]]
    suggested = "\n".join(head + moved + lines[last_static + 1:])
    return None if not moved or suggested == template else suggested


def _rough_tokens(text: str) -> int:
    return (len(text) + 3) // 4


def lint_template(template: str, values: Sequence[Mapping[str, object]] = (),
                  count_tokens: Callable[[str], int] | None = None) -> LintReport:
    count = count_tokens or _rough_tokens
    segments = parse_template(template)
    variables = template_variables(template)
    per_request = per_request_variables(variables, values)
    constant = [v for v in variables if v not in per_request]
    rows = list(values) or [dict.fromkeys(variables, "")]
    check_render_size(template, rows)  # before anything is rendered or counted

    warnings: list[LintWarning] = []
    seen: set[str] = set()  # a later occurrence has only part of the first one's static text after it
    for i, seg in enumerate(segments):
        if not seg.is_variable or seg.text not in per_request or seg.text in seen:
            continue
        seen.add(seg.text)
        static_after = "".join(s.text if not s.is_variable else (str(rows[0].get(s.text, "")) if s.text in constant
                                                                 else "") for s in segments[i + 1:]
                               if not (s.is_variable and s.text in per_request))
        n = count(static_after) if static_after.strip() else 0
        if n >= STATIC_TOKENS_WORTH_A_WARNING:
            warnings.append(LintWarning(seg.text, n, (
                f"{{{seg.text}}} changes per request but comes before ~{n:,} tokens of static text: a prefix cache "
                f"stops at the first difference, so that text is computed again on every request. Move "
                f"{{{seg.text}}} after the static text.")))

    share, mean_tokens = _reusable_share(segments, per_request, rows, count)
    suggested = suggest_order(template, per_request, count) if warnings else None
    share_suggested = _reusable_share(parse_template(suggested), per_request, rows, count)[0] if suggested else None
    return LintReport(tuple(variables), tuple(per_request), tuple(constant), tuple(warnings), share,
                      share_suggested, mean_tokens, suggested)


def _reusable_share(segments: Sequence[Segment], per_request: Sequence[str], rows: Sequence[Mapping[str, object]],
                    count: Callable[[str], int]) -> tuple[float, float]:
    """Estimated share of each rendered prompt that comes before its first per-request
    value (what the next request can reuse), and the mean prompt length in tokens."""
    first = next((i for i, s in enumerate(segments) if s.is_variable and s.text in per_request), len(segments))
    reusable = total = 0
    for row in rows:
        full = "".join(str(row.get(s.text, "")) if s.is_variable else s.text for s in segments)
        prefix = "".join(str(row.get(s.text, "")) if s.is_variable else s.text for s in segments[:first])
        reusable += count(prefix) if prefix else 0
        total += count(full) if full else 0
    return (min(1.0, reusable / total) if total else 0.0), total / max(1, len(rows))


def _safe_parse(line: str) -> list[Segment]:
    try:
        return parse_template(line)
    except TemplateError:  # a line may hold half of a {{ }} pair; it has no variable then
        return []
