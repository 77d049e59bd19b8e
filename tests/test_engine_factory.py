"""Tests build their engines through one factory (``tests/engines.py``, the ``make_engine`` and
``make_module_engine`` fixtures), which closes each one at the end of its scope, passed or failed.

A pure text scan of ``tests/``: an engine built in code by hand is on a line that says why
(``# by hand: <reason>``); one named inside a string (a subprocess's script, a docstring) is in a
file listed below with its reason. Knows nothing of the engine: it reads source text only."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SKIPPED = {TESTS / "engines.py", Path(__file__).resolve()}  # the factory itself; this scan's own samples
MARK = "# by hand:"
STRING_TOKENS = {tokenize.STRING} | {getattr(tokenize, n) for n in ("FSTRING_MIDDLE",) if hasattr(tokenize, n)}

IN_STRINGS = {  # file: why it names the constructor inside a string
    "engine/test_compute_thread.py": "the script a fresh interpreter runs: no fixtures there",
    "engine/test_config.py": "the module docstring states the constructor's two forms",
}


def constructions(path: Path) -> list[tuple[int, bool]]:
    """(line, inside a string) of each ``Engine`` followed by ``(`` in the file."""
    text = path.read_text(encoding="utf-8")
    found = []
    if "Engine(" not in text:  # most files: no tokenizing at all
        return found
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(text).readline)
              if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT)]
    for tok, nxt in zip(tokens, tokens[1:], strict=False):
        if tok.type == tokenize.NAME and tok.string == "Engine" and nxt.string == "(":
            found.append((tok.start[0], False))
        elif tok.type in STRING_TOKENS:
            start = tok.start[0]
            for offset, line in enumerate(tok.string.splitlines()):
                if _named(line):
                    found.append((start + offset, True))
    return found


def _named(line: str) -> bool:
    """``Engine(`` on the line, not as the end of a longer name (``RemoteEngine(``)."""
    at = line.find("Engine(")
    while at >= 0:
        if at == 0 or not (line[at - 1].isalnum() or line[at - 1] == "_"):
            return True
        at = line.find("Engine(", at + 1)
    return False


def test_every_engine_built_by_hand_says_why():
    lines_of: dict[Path, list[str]] = {}
    unexplained, strings_seen = [], set()
    for path in sorted(TESTS.rglob("*.py")):
        if path in SKIPPED:
            continue
        rel = path.relative_to(TESTS).as_posix()
        for line_no, in_string in constructions(path):
            if in_string:
                strings_seen.add(rel)
                if rel not in IN_STRINGS:
                    unexplained.append(f"tests/{rel}:{line_no}: inside a string (add the file to IN_STRINGS)")
                continue
            lines = lines_of.setdefault(path, path.read_text(encoding="utf-8").splitlines())
            if MARK not in lines[line_no - 1]:
                unexplained.append(f"tests/{rel}:{line_no}: use make_engine / make_module_engine, "
                                   f"or say '{MARK} <reason>' on the line")
    assert not unexplained, "engines built by hand without a reason:\n" + "\n".join(unexplained)
    assert strings_seen == set(IN_STRINGS), f"IN_STRINGS lists files that no longer need it: " \
                                            f"{sorted(set(IN_STRINGS) - strings_seen)}"


def test_the_scan_finds_code_and_strings_and_not_longer_names(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('"""A docstring naming Engine(runner)."""\n'
                      "e = Engine(r)\n"
                      "f = engine.Engine(r)  # by hand: a reason\n"
                      "g = RemoteEngine(url)\n"
                      "h = make_engine(r)\n"
                      "SCRIPT = '''\nx = 1\nEngine(r)\n'''\n", encoding="utf-8")
    assert constructions(sample) == [(1, True), (2, False), (3, False), (8, True)]
