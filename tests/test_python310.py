"""The code runs on Python 3.10 (a ZeroGPU Space runs 3.10.13; docs/SPACES.md), though no 3.10 lies
on the machines that test it: every Python file parses with 3.10's grammar, and none reaches for the
standard library's 3.11-only names. ruff (``target-version = "py310"``) keeps it from rewriting code
into 3.11 forms; this catches what ruff does not look at. Parsed, nothing run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("app.py", "engine", "analysis", "components", "server", "tools", "tests")

# module: names it gained in 3.11, whether imported from it or read off it (``datetime.UTC``).
NEW_IN_311 = {
    "datetime": {"UTC"},
    "typing": {"Self", "Never", "assert_never", "assert_type", "reveal_type", "LiteralString", "Required",
               "NotRequired", "dataclass_transform", "TypeVarTuple", "Unpack", "get_overloads", "clear_overloads"},
    "enum": {"StrEnum", "ReprEnum", "EnumCheck", "FlagBoundary", "verify", "member", "nonmember", "global_enum"},
    "asyncio": {"TaskGroup", "timeout", "timeout_at", "Runner", "Barrier"},
    "contextlib": {"chdir"},
    "hashlib": {"file_digest"},
    "operator": {"call"},
    "math": {"cbrt", "exp2"},
    "logging": {"getLevelNamesMapping"},
    "sys": {"exception"},
    "inspect": {"getmembers_static", "ismethodwrapper"},
    "locale": {"getencoding"},
}
MODULES_NEW_IN_311 = {"tomllib", "wsgiref.types"}
BUILTINS_NEW_IN_311 = {"ExceptionGroup", "BaseExceptionGroup"}
# 3.11's fromisoformat reads any ISO 8601 ("...Z" included); 3.10's only what isoformat() writes.
FROMISOFORMAT_OK = {"analysis/replay/log_formats.py", "tests/replay/test_log_formats.py"}


def _files() -> list[Path]:
    out = []
    for name in PACKAGES:
        path = ROOT / name
        out.extend([path] if path.is_file() else sorted(path.rglob("*.py")))
    return out


def _problems(rel: str, source: str) -> list[str]:
    """What in ``source`` (the file ``rel``, from the repository root) would not run on Python 3.10."""
    try:
        tree = ast.parse(source, filename=rel, feature_version=(3, 10))
    except SyntaxError as e:
        return [f"{rel}:{e.lineno}: not Python 3.10 syntax ({e.msg})"]
    found = []
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name} (3.11)" for a in node.names if a.name in MODULES_NEW_IN_311]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module in MODULES_NEW_IN_311:
                found.append(f"{where}: from {node.module} (3.11)")
            found += [f"{where}: from {node.module} import {a.name} (3.11)" for a in node.names
                      if a.name in NEW_IN_311.get(node.module, ())]
        elif isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.attr in NEW_IN_311.get(node.value.id, ()):
                found.append(f"{where}: {node.value.id}.{node.attr} (3.11)")
            elif node.attr == "add_note":
                found.append(f"{where}: .add_note (3.11)")
            elif node.attr == "fromisoformat" and rel not in FROMISOFORMAT_OK:
                found.append(f"{where}: fromisoformat reads less on 3.10: use log_formats._fromisoformat's way")
        elif isinstance(node, ast.Name) and node.id in BUILTINS_NEW_IN_311:
            found.append(f"{where}: {node.id} (3.11)")
    return found


def test_every_file_is_python_310():
    files = _files()
    assert len(files) > 100, "the file walk found too little"
    problems = [p for f in files for p in _problems(f.relative_to(ROOT).as_posix(), f.read_text())]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("source", [
    "from datetime import UTC\n", "import datetime\nx = datetime.UTC\n", "import tomllib\n",
    "from typing import Self\n", "import asyncio\nasyncio.TaskGroup()\n", "raise ExceptionGroup('x', [])\n",
    "try:\n    pass\nexcept* ValueError:\n    pass\n", "from datetime import datetime\ndatetime.fromisoformat('x')\n",
])
def test_the_check_finds_311_code(source):
    assert _problems("m.py", source)
    assert not _problems("m.py", "from datetime import timezone\nx = timezone.utc\n")
