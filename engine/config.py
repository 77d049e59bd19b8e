"""What the local engine is configured with: ``EngineConfig``, one frozen, checked value.

Owns: each of the engine's settings with its type, its default and its rule, checked in one
place (``EngineConfig.__post_init__``: a ``ConfigError``, a ``ValueError`` of one line naming the
setting). Built by
``engine.settings`` from flags and environment variables, or by ``Engine(runner, **settings)``
(tests, tools), which builds one here, so both are checked alike. Torch-free: it does not know
the device, so the device's defaults (``budget_bytes``, ``chunk_tokens``) stay None until the
engine meets its runner.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
from dataclasses import dataclass
from typing import Any

from engine.kvcache.eviction import DEFAULT_POLICY, POLICIES
from engine.scheduler.config import SchedulerConfig

__all__ = ["ConfigError", "EngineConfig"]


class ConfigError(ValueError):
    """A setting's value broke its rule: ``field`` names the setting (so a command line can name
    its flag instead), ``reason`` says why; ``str()`` is one line, ``"max_batch: must be ..."``."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def _whole(name: str, value: Any, minimum: int, optional: bool = False, truncate: bool = False) -> int | None:
    """``value`` as an int >= ``minimum`` (a float with no fraction passes; with ``truncate``, any
    finite float, cut as ``int()`` does: byte counts from MiB); None only where ``optional``."""
    if value is None and optional:
        return None
    if isinstance(value, float) and (value.is_integer() or (truncate and math.isfinite(value))):
        value = int(value)
    if isinstance(value, bool) or not hasattr(value, "__index__"):  # an int or numpy's; not a str or a fraction
        raise ConfigError(name, f"must be a whole number, got {value!r}")
    value = operator.index(value)
    if value < minimum:
        raise ConfigError(name, f"must be at least {minimum}, got {value}")
    return value


def _switch(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(name, f"must be True or False, got {value!r}")
    return value


def _kv_events(value: Any) -> str:
    """vLLM's ``--kv-events-config``: empty (off) or a JSON object (``engine.kvcache.kv_events``)."""
    if not isinstance(value, str):
        raise ConfigError("kv_events_config", f"must be a JSON string, got {type(value).__name__}")
    if not value.strip():
        return ""
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise ConfigError("kv_events_config", f"not JSON ({exc.msg} at character {exc.pos}): {value[:80]!r}") from None
    if not isinstance(parsed, dict):
        raise ConfigError("kv_events_config", f"must be a JSON object like {{\"publisher\": \"zmq\"}}, got {value[:80]!r}")
    return value


def _policy(value: Any) -> str:
    name = (value or DEFAULT_POLICY).strip().lower() if isinstance(value, str) or value is None else value
    if name not in POLICIES:
        raise ConfigError("eviction_policy", f"unknown eviction policy {value!r}: choose one of {', '.join(sorted(POLICIES))}")
    return name


@dataclass(frozen=True)
class EngineConfig:
    """Everything ``engine.engine.Engine`` is configured with; checked when built (``ConfigError``).

    ``budget_bytes``: the one KV pool's size (None: 1 GiB on CPU and MPS, a quarter of free
    memory on CUDA). ``enable_cache`` False runs the cache-off twin (``NoPrefixCache``).
    ``isolation``: a private cache namespace per visitor, fair-share eviction, one address's cap
    on waiting places. ``max_queue``: requests that may wait. ``max_prompt_tokens`` (None: the
    model's context, and never more) and ``max_new_tokens_cap``: per-request caps.
    ``history_size``: finished requests' records kept. ``max_batch``: requests decoded together.
    ``chunk_tokens``: prompt tokens prefilled per step (None: 256 on CPU, 2,048 on GPU).
    ``tier_bytes`` > 0 turns on the second tier: chunk files under ``tier_dir``, or host memory
    when ``tier_dir`` is None and the model runs on a GPU. ``kv_events_config``: vLLM's
    ``--kv-events-config`` JSON, the cache published as KV events. ``eviction_policy``: a name in
    ``engine.kvcache.eviction.POLICIES``.
    """

    budget_bytes: int | None = None
    enable_cache: bool = True
    isolation: bool = False
    max_queue: int = 32  # the one default: engine.settings and the app read it from here
    max_prompt_tokens: int | None = None
    max_new_tokens_cap: int = 512
    history_size: int = 1000
    max_batch: int = SchedulerConfig.max_batch  # the scheduler's own default: one home
    chunk_tokens: int | None = None
    tier_bytes: int = 0
    tier_dir: str | None = None
    kv_events_config: str = ""
    eviction_policy: str = DEFAULT_POLICY

    def __post_init__(self) -> None:
        """Every rule of every field, here and nowhere else; values are normalised in place
        (``budget_bytes=0.3 * 2**20`` becomes an int, ``"LFU"`` becomes ``"lfu"``)."""
        checked = dict(
            budget_bytes=_whole("budget_bytes", self.budget_bytes, 1, optional=True, truncate=True),
            enable_cache=_switch("enable_cache", self.enable_cache),
            isolation=_switch("isolation", self.isolation),
            max_queue=_whole("max_queue", self.max_queue, 1),
            max_prompt_tokens=_whole("max_prompt_tokens", self.max_prompt_tokens, 1, optional=True),
            max_new_tokens_cap=_whole("max_new_tokens_cap", self.max_new_tokens_cap, 1),
            history_size=_whole("history_size", self.history_size, 1),
            max_batch=_whole("max_batch", self.max_batch, 1),
            chunk_tokens=_whole("chunk_tokens", self.chunk_tokens, 1, optional=True),
            tier_bytes=_whole("tier_bytes", self.tier_bytes, 0, truncate=True),
            kv_events_config=_kv_events(self.kv_events_config),
            eviction_policy=_policy(self.eviction_policy),
        )
        if self.tier_dir is not None and not (isinstance(self.tier_dir, str) and self.tier_dir):
            raise ConfigError("tier_dir", f"must be a folder's path or None, got {self.tier_dir!r}")
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes``, checked again."""
        return dataclasses.replace(self, **changes)
