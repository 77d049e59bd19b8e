"""Nodes in the second tier are drawn apart from the pool's: hollow in the tree with dotted
edges, hatched in the icicle, named in the hover and in a legend entry; the JSON summary
carries the flag. Pure figures on a synthetic snapshot, then on a real engine's."""

from __future__ import annotations

import plotly.graph_objects as go
import pytest

from components.views.tree_figures import SPILLED_LINE, snapshot_summary, tree_figure
from engine.kvcache.kv_tier import CHUNK_TOKENS
from engine.types import GenerationRequest, NodeInfo, SamplingParams, TreeSnapshot


def snapshot(tier_kind: str) -> TreeSnapshot:
    nodes = (NodeInfo(1, 0, 40, 40, 400, 0, 2, 3.0, "", False, tuple(range(40)), "system prompt"),
             NodeInfo(2, 1, 10, 50, 100, 0, 1, 5.0, "", False, tuple(range(10)), "kept in the pool"),
             NodeInfo((1 << 40) + 7, 1, 24, 64, 240, 0, 0, 9.0, "", False, tuple(range(24)), "on disk", True))
    return TreeSnapshot(nodes, 50, 500, 1000, 100, 0, 10, tier_kind)


def hovers(fig: go.Figure) -> list[str]:
    return [h for t in fig.data for h in (t.hovertext or ())]


@pytest.mark.parametrize("kind", ["disk", "host memory"])
def test_spilled_nodes_are_marked_in_both_views_the_hover_and_the_legend(kind):
    snap = snapshot(kind)
    tree = tree_figure(snap, collapse_chains=False)
    spilled_hover = next(h for h in hovers(tree) if "on disk" in h)
    assert f"in the second tier ({kind})" in spilled_hover
    assert not any("second tier" in h for h in hovers(tree) if "kept in the pool" in h)
    points = next(t for t in tree.data if t.hovertext)
    i = next(i for i, h in enumerate(points.hovertext) if "on disk" in h)
    assert points.marker.color[i] == "white" and points.marker.line.color[i] == SPILLED_LINE  # hollow
    assert any(t.mode == "lines" and t.line.dash == "dot" and t.x for t in tree.data)  # its edge dotted
    legend = [t for t in tree.data if t.showlegend]
    assert tree.layout.showlegend and len(legend) == 1 and f"second tier ({kind})" in legend[0].name
    icicle = tree_figure(snap, view="icicle")
    bars = icicle.data[0]
    j = next(j for j, h in enumerate(bars.hovertext) if "on disk" in h)
    assert bars.marker.pattern.shape[j] == "/" and set(bars.marker.pattern.shape) == {"/", ""}  # hatched
    assert [t.name for t in icicle.data if t.showlegend] == [legend[0].name]
    for fig in (tree, icicle):
        go.Figure(fig.to_dict())  # valid plotly
    summary = snapshot_summary(snap)
    assert [n["spilled"] for n in summary["nodes"]] == [False, False, True] and summary["tier_kind"] == kind


def test_no_legend_and_no_pattern_without_spilled_nodes():
    snap = snapshot("disk")
    plain = TreeSnapshot(snap.nodes[:2], 50, 500, 1000, 100, 0, 10)
    assert not tree_figure(plain).layout.showlegend
    assert tree_figure(plain, view="icicle").data[0].marker.pattern.shape is None


def test_a_real_offloaded_cache_draws_its_spilled_nodes(tiny_runner, tmp_path, make_engine):
    engine = make_engine(budget_bytes=1000 * tiny_runner.kv_bytes_per_token, tier_bytes=2**24,
                         tier_dir=str(tmp_path))
    engine.run(GenerationRequest(prompt_ids=tuple(range(100, 100 + 2 * CHUNK_TOKENS + 3)),
                                 sampling=SamplingParams(max_new_tokens=2)))
    engine.offload_cache()
    snap = engine.snapshot()
    assert [n.num_tokens for n in snap.nodes if n.spilled] == [2 * CHUNK_TOKENS]
    assert any("in the second tier (disk)" in h for h in hovers(tree_figure(snap)))
