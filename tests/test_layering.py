"""Dependencies point one way: the engine never imports the UI libraries."""

from __future__ import annotations

import ast
from pathlib import Path

FORBIDDEN = {"gradio", "gradio_client", "plotly", "networkx", "components", "app"}


def test_engine_imports_no_ui():
    root = Path(__file__).resolve().parents[1] / "engine"
    offenders = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert not offenders, offenders
