"""Dependencies point one way: app -> components -> engine, and inside the engine
tools -> lab -> serving core. Parsed, not imported, so a violation fails fast."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UI_LIBS = {"gradio", "gradio_client", "plotly", "networkx", "components", "app"}


# A command line in engine/tools may draw its optional HTML report with the UI layer's figure
# code, imported inside the function that writes it (never at module level): nothing in engine/
# imports a tool, so the serving core and the lab still load without gradio or plotly.
LAZY_REPORT_IMPORTS = {"components.replay_report"}


def _imports(path: Path, lazy: bool = True) -> list[str]:
    """Imported module names; ``lazy=False`` leaves out imports inside functions."""
    tree = ast.parse(path.read_text())
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
              for n in ast.walk(f) if n is not f}
    names: list[str] = []
    for node in ast.walk(tree):
        if not lazy and id(node) in nested:
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_engine_imports_no_ui():
    offenders = []
    for p in sorted((ROOT / "engine").rglob("*.py")):
        eager = set(_imports(p, lazy=False))
        for n in _imports(p):
            allowed = p.parent.name == "tools" and n in LAZY_REPORT_IMPORTS and n not in eager
            if n.split(".")[0] in UI_LIBS and not allowed:
                offenders.append(f"{p.relative_to(ROOT)}: {n}")
    assert not offenders, offenders


def test_serving_core_imports_neither_lab_nor_tools():
    offenders = [f"{p.name}: {n}" for p in sorted((ROOT / "engine").glob("*.py"))
                 for n in _imports(p) if n.startswith(("engine.lab", "engine.tools"))]
    assert not offenders, offenders


def test_lab_imports_no_tools():
    offenders = [f"{p.name}: {n}" for p in sorted((ROOT / "engine" / "lab").glob("*.py"))
                 for n in _imports(p) if n.startswith("engine.tools")]
    assert not offenders, offenders


def test_tests_mirror_the_packages():
    """Every test file sits in the group of what it tests (or at the top for the whole tree)."""
    groups = {p.parent.name for p in (ROOT / "tests").rglob("test_*.py")}
    assert groups <= {"tests", "engine", "lab", "ui", "app", "tools"}, groups
