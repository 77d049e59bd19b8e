"""Wake-ups held back on the thread that runs the model, until its kernels start.

Owns: the per-thread list of held wake-ups: ``holding`` (this thread holds from now on: the
runner's compute thread), ``hold_signal`` (an event queue's wake-up, held where the thread
holds, else refused so the caller signals at once) and ``release_signals`` (run them, oldest
first). Knows nothing about torch, requests or HTTP: ``engine.handle`` holds, the model code
releases. Why: ``engine.model.compute_thread``'s docstring.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

_held = threading.local()  # ``signals``: the wake-ups this thread holds, where it holds any


def holding() -> None:
    """From now on this thread holds the wake-ups ``hold_signal`` is given, until ``release_signals``."""
    if getattr(_held, "signals", None) is None:
        _held.signals = []


def hold_signal(signal: Callable[[], None]) -> bool:
    """On a thread that holds (``holding``), keep ``signal`` (a consumer's wake-up) until
    ``release_signals`` runs there, and return True; on any other thread return False (the
    caller signals at once)."""
    held = getattr(_held, "signals", None)
    if held is None:
        return False
    held.append(signal)
    return True


def release_signals() -> None:
    """Run the wake-ups this thread holds, oldest first (nothing on a thread that holds none):
    called right before a computation long enough to hide the consumers' Python, and at the end
    of every call on the compute thread."""
    held = getattr(_held, "signals", None)
    while held:
        signal = held.pop(0)
        try:
            signal()
        except Exception:  # a wake-up must never fail the model's work: say so and go on
            log.exception("a consumer's wake-up failed")
