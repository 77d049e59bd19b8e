"""Inferring a prompt template from logged prompts, so the template linter can read a log.

Owns: aligning two prompts of the same shape (``difflib``, by sentence, then by
word inside sentences that differ), keeping
the stretches they share (at least ``MIN_LITERAL_CHARS`` long) as literal text
and turning what differs into ``{part1}``, ``{part2}`` ... ; then checking the
other samples against it (a regex built from the literals) and reading their
values; samples that do not fit narrow the template to what they share. The
result is a template in ``analysis.lab.template_lint``'s syntax plus one row of
values per matching sample: exactly what ``lint_template`` takes.

An inference, not a certainty: a log whose prompts share no long stretches, or
differ in more than ``MAX_PARTS`` places, gives no template. Knows nothing about
tokenizers, caches or the UI.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

MIN_LITERAL_CHARS = 12
MAX_PARTS = 8
MAX_SAMPLE_CHARS = 16_000
MAX_REFINE_CHARS = 2_000
_SENTINEL = "\x00"  # stands for a part while a template is narrowed: never matches a sample
_WORDS = re.compile(r"\w+|\s+|[^\w\s]")
_SENTENCES = re.compile(r"[^.!?\n]*(?:[.!?]+\s*|\n+|$)")


@dataclass(frozen=True)
class InferredTemplate:
    template: str  # ``{partN}`` for what differs; literal braces doubled
    parts: tuple[str, ...]
    values: tuple[dict[str, str], ...]  # one row per sample that fits the template
    samples: int  # samples looked at
    matched: int  # samples that fit


def infer_template(samples: Sequence[str]) -> InferredTemplate | None:
    """A template that most of ``samples`` fit, or None (see module docstring).

    The first two distinct samples give a first template; each further sample that does
    not fit it narrows it to the literal text they share (a sample that would remove more
    than half of the literal text is an outlier and is passed over). The template is kept
    when at least half of the samples fit it.
    """
    distinct = list(dict.fromkeys(s.replace(_SENTINEL, "") for s in samples if 0 < len(s) <= MAX_SAMPLE_CHARS))
    if len(distinct) < 2:
        return None
    literals = _shared_literals(distinct[0], distinct[1])
    if literals is None:
        return None
    for sample in distinct[2:]:
        if _pattern(literals).match(sample):
            continue
        narrowed = _shared_literals("".join(_SENTINEL if lit is None else lit for lit in literals), sample)
        if narrowed is not None and _literal_chars(narrowed) >= _literal_chars(literals) / 2:
            literals = narrowed
    parts = tuple(f"part{i + 1}" for i in range(sum(lit is None for lit in literals)))
    if not parts or len(parts) > MAX_PARTS:
        return None
    pattern = _pattern(literals)
    rows = [dict(zip(parts, m.groups(), strict=True)) for s in distinct if (m := pattern.match(s)) is not None]
    if len(rows) < max(2, math.ceil(len(distinct) / 2)):
        return None
    template, k = [], 0
    for lit in literals:
        if lit is None:
            template.append("{" + parts[k] + "}")
            k += 1
        else:
            template.append(lit.replace("{", "{{").replace("}", "}}"))
    return InferredTemplate("".join(template), parts, tuple(rows), len(distinct), len(rows))


def _pattern(literals: Sequence[str | None]) -> re.Pattern:
    return re.compile("".join("(.*?)" if lit is None else re.escape(lit) for lit in literals) + r"\Z", re.S)


def _literal_chars(literals: Sequence[str | None]) -> int:
    return sum(len(lit) for lit in literals if lit is not None)


def _shared_literals(a: str, b: str) -> list[str | None] | None:
    """Literal stretches of ``a`` shared with ``b``, in order, with ``None`` where they differ.
    Aligned sentence by sentence first (fast on long prompts), then word by word inside
    the sentences that differ.
    ::

        a:  [ shared ][ x ][ shared ........ ][ y ]
        ->  ["shared", None, "shared ........", None]
    """
    segments: list[tuple[str, str, str]] = []  # ("same", text, "") or ("diff", a part, b part)
    for kind, x, y in _align(_SENTENCES.findall(a), _SENTENCES.findall(b)):
        if kind == "diff" and 0 < len(x) <= MAX_REFINE_CHARS and 0 < len(y) <= MAX_REFINE_CHARS:
            segments.extend(_align(_WORDS.findall(x), _WORDS.findall(y)))
        else:
            segments.append((kind, x, y))
    out: list[str | None] = []
    for i, (kind, text, _) in enumerate(segments):
        if kind == "same" and (len(text) >= MIN_LITERAL_CHARS or i == 0 or i == len(segments) - 1):
            if out and out[-1] is not None:
                out[-1] += text
            else:
                out.append(text)
        elif not out or out[-1] is not None:
            out.append(None)  # a difference, or shared text too short to be template text ("the", ", ")
    if not any(lit for lit in out if lit is not None):
        return None
    return out


def _align(wa: list[str], wb: list[str]) -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = []
    ia = ib = 0
    for blk in difflib.SequenceMatcher(None, wa, wb, autojunk=False).get_matching_blocks():
        if blk.a > ia or blk.b > ib:
            out.append(("diff", "".join(wa[ia:blk.a]), "".join(wb[ib:blk.b])))
        if blk.size:
            out.append(("same", "".join(wa[blk.a:blk.a + blk.size]), ""))
        ia, ib = blk.a + blk.size, blk.b + blk.size
    return out
