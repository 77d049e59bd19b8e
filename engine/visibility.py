"""Whose a figure is, and what a visitor may see of it: the one rule every view applies.

Owns: ``Whose`` (the viewer's own work, shipped content, or everyone's), ``Figure`` (a value that
says whose it is and in what unit) with its constructors ``own``, ``shipped`` and ``everyone``,
``Audience.show`` (what one reader sees of a figure), and ``new_request_id`` (ids that count
nobody else's requests):

    whose      private deployment    public deployment (isolation)
    own        exact                 exact
    shipped    exact                 exact     (the app's presets, its settings, the model)
    everyone   exact                 coarse: tokens and bytes in whole HIDDEN_BUCKET_TOKENS
                                     buckets (rounded up), counts of requests in steps of
                                     COUNT_BUCKET (rounded up), rates in steps of
                                     RATE_BUCKET_TOKENS_PER_S (rounded down); anything else
                                     (times, ratios, raw counters) withheld

A figure over everyone's work moves by one visitor's prompt length when that visitor's request
starts or ends, so read exactly by a stranger it is an oracle of what someone else asked; a
bucket (the tree's "others" nodes use the same) tells only that someone is active. The page's
views and panels read figures only through this declaration (``tests/ui/test_visibility_rule.py``
fails on a figure field read without one). Pure: no UI, no engine state; the buckets are
``engine.snapshot_view``'s.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from enum import Enum

from engine.snapshot_view import HIDDEN_BUCKET_TOKENS, coarse_bytes, coarse_rate, coarse_tokens

COUNT_BUCKET = 4  # everyone's requests running or waiting, as a stranger sees them


class Whose(Enum):
    OWN = "own"  # the viewer's own requests, tree, lab runs or simulations
    SHIPPED = "shipped"  # what ships with the app: presets, settings, the model, the budget
    EVERYONE = "everyone"  # any figure that includes another visitor's work


class Unit(Enum):
    TOKENS = "tokens"
    BYTES = "bytes"
    COUNT = "count"  # requests
    RATE = "tokens/s"
    OTHER = "other"  # times, ratios, counters: no bucket hides one visitor in them


@dataclass(frozen=True)
class Figure:
    """A number a view may show, with whose it is (``Whose``) and its ``Unit``."""

    value: float | int | None
    whose: Whose
    unit: Unit = Unit.OTHER


def own(value: float | int | None, unit: Unit = Unit.OTHER) -> Figure:
    return Figure(value, Whose.OWN, unit)


def shipped(value: float | int | None, unit: Unit = Unit.OTHER) -> Figure:
    return Figure(value, Whose.SHIPPED, unit)


def everyone(value: float | int | None, unit: Unit = Unit.OTHER) -> Figure:
    return Figure(value, Whose.EVERYONE, unit)


@dataclass(frozen=True)
class Shown:
    """What a reader sees of a figure: ``value`` (None: withheld) and whether it is exact; a coarse
    token, byte or count figure is an upper bound ("at most"), a coarse rate a lower one."""

    value: float | int | None
    exact: bool = True
    withheld: bool = False

    @property
    def visible(self) -> bool:
        return not self.withheld


def coarse_count(n: int) -> int:
    """A count of everyone's requests rounded up to whole ``COUNT_BUCKET`` steps (0 stays 0)."""
    return -(-max(0, int(n)) // COUNT_BUCKET) * COUNT_BUCKET


@dataclass(frozen=True)
class Audience:
    """Who reads: ``public`` (a public deployment, ``--isolate``) or the operator's own page;
    ``bytes_per_token`` buckets byte figures by the tokens they hold."""

    public: bool
    bytes_per_token: int = 0

    def show(self, figure: Figure) -> Shown:
        if not isinstance(figure, Figure):
            raise TypeError(f"a view may show only a declared Figure (own, shipped or everyone), not {figure!r}")
        v = figure.value
        if v is None or figure.whose is not Whose.EVERYONE or not self.public:
            return Shown(v)
        if figure.unit is Unit.TOKENS:
            return Shown(coarse_tokens(int(v)), exact=False)
        if figure.unit is Unit.BYTES and self.bytes_per_token > 0:
            return Shown(coarse_bytes(int(v), self.bytes_per_token) if v > 0 else 0, exact=False)
        if figure.unit is Unit.COUNT:
            return Shown(coarse_count(int(v)), exact=False)
        if figure.unit is Unit.RATE:
            return Shown(coarse_rate(float(v)), exact=False)
        return Shown(None, exact=False, withheld=True)


def new_request_id() -> int:
    """A request's id: random (48 bits, exact in a browser's numbers), so the ids a visitor sees
    of their own requests say nothing of how many others were sent between them (a global
    counter's gaps did, issue 58). Ids are compared for equality only, never ordered."""
    return secrets.randbits(48) | 1 << 47  # never small: a test or a label cannot mistake it for a count


__all__ = ["COUNT_BUCKET", "HIDDEN_BUCKET_TOKENS", "Audience", "Figure", "Shown", "Unit", "Whose", "coarse_count",
           "everyone", "new_request_id", "own", "shipped"]
