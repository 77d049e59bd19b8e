"""Tree marks, tree figures and charts (all pure) on real engine snapshots and synthetic big trees."""

from __future__ import annotations

import random

import plotly.graph_objects as go
import pytest

from analysis.no_reuse import run_measured
from components.panels.common import playground_history
from components.views.charts import hit_rate_figure, latency_bars, memory_gauge, reuse_bars, speedup_scatter
from components.views.tree_figures import snapshot_summary, tree_figure
from components.views.tree_marks import COMPUTED, REUSED, request_path, visual_tree
from engine.engine import Engine
from engine.types import GenerationRequest, NodeInfo, SamplingParams, TreeSnapshot


def run(engine: Engine, ids: list[int], n: int = 4, baseline: bool = False, namespace: str = ""):
    return run_measured(engine, GenerationRequest(prompt_ids=tuple(ids), sampling=SamplingParams(max_new_tokens=n),
                                                  measure_baseline=baseline, namespace=namespace))


@pytest.fixture
def engine(tiny_runner, make_engine) -> Engine:
    return make_engine(tiny_runner, budget_bytes=4000 * tiny_runner.kv_bytes_per_token)


def shared_prefix_prompts(n: int = 3) -> list[list[int]]:
    base = list(range(100, 140))
    return [base + [500 + 10 * i + j for j in range(6)] for i in range(n)]


def drawn_points(fig: go.Figure) -> int:
    """Marks drawn (node markers or bars), not edges nor the colour-bar's placeholder."""
    return sum(sum(x is not None for x in (t.x or ())) for t in fig.data
               if t.type == "bar" or (t.type == "scatter" and t.mode != "lines"))


# ---------------------------------------------------------------- request path
def test_request_path_marks_reused_then_computed_nodes(engine):
    a, b = shared_prefix_prompts(2)
    run(engine, a)
    m = run(engine, b)
    assert m.cached_tokens == 40
    snap = engine.snapshot()
    path = request_path(snap, m)
    by_id = {n.node_id: n for n in snap.nodes}
    reused = [by_id[i] for i, s in path.items() if s == REUSED]
    computed = [by_id[i] for i, s in path.items() if s == COMPUTED]
    assert sum(n.num_tokens for n in reused) == 40  # the split put a node boundary at the cached length
    assert computed and all(n.depth_tokens > 40 for n in computed)
    assert sum(n.num_tokens for n in reused + computed) >= m.prompt_tokens


def test_request_path_is_empty_without_a_request_and_survives_eviction(engine):
    a, _ = shared_prefix_prompts(2)
    m = run(engine, a)
    assert request_path(engine.snapshot(), None) == {}
    engine.clear_cache()
    assert request_path(engine.snapshot(), m) == {}


# ---------------------------------------------------------------- visual tree
def test_chains_collapse_but_reused_and_computed_parts_stay_apart(engine):
    first = list(range(100, 160))
    m1 = run(engine, first, n=6)
    turn2 = first + m1.output_ids + list(range(700, 720))
    m2 = run(engine, turn2, n=6)  # a chat's second turn: one long chain of nodes
    snap = engine.snapshot()
    path = request_path(snap, m2)
    marks = visual_tree(snap, path)
    assert len(snap.nodes) >= 3
    drawn = [m for vid, m in marks.items() if vid]
    assert len(drawn) == 2  # the reused run and the computed run
    assert {m.status for m in drawn} == {REUSED, COMPUTED}
    assert sum(m.num_tokens for m in drawn) == snap.num_tokens
    assert len(visual_tree(snap, path, collapse_chains=False)) - 1 == len(snap.nodes)


def synthetic_snapshot(branches: int, leaves: int, seed: int = 0) -> TreeSnapshot:
    """A shared prefix, ``branches`` children, each with ``leaves`` leaves (a third hidden)."""
    rng = random.Random(seed)
    nodes, next_id = [NodeInfo(1, 0, 200, 200, 200, 0, 9, 1.0, "", False, tuple(range(200)), "system")], 2
    for b in range(branches):
        bid, next_id = next_id, next_id + 1
        nodes.append(NodeInfo(bid, 1, 20, 220, 20, 0, 3, 5.0, "", False, (1000 + b,) * 20, f"branch {b}"))
        for leaf in range(leaves):
            hidden = leaf % 3 == 0
            nodes.append(NodeInfo(next_id, bid, 10, 230, 10, 0, 1, rng.random() * 900, "other" if hidden else "",
                                  hidden, () if hidden else (5000 + leaf,) * 10, "" if hidden else f"leaf {leaf}"))
            next_id += 1
    return TreeSnapshot(tuple(nodes), sum(n.num_tokens for n in nodes), 0, 2**30, 0, 0, 1)


@pytest.mark.parametrize("view", ["tree", "icicle"])
def test_thousands_of_nodes_stay_readable(view):
    snap = synthetic_snapshot(branches=30, leaves=60)
    assert len(snap.nodes) > 1800
    fig = tree_figure(snap, view=view)
    limit = 2000 if view == "icicle" else 300
    assert drawn_points(fig) <= limit + 1  # + the root
    marks = visual_tree(snap, max_nodes=300, max_fan=40)
    assert len(marks) - 1 <= 300 + 30  # each fan keeps a few leaves plus one "+N nodes" mark
    # Nothing is lost: every node is drawn or counted in a group, and so is every token.
    drawn = [m for m in marks.values() if m.vid and not m.grouped_nodes]
    groups = [m for m in marks.values() if m.grouped_nodes]
    assert sum(len(m.member_ids) for m in drawn) + sum(g.grouped_nodes for g in groups) == len(snap.nodes)
    assert sum(m.num_tokens for m in drawn) + sum(g.grouped_tokens for g in groups) == snap.num_tokens


def test_a_highlighted_leaf_is_never_folded_into_a_group():
    snap = synthetic_snapshot(branches=2, leaves=200)
    target = next(n for n in snap.nodes if n.text == "leaf 199")
    marks = visual_tree(snap, {target.node_id: COMPUTED}, max_nodes=50, max_fan=10)
    assert target.node_id in marks and marks[target.node_id].status == COMPUTED


def test_hover_escapes_text_and_hidden_nodes_show_no_text():
    nodes = (NodeInfo(1, 0, 5, 5, 50, 1, 2, 3.0, "", False, (1, 2, 3, 4, 5), "<script>alert(1)</script>"),
             NodeInfo(2, 1, 7, 12, 70, 0, 0, 9.0, "v-other", True, (), ""))
    snap = TreeSnapshot(nodes, 12, 120, 1000, 100, 0, 10)
    fig = tree_figure(snap)
    hovers = [h for t in fig.data for h in (t.hovertext or ())]
    assert any("&lt;script&gt;" in h for h in hovers) and not any("<script>" in h for h in hovers)
    hidden = next(h for h in hovers if "another visitor" in h)
    assert "7 tokens" in hidden and "<i>" not in hidden
    assert any("locked" in h for h in hovers)
    summary = snapshot_summary(snap)
    assert summary["nodes"][1] == {**summary["nodes"][1], "hidden": True, "text": None}


def test_empty_tree_and_colour_modes(engine):
    assert tree_figure(engine.snapshot()).layout.annotations  # "The cache is empty"
    for a in shared_prefix_prompts(3):
        run(engine, a)
    for view in ("tree", "icicle"):
        for color in ("recency", "hits"):
            fig = tree_figure(engine.snapshot(), color_by=color, view=view)
            assert fig.layout.uirevision == f"{view}-{color}"  # keeps the user's zoom across refreshes
            assert drawn_points(fig) >= 3


# ---------------------------------------------------------------- charts
def test_charts_from_real_history(engine):
    assert hit_rate_figure([]).layout.annotations and latency_bars([]).layout.annotations
    for a in shared_prefix_prompts(3):
        run(engine, a, baseline=True)
    history = playground_history(engine)  # the page's history: the no-reuse figures measured after each answer
    assert len(hit_rate_figure(history).data) == 3
    bars = latency_bars(history)
    assert [t.name for t in bars.data] == ["without reuse", "with reuse"] and len(bars.data[0].x) == 3
    assert list(speedup_scatter(history).data[0].x) == [m.cached_tokens for m in history]
    from engine.visibility import Unit, everyone, shipped

    s = engine.stats()
    gauge = memory_gauge(everyone(s.cache_bytes, Unit.BYTES), shipped(s.budget_bytes, Unit.BYTES))
    assert gauge.data[0].value == pytest.approx(engine.stats().cache_bytes / 2**20)
    stacked = reuse_bars([m.cached_tokens for m in history], [m.computed_tokens for m in history])
    assert list(stacked.data[0].y) == [0, 40, 40]


def test_the_growth_curves_filler_says_what_it_is(engine):
    """While the Latency tab's curve is measured, its filler is in the tree: labelled as the app's own
    measurement, never shown as if a visitor had asked it."""
    from analysis.prefill_timing import GROWTH_NAMESPACE

    run(engine, list(range(200, 260)), namespace=GROWTH_NAMESPACE)
    fig = tree_figure(engine.snapshot())
    text = " ".join(str(a.text) for a in fig.layout.annotations or ()) + " ".join(
        str(t.text) for t in fig.data if t.text is not None) + " ".join(h for t in fig.data for h in (t.hovertext or ()))
    assert "measuring (cleared soon)" in text and "how the win grows" in text
