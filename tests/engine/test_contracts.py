"""The narrow contracts (``engine/kvcache/prefix_cache.py``, ``engine/api.py``): each part says
what one kind of caller uses, the parts add up to the whole without overlap, every implementation
provides every member of each part it claims (with the same parameters), and a function that
takes a narrow part touches nothing outside it. Parsed, and built on a tiny CPU pool: no model.
"""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

import pytest
import torch

from engine import api
from engine.engine import Engine
from engine.kvcache import prefix_cache as pc
from engine.kvcache.kv_pool import KVPool
from server.remote.engine import RemoteEngine

ROOT = Path(__file__).resolve().parents[2]
CACHE_PARTS = (pc.PrefixCache, pc.ScratchCopies, pc.CacheControls, pc.CacheFigures, pc.TieredCache, pc.EventSource)
ENGINE_PARTS = (api.ServingAPI, api.TextAPI, api.FiguresAPI, api.ControlAPI, api.PrefillAPI)
SCHEDULER_CALLS = {"enabled", "pool", "acquire", "adopt", "release", "match_len", "budget_bytes", "bytes_per_token"}


def members(proto: type) -> set[str]:
    """Every member a protocol declares, its protocol bases' included: methods, properties and
    annotated attributes."""
    out: set[str] = set()
    for c in proto.__mro__:
        if c in (typing.Protocol, typing.Generic, object) or not getattr(c, "_is_protocol", False):
            continue
        out |= {n for n in vars(c) if not n.startswith("_")} | set(vars(c).get("__annotations__", {}))
    return out


def _attrs_on(tree: ast.AST, name: str) -> set[str]:
    """Attributes read on ``name`` or on ``self.<name>`` anywhere under ``tree``."""
    out = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if (isinstance(v, ast.Name) and v.id == name) or (
                isinstance(v, ast.Attribute) and v.attr == name and isinstance(v.value, ast.Name) and v.value.id == "self"):
            out.add(node.attr)
    return out


@pytest.mark.parametrize("whole, parts, count", [(pc.FullPrefixCache, CACHE_PARTS, 30),
                                                 (api.EngineAPI, ENGINE_PARTS, 41)])
def test_the_parts_add_up_without_overlap(whole, parts, count):
    assert whole.__bases__[:-1] == parts and whole.__bases__[-1] is typing.Protocol
    seen: set[str] = set()
    for part in parts:
        assert not members(part) & seen, (part.__name__, members(part) & seen)
        seen |= members(part)
    assert seen == members(whole) and len(seen) == count, sorted(seen)


def test_the_scheduler_calls_exactly_the_narrow_cache():
    """``PrefixCache`` is what ``engine/scheduler/`` calls, no more (then it would need a wider
    part) and no less (then the contract would promise what nobody asks)."""
    used = set()
    for p in sorted((ROOT / "engine" / "scheduler").glob("*.py")):
        used |= _attrs_on(ast.parse(p.read_text()), "cache")
    assert used == SCHEDULER_CALLS == members(pc.PrefixCache), sorted(used)


def _check_implements(impl: object, parts: tuple[type, ...]) -> None:
    cls = impl if isinstance(impl, type) else type(impl)
    for part in parts:
        if not isinstance(impl, type):
            assert isinstance(impl, part), (cls.__name__, part.__name__)
        for name in members(part):
            declared = inspect.getattr_static(part, name, None)
            if isinstance(impl, type) and declared is None:
                continue  # an annotated attribute: set on the instance (test_engine_api checks them on instances)
            assert hasattr(impl, name), (cls.__name__, part.__name__, name)
            got = inspect.getattr_static(cls, name, None)
            if inspect.isfunction(declared) and inspect.isfunction(got):
                assert _accepts(got, declared), (cls.__name__, name, inspect.signature(got))


def _accepts(got, declared) -> bool:
    """``got`` takes every call ``declared`` allows: the same parameters first, in order, by name
    and kind; any more of its own optional (``Engine.close(timeout_s=30.0)``)."""
    want = list(inspect.signature(declared).parameters.values())
    have = list(inspect.signature(got).parameters.values())
    same = [(p.name, p.kind) for p in have[:len(want)]] == [(p.name, p.kind) for p in want]
    return same and all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                        for p in have[len(want):])


@pytest.mark.parametrize("make", [pc.RadixCache, pc.NoPrefixCache], ids=["radix", "no_prefix"])
def test_both_caches_implement_every_part(make):
    probe = KVPool(1, 1, 4, torch.float32, torch.device("cpu"), 0)
    cache = make(KVPool(1, 1, 4, torch.float32, torch.device("cpu"), 8 * probe.bytes_per_token))
    _check_implements(cache, (*CACHE_PARTS, pc.FullPrefixCache))
    cache.check_invariants()


@pytest.mark.parametrize("cls", [Engine, RemoteEngine])
def test_both_engines_implement_every_part(cls):
    _check_implements(cls, (*ENGINE_PARTS, api.EngineAPI))


class ServingOnly:
    """A test double of the serving part alone, as a thin client or a test may write it."""

    isolation, max_prompt_tokens, max_new_tokens_cap, max_queue = False, 8, 8, 1
    capabilities = api.REMOTE

    def submit(self, request): ...
    def generate(self, request): ...
    def run(self, request): ...
    def prompt_ids(self, request): ...
    def cache_key(self, ids, request): ...
    def key_for(self, request, visitor, sub=None): ...
    def namespace_for(self, visitor, sub=None): ...
    def share_blocks(self, texts): ...
    def info(self): ...
    def healthy(self): return True


def test_a_double_may_implement_one_part_only():
    double = ServingOnly()
    _check_implements(double, (api.ServingAPI,))
    assert not isinstance(double, api.EngineAPI) and not isinstance(double, api.TextAPI)


def test_narrow_parameters_touch_only_their_part():
    """A function in ``server/`` or ``components/`` that takes ``engine: <part>`` reads nothing outside that part."""
    narrow = {p.__name__: members(p) for p in ENGINE_PARTS}
    checked, offenders = 0, []
    for p in sorted([*(ROOT / "server").rglob("*.py"), *(ROOT / "components").rglob("*.py")]):
        for fn in ast.walk(ast.parse(p.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for arg in fn.args.args + fn.args.kwonlyargs:
                if isinstance(arg.annotation, ast.Name) and arg.annotation.id in narrow:
                    checked += 1
                    extra = _attrs_on(fn, arg.arg) - narrow[arg.annotation.id]
                    offenders += [f"{p.relative_to(ROOT)}:{fn.lineno} {arg.arg}.{a}" for a in sorted(extra)]
    assert checked >= 5 and not offenders, (checked, offenders)
