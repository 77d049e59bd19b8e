"""What the page keeps per engine: its memos and shared objects, out of the engine itself.

Owns ``engine_state(engine, name, make)``: an object the page builds once per engine (the tree
panel's figure memos, the live views' shared snapshot, the shipped blocks' token ids), found
again by the engine's identity and dropped when the engine is (a ``WeakKeyDictionary``: no
table keyed by ``id(engine)`` that outlives it). A value must not hold its engine, or the
entry would keep it alive. Knows nothing about what the objects are.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TypeVar

from engine.api import EngineAPI

T = TypeVar("T")

_STATE: weakref.WeakKeyDictionary[EngineAPI, dict[str, object]] = weakref.WeakKeyDictionary()
_LOCK = threading.RLock()  # re-entrant: a ``make`` may ask for another of the page's objects


def engine_state(engine: EngineAPI, name: str, make: Callable[[], T]) -> T:
    """The page's ``name`` object for ``engine``, made by ``make`` the first time it is asked for.
    ``make`` runs under the registry's lock, so two sessions never build it twice."""
    with _LOCK:
        objects = _STATE.setdefault(engine, {})
        if name not in objects:
            objects[name] = make()
        return objects[name]  # type: ignore[return-value]
