"""The tree view keeps drawn nodes where they were when requests add nodes (issue 15 item 11), and its
labels never collide (item 12).

Trees are real: chat turns run through the engine on the tiny random Llama (``tiny_runner``), with the
real tokenizer's chat template and one system prompt shared by two or three conversations. Positions
are read from the figure itself (the node markers carry their node id as ``customdata``); label boxes
are estimated from the figure the way plotly places point text (characters x font size, offset from
the marker), at the narrowest width labels are placed for and at the real page's wider widths.
"""

from __future__ import annotations

import html
import itertools
import random

import pytest

from components.chat_presets import DEFAULT_SYSTEM, STARTER_QUESTIONS
from components.views.tree_bench import Traffic, traffic_snapshot
from components.views.tree_figures import COLORBAR_PX, LABEL_WIDTH_PX, tree_figure
from components.views.tree_marks import request_path, visual_tree
from components.views.tree_places import node_places, stable_layout
from engine.engine import Engine
from engine.kvcache.radix_tree import RadixTree
from engine.types import CacheKey, GenerationRequest, SamplingParams, TreeSnapshot

FOLLOW_UPS = ("And how long does that take?", "Can I pay by card?", "What if it arrives broken?",
              "Thanks. One more thing: do you ship abroad?", "Is there a warranty?")


@pytest.fixture
def engine(tiny_runner, make_engine) -> Engine:
    eng = make_engine(budget_bytes=20_000 * tiny_runner.kv_bytes_per_token)
    yield eng


def run_ids(engine: Engine, ids: list[int], n: int = 6, namespace: str = "", public_len: int = 0):
    return engine.run(GenerationRequest(prompt_ids=tuple(ids), sampling=SamplingParams(max_new_tokens=n),
                                        namespace=namespace, public_len=public_len))


def turn(engine: Engine, history: list[dict], question: str, n: int = 10, namespace: str = ""):
    """One chat turn, as the chat tab sends it (system prompt shared); returns (history, metrics)."""
    msgs = [{"role": "system", "content": DEFAULT_SYSTEM}, *history, {"role": "user", "content": question}]
    ids = engine.prompt_ids(GenerationRequest(messages=tuple(msgs)))
    public = len(engine.prompt_ids(GenerationRequest(messages=({"role": "system", "content": DEFAULT_SYSTEM},))))
    m = run_ids(engine, ids, n, namespace, public if namespace else 0)
    answer = engine.decode(m.output_ids)
    return [*history, {"role": "user", "content": question}, {"role": "assistant", "content": answer}], m


def chats(engine: Engine, turns: int, conversations: int = 2, namespace: str = ""):
    """``turns`` chat turns spread over ``conversations`` chats; returns the histories and the last metrics."""
    histories: list[list[dict]] = [[] for _ in range(conversations)]
    metrics = None
    for t in range(turns):
        c = t % conversations
        q = STARTER_QUESTIONS[c % len(STARTER_QUESTIONS)] if not histories[c] else FOLLOW_UPS[t % len(FOLLOW_UPS)]
        histories[c], metrics = turn(engine, histories[c], q, namespace=namespace)
    return histories, metrics


def points_trace(fig) -> dict:
    return next(t for t in fig.to_dict()["data"] if t.get("customdata") is not None)


def positions(fig) -> dict[int, tuple[float, float]]:
    t = points_trace(fig)
    return {int(v): (x, y) for v, x, y in zip(t["customdata"], t["x"], t["y"], strict=True)}


def node_path_ids(snap: TreeSnapshot, node_id: int) -> list[int]:
    """The token ids from the root to the end of ``node_id``."""
    by_id = {n.node_id: n for n in snap.nodes}
    chain = []
    while node_id:
        chain.append(by_id[node_id])
        node_id = by_id[node_id].parent_id
    return [t for n in reversed(chain) for t in n.token_ids]


# ---------------------------------------------------------------- item 11: nothing drawn moves
def test_new_branches_and_splits_leave_every_drawn_node_where_it_was(engine):
    (conv_a, conv_b), _ = chats(engine, 4)
    before = engine.snapshot()
    figs = {c: tree_figure(before, collapse_chains=c) for c in (False, True)}
    old = {c: positions(f) for c, f in figs.items()}
    assert len(old[False]) == len(before.nodes) >= 5

    # 1. a branch in the EARLIER subtree (the first conversation, above the second one's rows)
    turn(engine, conv_a[:2], "Something else entirely: what are your opening hours?")
    # 2. a split of the shared system prompt's node: a prompt that leaves it halfway
    system = max(before.nodes, key=lambda n: n.num_tokens if n.parent_id == 0 else -1)
    run_ids(engine, list(system.token_ids[: system.num_tokens // 2]) + [7, 8, 9, 10])
    # 3. a split in the middle of an answer of the second conversation, deep in its chain
    deep = max((n for n in before.nodes if n.num_tokens >= 4), key=lambda n: n.depth_tokens)
    run_ids(engine, node_path_ids(before, deep.node_id)[: deep.depth_tokens - deep.num_tokens // 2] + [11, 12, 13])
    engine.check_invariants()

    after = engine.snapshot()
    assert len(after.nodes) >= len(before.nodes) + 5, "new branches and the upper parts of three splits"
    cut = [n for n in after.nodes if n.node_id in old[False] and n.num_tokens < next(
        b.num_tokens for b in before.nodes if b.node_id == n.node_id)]
    assert len(cut) >= 2, "the system prompt's node and an answer were cut in two (they keep their ids)"
    new = positions(tree_figure(after, collapse_chains=False))
    for node_id, xy in old[False].items():
        assert new[node_id] == pytest.approx(xy), f"node {node_id} moved"
    # Collapsed chains: each mark drawn before is still drawn where it was, by its last run.
    marks_after = positions(tree_figure(after, collapse_chains=True))
    last_run = {node_id: xy for node_id, xy in new.items()}
    for vid, xy in old[True].items():
        assert any(xy == pytest.approx(p) for p in marks_after.values()), f"mark {vid} moved"
    # New marks take new rows at the bottom; the upper parts of the splits sit between their parent and
    # the node they were cut from, never on a drawn node.
    taken = set(old[False].values())
    fresh = {k: p for k, p in last_run.items() if k not in old[False]}
    assert fresh and not any(p in taken for p in fresh.values())
    old_rows = max(y for _, y in old[False].values())
    places = node_places(after)
    for n in after.nodes:
        if n.node_id in fresh and float(places.column[n.node_id]).is_integer():  # a new run: a new row below
            assert fresh[n.node_id][1] > old_rows


def test_a_zoomed_window_keeps_its_nodes_in_the_small_tree_too(engine):
    """The chat tab's small tree (compact, labels, chains collapsed only when big) moves nothing either."""
    kw = dict(compact=True, height=330, max_nodes=120, max_fan=12)
    (conv_a, _), _ = chats(engine, 3)
    before = engine.snapshot()
    old = positions(tree_figure(before, collapse_chains=False, **kw))
    turn(engine, conv_a[:2], "A different follow-up")
    turn(engine, [], STARTER_QUESTIONS[2])  # a third conversation
    new = positions(tree_figure(engine.snapshot(), collapse_chains=False, **kw))
    assert all(new[k] == pytest.approx(v) for k, v in old.items())
    assert len(new) > len(old)


def test_other_visitors_never_move_what_a_viewer_sees(tiny_runner, make_engine):
    """Isolation: another visitor's requests grow a grey "others" mark; the viewer's own nodes stay put."""
    engine = make_engine(budget_bytes=20_000 * tiny_runner.kv_bytes_per_token, isolation=True)
    chats(engine, 3, namespace="me")
    chats(engine, 1, namespace="other")
    before = engine.snapshot(viewer="me")
    old = positions(tree_figure(before, collapse_chains=False, viewer_owns="me"))
    chats(engine, 4, conversations=2, namespace="other")
    chats(engine, 2, conversations=2, namespace="third")
    after = engine.snapshot(viewer="me")
    new = positions(tree_figure(after, collapse_chains=False, viewer_owns="me"))
    visible = {n.node_id for n in before.nodes if not n.hidden}
    assert all(new[k] == pytest.approx(old[k]) for k in visible)


def tree_places(tree: RadixTree, viewer: str | None = None) -> dict[int, tuple[float, float]]:
    """Node id -> (x, row) of the tree view, node by node (no chains collapsed), of a bare ``RadixTree``."""
    snap = traffic_snapshot(Traffic(tree, 0.0, (), (), 0, viewer or ""), viewer)
    return stable_layout(visual_tree(snap, collapse_chains=False), node_places(snap))


def test_cuts_of_one_run_sit_between_and_never_move_each_other():
    tree = RadixTree()
    run = tuple(range(100, 120))
    tree.insert(CacheKey(run), [None] * 20)  # node 1
    before = tree_places(tree)
    assert before[1] == (1.0, 0.0)
    cuts = []
    for at in (10, 5, 15, 12):  # each insert leaves the run at ``at``: one cut, one new branch
        ids = run[:at] + (900 + at,)
        tree.insert(CacheKey(ids), [None] * len(ids))
        now = tree_places(tree)
        assert all(now[k] == before[k] for k in before), "an older cut moved"
        cut = tree.match(CacheKey(run[:at])).node.id
        cuts.append(cut)
        assert 0 < now[cut][0] < 1 and now[cut][1] == 0.0 and now[1] == (1.0, 0.0)  # on the run's row, before it
        before = now
    xs = [before[c][0] for c in cuts]
    assert xs == [0.5, 0.25, 0.75, 0.625]  # halfway between neighbours on the path, oldest cut first
    by_depth = sorted(cuts, key=lambda c: tree.match(CacheKey(run)).path.index(c))
    assert [before[c][0] for c in by_depth] == sorted(xs), "left to right in path order"


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("viewer", [None, "a"])
def test_random_inserts_never_move_a_drawn_node(seed, viewer):
    """Inserts from a small alphabet make many splits and branches anywhere in the tree: after each,
    every node that existed keeps its (x, row); new nodes land on no existing place. With a viewer,
    other namespaces' nodes are hidden (kept node by node, as a remote shadow tree does): the viewer's
    own and the shared nodes never move."""
    rng = random.Random(seed)
    tree, places = RadixTree(), {}
    prefixes = [()]
    for _ in range(60):
        base = rng.choice(prefixes)
        ids = base[: rng.randint(0, len(base))] + tuple(rng.randint(0, 3) for _ in range(rng.randint(1, 8)))
        namespace = rng.choice(["a", "b", "c"]) if viewer else ""
        tree.insert(CacheKey(ids, namespace, public_len=rng.randint(0, 3)), [None] * len(ids))
        prefixes.append(ids)
        tree.check_invariants()
        now = tree_places(tree, viewer)
        seen = {n.id for n in tree.nodes() if viewer is None or n.namespace in ("", viewer)}
        assert {k: now[k] for k in places if k in seen} == {k: xy for k, xy in places.items() if k in seen}
        assert len(set(now.values())) == len(now), "two nodes on one place"
        places = now
    assert len(places) > 40


def test_a_folded_tree_says_its_marks_may_move():
    """Past the marks a view can draw, subtrees fold into groups and which ones fold changes as the tree
    grows: there the figure does not promise places, it says so in its title."""
    tree = RadixTree()
    for i in range(60):  # 60 conversations under one system prompt: more than 40 children under one parent
        ids = tuple(range(10)) + (1000 + i, 2000 + i)
        tree.insert(CacheKey(ids), [None] * len(ids))
    snap = traffic_snapshot(Traffic(tree, 0.0, (), (), 0, ""))
    assert "marks may move" in tree_figure(snap).layout.title.text
    small = traffic_snapshot(Traffic(RadixTree(), 0.0, (), (), 0, ""))
    assert "may move" not in (tree_figure(small).layout.title.text or "")


# ---------------------------------------------------------------- item 12: labels do not collide
def label_boxes(fig, width_px: int) -> tuple[list[tuple], list[tuple], tuple[float, float]]:
    """Label boxes and marker boxes in pixels (y down) as plotly draws them at ``width_px``, and the plot area.

    Text: ``len x font size x 0.6`` wide (a generous average glyph), one font size high, offset from the
    marker by plotly's rule (text sits ``marker radius / 0.8 + 1`` px away)."""
    d = fig.to_dict()
    lay = d["layout"]
    margin = lay["margin"]
    colorbar = any(t.get("marker", {}).get("showscale") for t in d["data"])
    area_w = width_px - margin["l"] - margin["r"] - (COLORBAR_PX if colorbar else 0)
    area_h = lay["height"] - margin["t"] - margin["b"]
    (x0, x1), (y0, y1) = lay["xaxis"]["range"], lay["yaxis"]["range"]

    def px(x, y):
        return (x - x0) / (x1 - x0) * area_w, (y - y1) / (y0 - y1) * area_h  # y range[0] is the bottom

    labels, markers = [], []
    for t in d["data"]:
        if t.get("type") != "scatter" or "markers" not in t.get("mode", "") or t["x"] == [None]:
            continue
        sizes = t["marker"]["size"]
        sizes = sizes if isinstance(sizes, list | tuple) else [sizes] * len(t["x"])
        texts = t.get("text") or [""] * len(t["x"])
        where = t.get("textposition") or "middle center"
        where = where if isinstance(where, list | tuple) else [where] * len(t["x"])
        font = (t.get("textfont") or {}).get("size", 12)
        for x, y, s, text, w in zip(t["x"], t["y"], sizes, texts, where, strict=True):
            cx, cy = px(x, y)
            markers.append((cx - s / 2, cy - s / 2, cx + s / 2, cy + s / 2))
            if not text or "text" not in t["mode"]:
                continue
            tw, th, r = len(html.unescape(text)) * font * 0.6, font, s / 1.6 + 1
            vertical, _, horizontal = w.partition(" ")
            bx = {"center": cx - tw / 2, "right": cx + r, "left": cx - r - tw}[horizontal]
            by = {"top": cy - r - th, "bottom": cy + r, "middle": cy - th / 2}[vertical]
            labels.append((bx, by, bx + tw, by + th, len(markers) - 1, text))
    return labels, markers, (area_w, area_h)


def overlap(a, b, slack: float = 0.5) -> bool:
    return a[0] + slack < b[2] and b[0] + slack < a[2] and a[1] + slack < b[3] and b[1] + slack < a[3]


def assert_labels_clear(fig, width_px: int) -> int:
    labels, markers, (w, h) = label_boxes(fig, width_px)
    for a, b in itertools.combinations(labels, 2):
        assert not overlap(a, b), f"labels {a[5]!r} and {b[5]!r} overlap at {width_px} px"
    for a in labels:
        assert a[0] >= -0.5 and a[1] >= -0.5 and a[2] <= w + 0.5 and a[3] <= h + 0.5, f"{a[5]!r} is cut off"
        covered = [i for i, m in enumerate(markers) if i != a[4] and overlap(a, m)]
        assert not covered, f"label {a[5]!r} covers a node at {width_px} px"
    return len(labels)


@pytest.mark.parametrize("turns,conversations,isolated", [(3, 2, False), (4, 2, False), (5, 3, False), (6, 3, False),
                                                           (4, 2, True)])
def test_live_tree_labels_do_not_overlap_after_a_few_turns(tiny_runner, turns, conversations, isolated, make_engine):
    engine = make_engine(budget_bytes=20_000 * tiny_runner.kv_bytes_per_token, isolation=isolated)
    if isolated:  # another visitor's chat shows as one grey "(private)" mark
        chats(engine, 2, 2, namespace="other")
    _, metrics = chats(engine, turns, conversations, namespace="me" if isolated else "")
    snap = engine.snapshot(viewer="me" if isolated else None)
    path = request_path(snap, metrics)
    small = tree_figure(snap, path, compact=True, height=330, max_nodes=120, max_fan=12,
                        collapse_chains=len(snap.nodes) > 24)  # as the chat tab draws it
    shown = [assert_labels_clear(small, w) for w in (LABEL_WIDTH_PX[True], 390, 480)]
    assert shown[0] >= min(3, len(snap.nodes)), "the small tree still names its main nodes"
    for collapse in (True, False):
        full = tree_figure(snap, path, height=600, collapse_chains=collapse)  # the tree tab
        shown = [assert_labels_clear(full, w) for w in (LABEL_WIDTH_PX[False], 1216)]
        marks = len(points_trace(full)["x"])
        assert shown[0] >= min(marks, 4), f"{shown[0]} of {marks} marks labelled"
    # what is not labelled keeps its text in the hover
    assert all(h for h in points_trace(small)["hovertext"])
