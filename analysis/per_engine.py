"""What the analysis keeps per engine (the prefill timer, the request-order demo), out of the engine.

Owns ``per_engine(engine, name, make)``: an object the analysis builds once per engine, found
again by the engine's identity and dropped when the engine is (a ``WeakKeyDictionary``), so the
serving core neither imports the analysis nor keeps its objects. A value holds its engine only
weakly (``weakref.ref``), or the entry would keep the engine alive. Knows nothing about what the
objects are; the page keeps its own per-engine objects apart (``components.panels.engine_state``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TypeVar

from engine.api import EngineAPI

T = TypeVar("T")

_STATE: weakref.WeakKeyDictionary[EngineAPI, dict[str, object]] = weakref.WeakKeyDictionary()
_LOCK = threading.RLock()  # re-entrant: a ``make`` may ask for another per-engine object


def per_engine(engine: EngineAPI, name: str, make: Callable[[], T]) -> T:
    """The analysis's ``name`` object for ``engine``, made by ``make`` the first time (under the
    registry's lock, so two callers never build it twice)."""
    with _LOCK:
        objects = _STATE.setdefault(engine, {})
        if name not in objects:
            objects[name] = make()
        return objects[name]  # type: ignore[return-value]
