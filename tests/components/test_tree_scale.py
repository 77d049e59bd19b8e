"""The tree view on big trees shaped like real traffic (components.views.tree_bench's simulated chats on a real
RadixTree): 2,000 and 5,000 nodes, both views, chains collapsed or not, a highlighted path, other visitors'
hidden nodes (also with the coarse fields a public server gives them). Nothing is timed here; the timings
are printed by ``python -m components.views.tree_bench``."""

from __future__ import annotations

import functools
from collections import Counter

import gradio as gr
import plotly.graph_objects as go
import pytest

from components.panels.live import REFRESH_FAILED, _quiet
from components.views.tree_bench import last_request, simulate_traffic, traffic_snapshot
from components.views.tree_figures import tree_figure
from components.views.tree_marks import COMPUTED, REUSED, VisualNode, layout, request_path, visual_tree
from engine.types import TreeSnapshot


@functools.cache
def snapshots(num_nodes: int) -> dict[str, tuple[TreeSnapshot, dict[int, str]]]:
    isolated, shared = simulate_traffic(num_nodes, seed=1), simulate_traffic(num_nodes, seed=2, isolation=False)
    out = {}
    for name, traffic, viewer, coarse in [("shared", shared, None, False), ("viewer", isolated, isolated.viewer, False),
                                          ("viewer, coarse", isolated, isolated.viewer, True)]:
        snap = traffic_snapshot(traffic, viewer, coarse)
        out[name] = (snap, request_path(snap, last_request(traffic)))
    return out


def check_marks(snap: TreeSnapshot, path: dict[int, str], marks: dict[int, VisualNode], max_nodes: int,
                max_fan: int) -> None:
    """Every node drawn once or counted in one group; the marks form one tree; limits kept; path drawn."""
    reached, stack = set(), [0]
    while stack:
        vid = stack.pop()
        reached.add(vid)
        for c in marks[vid].children:
            assert c in marks and marks[c].parent_vid == vid
            stack.append(c)
    assert reached == set(marks), "every mark hangs under the root"
    members = Counter(i for m in marks.values() for i in m.member_ids)
    assert set(members) == {n.node_id for n in snap.nodes} and max(members.values()) == 1
    drawn = [m for v, m in marks.items() if v and not m.grouped_nodes]
    groups = [m for m in marks.values() if m.grouped_nodes]
    assert sum(len(m.member_ids) for m in drawn) + sum(g.grouped_nodes for g in groups) == len(snap.nodes)
    assert sum(m.num_tokens for m in drawn) + sum(g.grouped_tokens for g in groups) == \
        sum(n.num_tokens for n in snap.nodes)
    assert all(g.grouped_nodes == len(g.member_ids) and not g.children for g in groups)
    on_path = [m for m in marks.values() if m.status]
    assert {i for m in on_path for i in m.member_ids} == set(path), "the highlighted path is never folded"
    assert all(marks[i].status == s for i, s in path.items() if i in marks)
    assert len(marks) - 1 <= max_nodes + 2 * len(on_path) + 1
    assert max(len(m.children) for m in marks.values()) <= max_fan
    for m in marks.values():  # bars nest: a child starts where its parent ends
        assert all(marks[c].start_tokens == m.end_tokens for c in m.children)


def test_simulated_traffic_has_the_shape_that_broke_the_view():
    snap, path = snapshots(2000)["shared"]
    assert len(snap.nodes) >= 2000 and path and set(path.values()) == {REUSED, COMPUTED}
    kids: dict[int, list[int]] = {}
    for n in snap.nodes:
        kids.setdefault(n.parent_id, []).append(n.node_id)
    mixed = [p for p, cs in kids.items()
             if len(cs) >= 5 and any(c in kids for c in cs) and any(c not in kids for c in cs)]
    assert len(mixed) >= 10, "fans that mix leaves and children with subtrees"
    header = kids[0]
    assert len(header) == 1 and sum(len(kids[f]) for f in kids[header[0]]) >= 20, "dozens of system prompts"
    viewer, _ = snapshots(2000)["viewer"]
    assert 0 < sum(n.hidden for n in viewer.nodes) < len(viewer.nodes)


@pytest.mark.parametrize("num_nodes", [2000, 5000])
@pytest.mark.parametrize("case", ["shared", "viewer", "viewer, coarse"])
@pytest.mark.parametrize("collapse", [True, False])
def test_marks_of_big_realistic_trees_account_for_every_node(num_nodes, case, collapse):
    snap, path = snapshots(num_nodes)[case]
    for max_nodes, max_fan in [(300, 40), (2000, 500), (120, 12)]:  # tree, icicle, the chat tab's small tree
        marks = visual_tree(snap, path, collapse, max_nodes, max_fan)
        check_marks(snap, path, marks, max_nodes, max_fan)
        pos, span = layout(marks)
        assert set(pos) == set(marks) == set(span)


@pytest.mark.parametrize("num_nodes", [2000, 5000])
@pytest.mark.parametrize("view", ["tree", "icicle"])
@pytest.mark.parametrize("case", ["shared", "viewer, coarse"])
def test_big_realistic_trees_draw_in_both_views(num_nodes, view, case):
    snap, path = snapshots(num_nodes)[case]
    for collapse in (True, False):
        fig = tree_figure(snap, path, view=view, collapse_chains=collapse, viewer_owns="v0")
        hovers = [h for t in fig.data for h in (t.hovertext or ())]
        assert len(hovers) <= (2000 if view == "icicle" else 300) + 2 * len(path) + 1
        folded = [h for h in hovers if "folded into one mark" in h]
        assert all(" nodes · " in h and " tokens</b>" in h for h in folded)
        assert folded or (view == "icicle" and num_nodes == 2000)  # 2,000 marks fit in an icicle
        assert any("served</b> from here" in h for h in hovers) and any("<b>computed</b> this" in h for h in hovers)
        if case.startswith("viewer"):  # zeroed fields of hidden nodes are not shown as facts
            hidden = [h for h in hovers if "another visitor's (text hidden)" in h and "folded" not in h]
            assert hidden and not any("hits 0" in h or "last used" in h for h in hidden)
    go.Figure(fig.to_dict())  # the dicts built without validation are valid plotly


def test_folded_marks_say_how_many_nodes_and_tokens_they_hold():
    snap, path = snapshots(2000)["shared"]
    fig = tree_figure(snap, path, view="tree", max_nodes=30, max_fan=6)  # few marks: labels are drawn
    points = next(t for t in fig.data if t.type == "scatter" and t.mode == "markers+text" and len(t.x) > 1)
    labels = [t for t in points.text if t.startswith("+")]
    assert labels and all(" nodes · " in t and "tok" in t for t in labels)
    marks = visual_tree(snap, path, True, 30, 6)
    assert sum(m.grouped_nodes for m in marks.values()) > len(snap.nodes) // 2


def test_a_failing_refresh_says_so_on_the_panel_in_one_line(caplog):
    def broken(seen, request=None):
        raise KeyError(1694)

    out = _quiet(broken, 2, with_status=True)(None)
    assert out[:2] == (gr.skip(), gr.skip())
    line = out[2]["value"]
    assert out[2]["visible"] and line == REFRESH_FAILED.format(error="KeyError") and "\n" not in line
    assert "KeyError" in caplog.text and "1694" in caplog.text  # the detail goes to the log
    ok = _quiet(lambda seen, request=None: ("fig", "seen"), 2, with_status=True)(None)
    assert ok[:2] == ("fig", "seen") and ok[2]["visible"] is False  # the next refresh that works hides it


def test_the_tree_tab_shows_its_refresh_status(make_engine):
    from components.panels.tree_panel import build_tree_panel

    with gr.Blocks() as demo:
        live = build_tree_panel(make_engine(), gr.State(None))
        live.refresh_on(live.timer.tick)
    assert live.status is not None and live.status.elem_id == "tree-status"
    fns = [b for b in demo.fns.values() if live.status._id in [o._id for o in b.outputs]]
    assert fns, "the status line is an output of the tree's refresh"
