"""State another layer keeps per engine, out of the engine: ``PerEngine`` and the analysis's own.

Owns ``PerEngine``: a registry of objects a layer builds once per engine, found again by the
engine's identity and dropped when the engine is (a ``WeakKeyDictionary``), so the serving core
neither imports that layer nor keeps its objects. A value holds its engine only weakly
(``weakref.ref``), or the entry would keep the engine alive. Each layer has its own registry:
``per_engine`` here is the analysis's (the prefill timer, the request-order demo), and the page
keeps its memos in another (``components.panels.engine_state``). Knows nothing about what the
objects are.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TypeVar

from engine.api import EngineAPI

T = TypeVar("T")


class PerEngine:
    """Objects made once per engine, by name; one registry per layer that keeps any."""

    def __init__(self) -> None:
        self._state: weakref.WeakKeyDictionary[EngineAPI, dict[str, object]] = weakref.WeakKeyDictionary()
        self._lock = threading.RLock()  # re-entrant: a ``make`` may ask for another object of the same layer

    def __contains__(self, engine: object) -> bool:
        """Whether this registry holds objects for ``engine`` (it is alive and was asked about)."""
        with self._lock:
            return engine in self._state

    def engines(self) -> list[EngineAPI]:
        """The engines this registry holds objects for now (alive ones only)."""
        with self._lock:
            return list(self._state.keys())

    def get(self, engine: EngineAPI, name: str, make: Callable[[], T]) -> T:
        """The ``name`` object for ``engine``, made by ``make`` the first time it is asked for
        (under the registry's lock, so two callers never build it twice)."""
        with self._lock:
            objects = self._state.setdefault(engine, {})
            if name not in objects:
                objects[name] = make()
            return objects[name]  # type: ignore[return-value]


_ANALYSIS = PerEngine()
per_engine = _ANALYSIS.get  # the analysis's objects per engine
