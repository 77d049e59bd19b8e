"""Visitor identity and what may be shared: the server sets each visitor's cache
namespace from a secret salt and Gradio's session hash; a client cannot choose it."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from functools import lru_cache

from components.presets import FEW_SHOT_PRESETS, SYSTEM_PRESETS, few_shot_static_part
from engine.engine import Engine
from engine.radix_tree import PUBLIC

_SALT = secrets.token_bytes(16)  # per server process, never sent to a client


def visitor_namespace(request, engine: Engine | None = None) -> str:
    """A private namespace for this visitor's session; ``PUBLIC`` (everything shared)
    when the engine does not isolate visitors or there is no session."""
    if engine is not None and not engine.isolation:
        return PUBLIC
    session = getattr(request, "session_hash", None) if request is not None else None
    if not session:
        return PUBLIC
    return "v-" + hmac.new(_SALT, str(session).encode(), hashlib.sha256).hexdigest()[:12]


@lru_cache(maxsize=8)
def _public_prefixes(engine_id: int, engine: Engine) -> tuple[tuple[int, ...], ...]:
    runner = engine.runner
    out = []
    for text in SYSTEM_PRESETS.values():
        out.append(tuple(runner.encode(runner.render_chat([{"role": "system", "content": text}],
                                                          add_generation_prompt=False))))
    for preset in FEW_SHOT_PRESETS.values():
        static = few_shot_static_part(preset["instruction"], preset["examples"])
        rendered = runner.render_chat([{"role": "user", "content": static + "\x00"}])
        out.append(tuple(runner.encode(rendered[: rendered.index("\x00")])))
    return tuple(out)


def public_len(engine: Engine, ids: list[int]) -> int:
    """Tokens of ``ids`` that are content shipped with the app (shareable)."""
    return engine.public_prefix_len(ids, _public_prefixes(id(engine), engine))
