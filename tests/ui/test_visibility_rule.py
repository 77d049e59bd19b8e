"""Every figure the page shows says whose it is (``engine.visibility``): a view or panel that
reads a figure over everyone's work without declaring it does not pass this test.

The rule, read from the source (``ast``) of ``components/panels`` and ``components/views``: each
read of a field that can hold another visitor's work (``EVERYONE_FIELDS``: the engine's
server-wide stats, a forward's batch size, a replica's and the fleet's figures, the timings'
scratch buffers) sits inside a declaration, ``own(...)``, ``shipped(...)`` or ``everyone(...)``,
which ``format.fmt_figure`` and ``Audience.show`` then show exact, coarse or not at all. A module
whose every figure is the viewer's own (the lab's, the replay's and the routing simulations'
reports: the visitor's own input run on its own engine) says so once, ``FIGURES_WHOSE = "own"``.
A new view that shows such a field without a declaration fails here, and so does a new field
added to the engine's stats until it is sorted into the list below."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from engine.types import EngineStats, FleetView, ReplicaView, StepRecord

ROOT = Path(__file__).resolve().parents[2]
DECLARATIONS = {"own", "shipped", "everyone"}

# Fields of the engine's plain data whose value can include other visitors' work.
EVERYONE_FIELDS = {
    # EngineStats: the cache's and the scheduler's figures now (a viewer's stats(viewer) totals are theirs,
    # but the same field names also come from engine.stats(), everyone's)
    "cache_bytes", "cached_tokens_now", "num_nodes", "evicted_tokens", "queue_depth", "locked_tokens", "running",
    "waiting", "tokens_per_s", "running_bytes", "tree_bytes", "shared_tokens", "tier_bytes", "tier_chunks",
    "tier_loaded_tokens", "tier_spilled_tokens", "tier_bytes_read", "tier_bytes_written", "tier_queued_bytes",
    # StepRecord and RequestMetrics: how many requests shared a forward
    "batch_size", "batch_size_max", "batch_size_mean",
    # ReplicaView / FleetView: a replica's and the fleet's figures (every client's)
    "blocks_held", "tokens_held", "requests_landed", "hit_rate", "tokens_distinct", "tokens_on_several",
    "duplicate_copy_tokens", "duplicate_bytes",
    # the timings' scratch buffers (one visitor's prompt while it runs)
    "scratch_bytes",
}
# Fields that are the viewer's own, shipped, or no figure at all (sorted here so a new one is noticed).
NOT_EVERYONES = {
    "requests", "prompt_tokens", "cached_tokens", "computed_tokens", "prefill_ms",  # totals: stats(viewer)'s own
    "budget_bytes", "max_batch", "tier_budget_bytes", "tier_queue_bound_bytes", "tier_kind",  # settings: shipped
    "kv_events_dropped_batches",  # the operator's (/metrics only)
    "step_id", "kind", "request_ids", "namespaces", "duration_ms", "finished_at",
    "prefill_request_ids", "url", "snapshot", "block_size", "events_alive", "state", "since", "replicas",
    "kv_bytes_per_token",
}


def _sources() -> list[Path]:
    return sorted(p for d in ("components/panels", "components/views") for p in (ROOT / d).rglob("*.py"))


def _module_whose(tree: ast.Module) -> str | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "FIGURES_WHOSE"
                                                for t in node.targets):
            assert isinstance(node.value, ast.Constant) and node.value.value in ("own", "shipped")
            return node.value.value
    return None


def _undeclared(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    if _module_whose(tree):
        return []
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node

    def declared(node: ast.AST) -> bool:
        while node in parents:
            node = parents[node]
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                if name in DECLARATIONS:
                    return True
        return False

    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.attr in EVERYONE_FIELDS
                and not declared(node)):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    return out


def test_every_figure_a_view_reads_is_declared():
    missing = [line for path in _sources() for line in _undeclared(path)]
    assert not missing, "undeclared figures (wrap in own/shipped/everyone):\n" + "\n".join(missing)


def test_every_field_of_the_engines_plain_data_is_sorted():
    fields = {f.name for cls in (EngineStats, StepRecord, ReplicaView, FleetView) for f in dataclasses.fields(cls)}
    unsorted = fields - EVERYONE_FIELDS - NOT_EVERYONES
    assert not unsorted, f"sort these into EVERYONE_FIELDS or NOT_EVERYONES: {sorted(unsorted)}"


def test_a_view_refuses_a_bare_number():
    import pytest

    from components.views.format import fmt_figure
    from engine.visibility import Audience, Unit, everyone, own, shipped

    public = Audience(public=True, bytes_per_token=10)
    with pytest.raises(TypeError):
        fmt_figure(1234, public)
    assert fmt_figure(own(1234, Unit.TOKENS), public) == "1,234"
    assert fmt_figure(shipped(1234, Unit.TOKENS), public) == "1,234"
    assert fmt_figure(everyone(1234, Unit.TOKENS), public) == "≤1,280"
    assert fmt_figure(everyone(5, Unit.COUNT), public) == "≤8"
    assert fmt_figure(everyone(0.5), public) == "not shown on a public page"
    assert fmt_figure(everyone(1234, Unit.TOKENS), Audience(public=False)) == "1,234"
