"""Dependencies point one way: app and tools -> components and server -> engine's public modules ->
the serving core. Parsed, not imported, so a violation fails fast.

    app.py, tools/         entry points: may import anything
    components/            the page: engine's public modules only (and the server's HTTP guard)
      panels/                Gradio: each panel's layout and wiring
      views/                 pure: figures, marks, words; no gradio, not even lazily, and no panel
    server/                HTTP: engine's public modules only, never components/
    analysis/              the lab, the replay, the prefill timings: over the engine's public modules
                           (and the torch-free parts of the cache), an engine only through
                           ``EngineAPI``; no UI, no server
    engine/ core           kvcache/, scheduler/, model/, text/ and the local engine: no UI, no analysis,
                           not even inside a function (the analysis keeps its per-engine state itself)

The rules hold through chains, not only for direct imports: the repository's modules and their
imports make a graph (``import a.b.c`` runs ``a``, ``a.b`` and ``a.b.c``), and each rule is checked
on what a module reaches. Two graphs: every import (inside functions too), and the imports that
run when a module is loaded (module level, outside ``if TYPE_CHECKING``), which is what says
remote mode loads no torch: what the page and the server load reaches no module that imports
torch or transformers, and none of the local core. A failure prints the chain.

And no cycles: among the repository's own modules, no chain of imports (module level and inside
functions alike; ``if TYPE_CHECKING`` imports never run and are left out) leads back to where it
started. A lazy import inside a function hides a cycle from Python, not from this test.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "analysis", "server", "components", "tools")
UI_LIBS = {"gradio", "gradio_client", "plotly", "networkx", "components", "app"}
NOT_FOR_ENGINE = UI_LIBS | {"tools", "server"}  # entry points and HTTP sit above the engine
TORCH = {"torch", "transformers"}

# What components/ and server/ may import of the engine: the interface and its plain data,
# the facade base (to extend it: the remote engine), the rules every view shares, the text
# half, the pure radix tree (simulations and the remote shadow tree are built on it). Never the
# local engine, the pool, the cache, the tier, the scheduler or the model. (The analysis
# packages, which the page also reads, sit outside ``engine/``.)
PUBLIC_ENGINE = ("engine.api", "engine.types", "engine.facade", "engine.handle", "engine.validation",
                 "engine.namespaces", "engine.cache_keys", "engine.snapshot_view", "engine.text",
                 "engine.kvcache.radix_tree", "engine.visibility")
ANALYSIS = ("analysis",)
# What analysis may import of the engine: the public modules and the torch-free parts of the
# cache (the tree, the eviction policy, the tier's chunk size; the replay's SimCache is built on
# them). What it still reaches into beyond them, each named here and in its module's docstring:
ANALYSIS_MAY_READ = PUBLIC_ENGINE + ("engine.kvcache.eviction", "engine.kvcache.chunks")
ANALYSIS_REACHES_INTO = {
    "analysis.replay.simulate": {"engine.model.loader"},  # a model's KV geometry, inside model_geometry
}
# The local core: what remote mode must never load. The torch-free parts of its packages
# (the chunk size, the scheduler's plain config, where a model's files are) may be loaded.
LOCAL_CORE = ("engine.engine", "engine.tier_setup", "engine.kvcache", "engine.scheduler", "engine.model")
TORCH_FREE_IN_CORE = ("engine.kvcache.radix_tree", "engine.kvcache.eviction", "engine.kvcache.chunks", "engine.scheduler.config",
                      "engine.model.hub")


def _is(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _modules() -> dict[str, Path]:
    """The repository's modules by dotted name (packages by their ``__init__``)."""
    found = {_module_name(p): p for top in PACKAGES for p in (ROOT / top).rglob("*.py")}
    found["app"] = ROOT / "app.py"
    return found


def _statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run when a module is loaded: not function bodies, not ``if TYPE_CHECKING``."""
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            yield from _statements(node.orelse)
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(node, field, None)
            if isinstance(inner, list):
                yield from _statements([n for n in inner if isinstance(n, ast.stmt)] +
                                       [s for h in inner if isinstance(h, ast.ExceptHandler) for s in h.body])


@functools.cache
def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _names(nodes: Iterator[ast.AST]) -> list[str]:
    """Imported names: ``from a.b import c`` gives ``a.b`` and ``a.b.c`` (a submodule or not)."""
    names: list[str] = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def _imports(path: Path) -> list[str]:
    """Every imported name, module level and inside functions alike (direct imports only)."""
    return _names(ast.walk(_parsed(path)))


@functools.cache
def _edges(module: str, at_load: bool) -> frozenset[str]:
    """What loading (``at_load``) or running ``module`` imports: the repository's modules it runs,
    parent packages included, and the top-level names of outside libraries."""
    tree = _parsed(_modules()[module])
    names = _names(_statements(tree.body) if at_load else ast.walk(tree))
    out: set[str] = set()
    for name in names:
        parts = name.split(".")
        if parts[0] not in _modules() and parts[0] != "app":
            out.add(parts[0])
            continue
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in _modules())
    return frozenset(out)


def _reach(start: str, at_load: bool) -> dict[str, str]:
    """Everything ``start`` reaches, each with the chain that reaches it ("a -> b -> c")."""
    chains = {start: start}
    stack = [start]
    while stack:
        module = stack.pop()
        if module not in _modules():
            continue  # an outside library: its own imports are not ours to check
        for name in sorted(_edges(module, at_load)):
            if name not in chains:
                chains[name] = f"{chains[module]} -> {name}"
                stack.append(name)
    return chains


def _offenders(starts: list[str], bad, at_load: bool = False) -> list[str]:
    return sorted({chain for s in starts for name, chain in _reach(s, at_load).items() if bad(name)})


def _under(*prefixes: str) -> list[str]:
    return sorted(m for m in _modules() if _is(m, prefixes))


def _files(*parts: str) -> list[Path]:
    return sorted((ROOT.joinpath(*parts)).rglob("*.py"))


def test_engine_reaches_no_ui_not_even_lazily():
    offenders = _offenders(_under("engine"), lambda n: n.split(".")[0] in NOT_FOR_ENGINE)
    assert not offenders, offenders


def test_analysis_reaches_no_ui_and_no_server():
    offenders = _offenders(_under("analysis"), lambda n: n.split(".")[0] in NOT_FOR_ENGINE)
    assert not offenders, offenders


def test_serving_core_reaches_no_analysis():
    """Nothing under engine/ imports analysis, not even inside a function (every import statement in
    the syntax tree), nor reaches it through a chain; and the interface names no analysis state."""
    direct = [f"{p.relative_to(ROOT)}:{node.lineno}" for p in _files("engine") for node in ast.walk(ast.parse(p.read_text()))
              if (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "analysis" for a in node.names))
              or (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "analysis")]
    assert not direct, direct
    core = _under("engine")
    offenders = _offenders(core, lambda n: _is(n, ANALYSIS))
    assert not offenders, offenders
    members = {n.name for c in ast.walk(ast.parse((ROOT / "engine" / "api.py").read_text()))
               if isinstance(c, ast.ClassDef) for n in c.body if isinstance(n, ast.FunctionDef)}  # EngineAPI and its parts
    assert not members & {"prefill_timer", "attachment"}, members


def test_analysis_reads_the_engines_public_modules():
    """Direct imports: analysis reads the engine through its public modules, and reaches into the
    core only where ``ANALYSIS_REACHES_INTO`` says (each a named exception, said in its docstring)."""
    offenders = [f"{m}: {n}" for m in _under("analysis") for n in _imports(_modules()[m])
                 if n.split(".")[0] == "engine" and n != "engine" and not _is(n, ANALYSIS_MAY_READ)
                 and not _is(n, tuple(ANALYSIS_REACHES_INTO.get(m, ())))]
    assert not offenders, offenders


# The local engine's parts and the methods it has beyond ``EngineAPI``: the analysis reaches an
# engine through ``EngineAPI`` only (the no-reuse timing through ``PrefillAPI.scratch_prefill``).
LOCAL_ENGINE_ATTRIBUTES = {"runner", "cache", "scheduler", "kv_events", "prefill", "prefill_in_pool",
                           "busy_elsewhere", "compute"}


def test_analysis_reaches_the_engine_only_through_its_interface():
    """No attribute of the local engine beyond ``EngineAPI`` is read anywhere under analysis/
    (``engine.runner``, ``engine.cache``, ``engine.prefill``...): every ``x.name`` in its syntax
    tree is checked, whatever ``x`` is, so a new one fails here however it is spelled."""
    offenders = [f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}"
                 for path in _files("analysis") for node in ast.walk(_parsed(path))
                 if isinstance(node, ast.Attribute) and node.attr in LOCAL_ENGINE_ATTRIBUTES]
    assert not offenders, offenders


def test_lab_reaches_no_replay():
    offenders = _offenders(_under("analysis.lab"), lambda n: _is(n, ("analysis.replay",)))
    assert not offenders, offenders


def test_components_and_server_read_only_the_engines_public_modules():
    """Direct imports: the rest of the engine is reached only through these."""
    offenders = [f"{p.relative_to(ROOT)}: {n}" for p in _files("components") + _files("server")
                 for n in _imports(p) if n.split(".")[0] == "engine" and n != "engine" and not _is(n, PUBLIC_ENGINE)]
    assert not offenders, offenders


def test_views_reach_no_gradio_not_even_lazily():
    """A view is built without a page: nothing under ``components/views`` reaches gradio or a panel."""
    views = _under("components.views")
    assert views, "no views found"
    offenders = _offenders(views, lambda n: n.split(".")[0] in {"gradio", "gradio_client"}
                           or _is(n, ("components.panels", "components.demo")))
    assert not offenders, offenders


def test_server_reaches_no_components_and_components_only_the_guard():
    server = _offenders(_under("server"), lambda n: n.split(".")[0] in {"components", "gradio", "app", "tools"})
    assert not server, server
    components = _offenders(_under("components"), lambda n: n.split(".")[0] in {"server", "app", "tools"}
                            and n not in ("server", "server.request_guard"))  # (its package, run on the way)
    assert not components, components


def test_what_the_page_and_the_server_load_has_no_torch():
    """Remote mode loads these and builds a ``RemoteEngine``: no chain of module-level imports from
    them reaches torch, transformers or the local core. The local engine is imported inside the
    functions that build it (``app.build_engine``), so it loads only when used."""
    starts = ["app", *_under("components", "server", "analysis"), *(m for m in _under(*PUBLIC_ENGINE))]
    torch = _offenders(starts, lambda n: n in TORCH, at_load=True)
    assert not torch, torch
    core = _offenders(starts, lambda n: _is(n, LOCAL_CORE) and not _is(n, TORCH_FREE_IN_CORE)
                      and n not in ("engine.kvcache", "engine.scheduler", "engine.model"), at_load=True)
    assert not core, core


def test_the_torch_free_parts_of_the_core_import_no_torch():
    """Their packages' ``__init__`` files import nothing, so loading them loads only themselves."""
    starts = [*TORCH_FREE_IN_CORE, "engine.kvcache", "engine.scheduler", "engine.model"]
    offenders = _offenders(starts, lambda n: n in TORCH or (_is(n, LOCAL_CORE) and n not in starts), at_load=True)
    assert not offenders, offenders


def test_the_graph_sees_chains():
    """The checks above would pass on an empty graph: make sure it finds a known chain."""
    chains = _reach("engine.engine", at_load=True)
    assert "torch" in chains and "engine.scheduler.scheduler" in chains
    assert "engine.kvcache.kv_pool" in _reach("engine.kvcache.prefix_cache", at_load=True)
    assert "engine.model.loader" not in _reach("analysis.replay.simulate", at_load=True)
    assert "engine.model.loader" in _reach("analysis.replay.simulate", at_load=False)  # inside model_geometry


def test_plain_data_imports_nothing_of_the_engine():
    names = [n for n in _imports(ROOT / "engine" / "types.py") if n.split(".")[0] == "engine"]
    assert not names, names


def test_tests_mirror_the_packages():
    """Every test file sits in the group of what it tests (or at the top for the whole tree)."""
    groups = {p.parent.name for p in (ROOT / "tests").rglob("test_*.py")}
    # remote: server/remote's KV events (their recorded streams in tests/server/remote/fixtures/)
    assert groups <= {"tests", "engine", "lab", "replay", "tools", "ui", "app", "remote", "server", "analysis", "components", "zerogpu"}, groups


def _type_checking_only(tree: ast.Module) -> set[ast.AST]:
    """The import statements under ``if TYPE_CHECKING`` (never run: annotations only)."""
    return {node for block in ast.walk(tree) if isinstance(block, ast.If)
            and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
            for stmt in block.body for node in ast.walk(stmt) if isinstance(node, ast.Import | ast.ImportFrom)}


def _depends_on(module: str) -> set[str]:
    """The repository's modules ``module`` imports anywhere in its file, each by its most precise
    name (``from a.b import c`` is ``a.b.c`` when that is a module, else ``a.b``); parent packages
    that merely run on the way are not dependencies."""
    tree = _parsed(_modules()[module])
    skip = _type_checking_only(tree)
    out: set[str] = set()
    for node in ast.walk(tree):
        if node in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in _modules())
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in _modules():
                    out.add(full)
                elif node.module in _modules():
                    out.add(node.module)
    out.discard(module)
    return out


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as its path (first node repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_cycles():
    """Cycles among our own modules, lazy imports included, fail with their path."""
    cycle = _find_cycle({m: _depends_on(m) for m in _modules()})
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_cycles():
    """The check above would pass on an empty graph: make sure it finds one, and reads lazy imports."""
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None
    assert "components.chat_presets" in _depends_on("components.warm_start")
    assert "engine.model.loader" in _depends_on("analysis.replay.simulate")  # inside model_geometry
    assert "engine.kvcache.radix_tree" not in _depends_on("engine.kvcache.eviction")  # TYPE_CHECKING only


def test_test_modules_have_unique_names():
    """The tests folders have no ``__init__.py``: pytest imports each test file by its bare name, so two
    files of one name in different folders stop the whole run at collection."""
    from collections import Counter

    names = Counter(p.name for p in (ROOT / "tests").rglob("test_*.py"))
    assert not [n for n, c in names.items() if c > 1], sorted(n for n, c in names.items() if c > 1)
