"""Where the tree's marks stay put: a stable layout across redraws.

Owns: ``node_places`` (per snapshot node, its column and its order key, so a node keeps its place
while the tree grows, splits or evicts around it) and ``stable_layout`` (the marks of
``tree_marks.visual_tree`` placed by them). Pure: snapshot in, positions out; ``tree_marks`` owns
what is drawn, ``tree_figures`` how.
"""

from __future__ import annotations

from dataclasses import dataclass

from components.views.tree_marks import VisualNode
from engine.types import NodeInfo, TreeSnapshot

HIDDEN_KEY = 1 << 62  # order key of other visitors' hidden nodes: after every visible one


@dataclass(slots=True)
class NodePlaces:
    """Per snapshot node: its column and its order key (see ``node_places``)."""

    column: dict[int, float]
    key: dict[int, int]


def node_places(snapshot: TreeSnapshot) -> NodePlaces:
    """Where each snapshot node goes across, and the key that orders branches, both fixed as the tree grows.

    Node ids come from one counter, so they tell creation order, and a split
    keeps the id on the lower part (``RadixTree._split``: the old node keeps its
    id, children and end; the new upper part gets a fresh id). A visitor's view
    numbers its visible nodes 1, 2, 3... in that same order
    (``engine.snapshot_view.view_ids``), so all that follows holds there too. Hence:

    - ``key`` = the smallest id in a node's subtree: the oldest node under it.
      Adding nodes (new ids are the largest) never changes an existing key,
      and the upper part of a split inherits the key of the node it cut.
    - a node whose key is smaller than its own id is the upper part of a
      split; every other node is a run of tokens as it was first cached.
    - ``column`` counts those first-cached runs from the root (1, 2, 3...), so
      a split does not push anything to the right. The upper part of a split
      sits between where the run started and the run: the first cut halfway,
      each later cut of the same run halfway between its neighbours on the path,
      taken oldest first (ids again), so a new cut never moves an older one.

    Other visitors' hidden nodes order after every visible sibling (the engine
    and the remote shadow tree fold each hidden subtree into one node with a
    made-up id; a bare tree may keep them node by node). Eviction removes nodes and may change keys: then nodes move.
    """
    kids: dict[int, list[NodeInfo]] = {}
    for n in snapshot.nodes:
        kids.setdefault(n.parent_id, []).append(n)
    order: list[NodeInfo] = []  # parents before children
    stack = list(kids.get(0, ()))
    while stack:
        n = stack.pop()
        order.append(n)
        stack.extend(kids.get(n.node_id, ()))
    own = {n.node_id: HIDDEN_KEY + n.node_id if n.hidden else n.node_id for n in order}
    key: dict[int, int] = {0: -1}
    for n in reversed(order):
        k = own[n.node_id]
        for c in kids.get(n.node_id, ()):
            k = min(k, key[c.node_id])
        key[n.node_id] = k
    split = {n.node_id for n in order if key[n.node_id] < own[n.node_id]}
    parent_of = {n.node_id: n.parent_id for n in order}
    runs: dict[int, int] = {0: 0}  # first-cached runs from the root
    for n in order:
        runs[n.node_id] = runs[n.parent_id] + (n.node_id not in split)
    column: dict[int, float] = {nid: float(r) for nid, r in runs.items() if nid not in split}
    for n in order:  # each first-cached run below cuts: place the cuts above it, oldest first
        if n.node_id in split or key[n.parent_id] != own[n.node_id]:
            continue
        cuts, up = [], n.parent_id  # the run's upper parts (their key is the run's id), up to where it started
        while up in split and key[up] == own[n.node_id]:
            cuts.append(up)
            up = parent_of[up]
        at = {up: 0, n.node_id: len(cuts) + 1}  # path order: the start, the cuts top down, the run itself
        at.update({c: len(cuts) - i for i, c in enumerate(cuts)})
        done = [up, n.node_id]
        for c in sorted(cuts):  # by age: a newer cut lands between cuts already placed, which stay
            before = max((d for d in done if at[d] < at[c]), key=at.__getitem__)
            after = min((d for d in done if at[d] > at[c]), key=at.__getitem__)
            column[c] = (column[before] + column[after]) / 2
            done.append(c)
    return NodePlaces(column, key)


def stable_layout(marks: dict[int, VisualNode], places: NodePlaces) -> dict[int, tuple[float, float]]:
    """Each mark's (x, row) for the tree view, from ``node_places``: nodes that exist keep their place.

    x is the column of the mark's last member (a chain of runs drawn as one
    ends where its last run ends); a group of folded subtrees sits one column
    right of its parent. Rows: a mark continues its parent's row when it is
    the parent's oldest child (smallest key); every other child starts a row
    of its own, and rows are ordered by the key of the mark that starts them,
    i.e. by age. A new branch therefore always gets a new row at the bottom,
    wherever it hangs, and a split keeps the cut node on its row: redraws
    after requests add rows and marks without moving the ones drawn before.
    Folding (big trees) changes which marks exist, and eviction changes keys:
    those redraws may move marks.
    """
    key = {vid: -1 if vid == 0 else min((places.key.get(i, HIDDEN_KEY) for i in m.member_ids), default=HIDDEN_KEY)
           for vid, m in marks.items()}
    kids = {vid: sorted(m.children, key=lambda c: (marks[c].grouped_nodes > 0, key[c], c))
            for vid, m in marks.items()}
    heads = [0] + [c for ks in kids.values() for c in ks[1:]]
    rank = {vid: r for r, vid in enumerate(sorted(heads, key=lambda v: (key[v], v)))}
    pos: dict[int, tuple[float, float]] = {0: (0.0, 0.0)}
    stack = [0]
    while stack:  # parents before children
        vid = stack.pop()
        x_parent, row = pos[vid]
        for i, c in enumerate(kids[vid]):
            m = marks[c]
            x = x_parent + 1 if m.grouped_nodes else places.column.get(m.member_ids[-1], x_parent + 1)
            pos[c] = (x, row if i == 0 else float(rank[c]))
            stack.append(c)
    return pos
