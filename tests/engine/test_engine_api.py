"""The written engine interface (engine/api.py): both engines implement all of it, panels ask
capabilities instead of testing the class, and the change counter moves only when something did."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from engine.api import LOCAL, REMOTE, EngineAPI
from engine.types import EngineError, GenerationRequest, SamplingParams
from server.remote.engine import RemoteEngine

ROOT = Path(__file__).resolve().parents[2]
# its parts' members too (``ServingAPI`` ... ``ControlAPI``): methods, properties and annotated attributes
MEMBERS = [n for n in dir(EngineAPI) if not n.startswith("_")] + [
    n for part in EngineAPI.__mro__ if getattr(part, "_is_protocol", False) for n in vars(part).get("__annotations__", {})]


@pytest.fixture(scope="module")
def local(make_module_engine):
    eng = make_module_engine(max_new_tokens_cap=8)
    yield eng


@pytest.fixture(scope="module")
def remote(tokenizer):
    eng = RemoteEngine("http://127.0.0.1:9", "m", tokenizer)  # never contacted here
    yield eng
    eng.close()


def test_both_engines_implement_all_of_it(local, remote):
    for eng in (local, remote):
        assert isinstance(eng, EngineAPI)
        missing = [m for m in MEMBERS if not hasattr(eng, m)]
        assert not missing, (type(eng).__name__, missing)
    assert local.capabilities.local_cache and local.capabilities == LOCAL
    assert remote.capabilities == REMOTE and remote.capabilities.remote and not remote.capabilities.local_cache
    assert remote.info().backend == "http://127.0.0.1:9" and local.info().backend == ""
    assert local.fleet_view() is None and remote.fleet_view() is None  # a fleet only with --fleet


def test_what_remote_cannot_do_says_so(remote):
    assert remote.step_log() == [] and remote.persist_cache() is None
    for call in (lambda: remote.spawn(1 << 20), lambda: remote.set_budget(1 << 20),
                 lambda: remote.configure_scheduler(max_batch=2)):
        with pytest.raises(EngineError):
            call()
    assert not hasattr(remote, "cache") and not hasattr(remote, "runner")  # no fakes of the local engine's parts


def test_change_counter_moves_with_the_cache_not_with_reads(local):
    before = local.version()
    local.stats(), local.snapshot(), local.recent()
    assert local.version() == before
    local.run(GenerationRequest(prompt="count me", sampling=SamplingParams(max_new_tokens=2)))
    after = local.version()
    assert after != before
    local.clear_cache()
    assert local.version() != after


def test_the_engine_keeps_no_analysis_state_and_spawns(local, tiny_runner, make_engine):
    """The analysis keeps its per-engine objects itself (``analysis.per_engine``), not the engine."""
    from analysis.per_engine import per_engine

    made = []
    first = per_engine(local, "t", lambda: made.append(1) or object())
    assert per_engine(local, "t", lambda: made.append(1) or object()) is first and made == [1]
    assert not hasattr(local, "attachment") and not hasattr(local, "prefill_timer")
    other = make_engine()
    assert per_engine(other, "t", object) is not first
    child = local.spawn(64 * tiny_runner.kv_bytes_per_token)
    assert isinstance(child, EngineAPI) and child.stats().budget_bytes == 64 * tiny_runner.kv_bytes_per_token
    child.close()


def test_panels_ask_capabilities_not_the_class():
    """No panel, lab module or HTTP route reaches into a local engine's parts or probes the engine's type."""
    offenders = []
    for p in sorted([*(ROOT / "components").rglob("*.py"), *(ROOT / "analysis" / "lab").glob("*.py"), ROOT / "app.py",
                     *(ROOT / "server").glob("*.py")]):  # server/remote/ is an engine itself
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "engine" \
                    and node.attr in {"cache", "runner", "scheduler", "tier", "text"}:
                offenders.append(f"{p.relative_to(ROOT)}:{node.lineno} engine.{node.attr}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") in {"getattr", "hasattr", "isinstance"} \
                    and node.args and "engine" in ast.unparse(node.args[0]):
                offenders.append(f"{p.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not offenders, offenders


def test_the_interface_documents_its_contract():
    doc = inspect.getdoc(inspect.getmodule(EngineAPI))
    for word in ("submit", "snapshot", "version", "clear_cache", "key_for", "capabilities"):
        assert word in doc


def test_stats_are_built_in_one_place():
    """``EngineStats`` is built only by ``engine.facade.engine_stats``: the local engine, the remote
    one and a viewer's view of either fill in the same fields the same way."""
    builders = []
    for p in sorted([*(ROOT / "engine").rglob("*.py"), *(ROOT / "server").rglob("*.py"),
                     *(ROOT / "components").rglob("*.py")]):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "EngineStats":
                builders.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert len(builders) == 1 and builders[0].startswith("engine/facade.py:"), builders
