"""The settings' value parsers: text (a flag's or an environment variable's) -> value; a
``ValueError`` says why a text is refused, in words the start-up message shows. Pure functions,
shared by every row of ``engine.settings.SETTINGS``; they know nothing of which setting reads them."""

from __future__ import annotations

import math


def whole(text: str) -> int:
    """A whole number."""
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected a whole number, got {text!r}") from None


def int_or_default(text: str) -> int | None:
    """A whole number, or 0 / empty for the default (None)."""
    return None if text.strip() in ("", "0") else whole(text)


def int_or_unset(text: str) -> int | None:
    """A whole number, or empty for the default (which may depend on ``--isolate``)."""
    return None if not text.strip() else whole(text)


def per_client(text: str) -> int | None:
    """A cap >= 0 (0: none), or a negative number / empty for the deployment's default (None)."""
    value = whole(text) if text.strip() else -1
    return None if value < 0 else value


def number(text: str, what: str = "a number") -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected {what}, got {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"must be finite, got {text!r}")
    return value


def mib(text: str) -> float | None:
    """MiB, >= 0; 0 for the default (None)."""
    value = number(text, "a number of MiB")
    if value < 0:
        raise ValueError(f"must be >= 0, got {text!r}")
    return value or None


def positive_number(text: str) -> float:
    if number(text) <= 0:
        raise ValueError(f"must be > 0, got {text!r}")
    return float(text)


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def switch(text: str) -> bool:
    word = text.strip().lower()
    if word not in _TRUE + _FALSE:
        raise ValueError(f"expected 1 or 0 (true/false, yes/no, on/off), got {text!r}")
    return word in _TRUE


def switch_or_auto(text: str) -> bool | None:
    """On or off, or empty for the default (None: on a Hugging Face Space, off elsewhere)."""
    return None if not text.strip() else switch(text)


def urls(text: str) -> list[str]:
    return [u.strip() for u in text.split(",") if u.strip()]


def mib_to_bytes(mib: float | None) -> int | None:
    return None if mib is None else int(mib * 2**20)
