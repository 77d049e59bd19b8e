"""What the page keeps per engine: its memos and shared objects, out of the engine itself.

Owns the page's registry (``engine_state(engine, name, make)``, an ``analysis.per_engine.PerEngine``
of its own): the tree panel's figure memos, the live views' shared snapshot, the shipped blocks
handed to the engine, each built once per engine and dropped with it (no table keyed by
``id(engine)`` that outlives it). A value must not hold its engine, or the entry would keep it
alive. Knows nothing about what the objects are.
"""

from __future__ import annotations

from analysis.per_engine import PerEngine

_PAGE = PerEngine()
engine_state = _PAGE.get  # the page's objects per engine
