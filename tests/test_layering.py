"""Dependencies point one way: app -> components -> engine, and inside the engine
tools -> lab -> serving core. Parsed, not imported, so a violation fails fast."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UI_LIBS = {"gradio", "gradio_client", "plotly", "networkx", "components", "app"}


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_engine_imports_no_ui():
    offenders = [f"{p.relative_to(ROOT)}: {n}" for p in sorted((ROOT / "engine").rglob("*.py"))
                 for n in _imports(p) if n.split(".")[0] in UI_LIBS]
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
