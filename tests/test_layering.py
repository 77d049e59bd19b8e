"""Dependencies point one way: app and tools -> components and server -> engine's public modules ->
the serving core. Parsed, not imported, so a violation fails fast.

    app.py, tools/         entry points: may import anything
    components/            the page: engine's public modules only (and the server's HTTP guard)
    server/                HTTP: engine's public modules only, never components/
    engine/lab, engine/replay   analysis over the engine's interface
    engine/ core           kvcache/, scheduler/, model/, text/ and the facade: no UI, no analysis
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UI_LIBS = {"gradio", "gradio_client", "plotly", "networkx", "components", "app"}
NOT_FOR_ENGINE = UI_LIBS | {"tools", "server"}  # entry points and HTTP sit above the engine

# What components/ and server/ may import of the engine: the interface and its plain data,
# the facade (to build or extend it), the rules every view shares, the text half, the pure
# radix tree (simulations and the remote shadow tree are built on it), the prefill timer
# the page shows, and the analysis packages. Never the pool, the cache, the tier, the
# scheduler or the model.
PUBLIC_ENGINE = ("engine.api", "engine.types", "engine.engine", "engine.handle", "engine.validation",
                 "engine.namespaces", "engine.snapshot_view", "engine.prefill_timing", "engine.text",
                 "engine.kvcache.radix_tree", "engine.lab", "engine.replay")
ANALYSIS = ("engine.lab", "engine.replay")


def _imports(path: Path) -> list[str]:
    """Every imported module name, module level and inside functions alike."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] if node.module != "engine" else [f"engine.{a.name}" for a in node.names]
    return names


def _files(*parts: str) -> list[Path]:
    return sorted((ROOT.joinpath(*parts)).rglob("*.py"))


def _is(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_engine_imports_no_ui_not_even_lazily():
    offenders = [f"{p.relative_to(ROOT)}: {n}" for p in _files("engine") for n in _imports(p)
                 if n.split(".")[0] in NOT_FOR_ENGINE]
    assert not offenders, offenders


def test_serving_core_imports_no_analysis():
    core = [p for p in _files("engine") if not _is(".".join(p.relative_to(ROOT).with_suffix("").parts), ANALYSIS)]
    offenders = [f"{p.relative_to(ROOT)}: {n}" for p in core for n in _imports(p) if _is(n, ANALYSIS)]
    assert not offenders, offenders


def test_lab_imports_no_replay():
    offenders = [f"{p.name}: {n}" for p in _files("engine", "lab") for n in _imports(p) if _is(n, ("engine.replay",))]
    assert not offenders, offenders


def test_components_and_server_read_only_the_engines_public_modules():
    offenders = [f"{p.relative_to(ROOT)}: {n}" for p in _files("components") + _files("server")
                 for n in _imports(p) if n.split(".")[0] == "engine" and not _is(n, PUBLIC_ENGINE)]
    assert not offenders, offenders


def test_server_never_imports_components_and_components_only_the_guard():
    server = [f"{p.relative_to(ROOT)}: {n}" for p in _files("server") for n in _imports(p)
              if n.split(".")[0] in {"components", "gradio", "app", "tools"}]
    assert not server, server
    components = [f"{p.relative_to(ROOT)}: {n}" for p in _files("components") for n in _imports(p)
                  if n.split(".")[0] in {"server", "app", "tools"} and n != "server.request_guard"]
    assert not components, components


def test_plain_data_imports_nothing_of_the_engine():
    names = [n for n in _imports(ROOT / "engine" / "types.py") if n.split(".")[0] == "engine"]
    assert not names, names


def test_tests_mirror_the_packages():
    """Every test file sits in the group of what it tests (or at the top for the whole tree)."""
    groups = {p.parent.name for p in (ROOT / "tests").rglob("test_*.py")}
    # remote: server/remote's KV events (their recorded streams in tests/remote/fixtures/)
    assert groups <= {"tests", "engine", "lab", "replay", "tools", "ui", "app", "remote"}, groups
