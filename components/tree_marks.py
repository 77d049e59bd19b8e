"""What to draw of the radix tree: snapshot in, marks and their positions out.

Owns the reading of a ``TreeSnapshot`` that makes it legible: which nodes hold
the visitor's last request (reused vs computed), collapsing chains of single
children into one mark, folding huge fans of leaves into "+N leaves" marks,
and the networkx layout (depth across, one row per leaf). No plotting here
(``components.tree_figures`` draws), no Gradio, no engine object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from engine.radix_tree import common_prefix_len
from engine.types import NodeInfo, RequestMetrics, TreeSnapshot

REUSED, COMPUTED = "reused", "computed"


@dataclass
class VisualNode:
    """One drawn mark: a snapshot node, a collapsed chain of them, or a group of leaves."""

    vid: int
    parent_vid: int
    member_ids: list[int]
    start_tokens: int
    end_tokens: int
    num_bytes: int
    hits: int
    last_access_s_ago: float
    lock_ref: int
    namespace: str
    hidden: bool
    text: str
    status: str = ""
    grouped_leaves: int = 0  # > 0: stands for this many leaves too small to draw one by one
    children: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.end_tokens - self.start_tokens


# ---------------------------------------------------------------- last request
def request_path(snapshot: TreeSnapshot, metrics: RequestMetrics | None) -> dict[int, str]:
    """Node id -> ``REUSED`` or ``COMPUTED`` for the nodes now holding the request's tokens.

    Walks the snapshot along ``prompt_ids + output_ids``: tokens before
    ``cached_tokens`` were served from the cache, the rest were computed by the
    request. Matching on ids (not ``matched_path``) stays right after later
    splits; ``matched_path`` is the fallback when the walk finds nothing.
    """
    if metrics is None or not snapshot.nodes:
        return {}
    ids = list(metrics.prompt_ids) + list(metrics.output_ids)
    children: dict[int, list[NodeInfo]] = {}
    for n in snapshot.nodes:
        children.setdefault(n.parent_id, []).append(n)
    out: dict[int, str] = {}
    parent, pos = 0, 0
    while pos < len(ids):
        best, best_len = None, 0
        for c in children.get(parent, ()):
            if c.hidden or not c.token_ids or c.token_ids[0] != ids[pos]:
                continue
            n = common_prefix_len(c.token_ids, ids, pos)
            if n > best_len:
                best, best_len = c, n
        if best is None:
            break
        out[best.node_id] = REUSED if pos < metrics.cached_tokens else COMPUTED
        pos += best_len
        if best_len < best.num_tokens:
            break
        parent = best.node_id
    if not out:
        present = {n.node_id for n in snapshot.nodes}
        out = {i: REUSED for i in metrics.matched_path if i in present}
    return out


# ---------------------------------------------------------------- visual tree
def visual_tree(snapshot: TreeSnapshot, path: dict[int, str] | None = None, collapse_chains: bool = True,
                max_nodes: int = 1500, max_fan: int | None = None) -> dict[int, VisualNode]:
    """The marks to draw, keyed by visual id (0 is the root).

    A node joins its parent's mark when the parent has exactly one child and
    both look the same (owner, hidden, reused/computed status): a chat's turns
    read as one bar instead of twenty. Past ``max_nodes`` marks, the least
    recently used leaves of the widest fans are drawn as one "+N leaves" mark;
    so are the leaves past ``max_fan`` under any one parent.
    """
    path = path or {}
    kids: dict[int, list[NodeInfo]] = {}
    for n in snapshot.nodes:
        kids.setdefault(n.parent_id, []).append(n)
    root = VisualNode(0, -1, [], 0, 0, 0, 0, 0.0, 0, "", False, "")
    marks: dict[int, VisualNode] = {0: root}
    owner: dict[int, int] = {0: 0}  # snapshot node id -> visual id
    stack = [0]
    while stack:  # parents before children, whatever order the snapshot has
        pid = stack.pop()
        siblings = sorted(kids.get(pid, ()), key=lambda c: c.node_id)
        for n in siblings:
            status = path.get(n.node_id, "")
            parent_mark = marks[owner[pid]]
            if (collapse_chains and pid != 0 and len(siblings) == 1 and not parent_mark.grouped_leaves
                    and (parent_mark.hidden, parent_mark.namespace, parent_mark.status)
                    == (n.hidden, n.namespace, status)):
                m = parent_mark
                m.member_ids.append(n.node_id)
                m.end_tokens = n.depth_tokens
                m.num_bytes += n.num_bytes
                m.hits = min(m.hits, n.hits)
                m.last_access_s_ago = min(m.last_access_s_ago, n.last_access_s_ago)
                m.lock_ref = max(m.lock_ref, n.lock_ref)
                if not n.hidden and len(m.text) < 600:
                    m.text += n.text
            else:
                m = VisualNode(n.node_id, parent_mark.vid, [n.node_id], n.depth_tokens - n.num_tokens,
                               n.depth_tokens, n.num_bytes, n.hits, n.last_access_s_ago, n.lock_ref,
                               n.namespace, n.hidden, n.text, status)
                marks[m.vid] = m
                parent_mark.children.append(m.vid)
            owner[n.node_id] = m.vid
            stack.append(n.node_id)
    widest = max((len(m.children) for m in marks.values()), default=0)
    if len(marks) - 1 > max_nodes or (max_fan is not None and widest > max_fan):
        _group_small_leaves(marks, max_nodes, max_fan or max_nodes)
    return marks


def _group_small_leaves(marks: dict[int, VisualNode], max_nodes: int, max_fan: int) -> None:
    """Keep at most ``cap`` leaves per parent (the most recent, and any on the
    highlighted path); fold the rest of each fan into one mark."""
    fans = {vid: leaves for vid, m in marks.items() if (leaves := [c for c in m.children if not marks[c].children])}
    others = len(marks) - 1 - sum(len(f) for f in fans.values())
    cap = max(2, min(max_fan, (max_nodes - others) // max(1, len(fans))))
    for vid, leaves in fans.items():
        if len(leaves) <= cap + 1:
            continue
        leaves.sort(key=lambda c: (marks[c].status == "", marks[c].last_access_s_ago))
        keep, fold = leaves[: cap - 1], leaves[cap - 1:]
        folded = [marks.pop(c) for c in fold]
        group = VisualNode(
            vid=-min(f.vid for f in folded), parent_vid=vid, member_ids=[i for f in folded for i in f.member_ids],
            start_tokens=min(f.start_tokens for f in folded), end_tokens=max(f.end_tokens for f in folded),
            num_bytes=sum(f.num_bytes for f in folded), hits=sum(f.hits for f in folded),
            last_access_s_ago=min(f.last_access_s_ago for f in folded), lock_ref=max(f.lock_ref for f in folded),
            namespace="", hidden=all(f.hidden for f in folded), text="", grouped_leaves=len(folded))
        marks[group.vid] = group
        marks[vid].children = [c for c in marks[vid].children if c in set(keep)] + [group.vid]


def layout(marks: dict[int, VisualNode]) -> tuple[dict[int, tuple[int, float]], dict[int, tuple[int, int]]]:
    """networkx layout: depth in marks (x) and leaf order (y), plus each mark's leaf span.

    Children are ordered by their oldest member id, so a refresh adds new
    branches below the old ones instead of reshuffling the picture.
    """
    g = nx.DiGraph()
    g.add_node(0)
    oldest = {vid: min(m.member_ids, default=0) for vid, m in marks.items()}
    for vid, m in marks.items():
        for c in sorted(m.children, key=lambda c: oldest[c]):
            g.add_edge(vid, c)
    depth = nx.single_source_shortest_path_length(g, 0)
    pos: dict[int, tuple[int, float]] = {}
    span: dict[int, tuple[int, int]] = {}
    next_leaf = 0
    for vid in nx.dfs_postorder_nodes(g, 0):
        succ = list(g.successors(vid))
        if not succ:
            span[vid] = (next_leaf, next_leaf + 1)
            pos[vid] = (depth[vid], float(next_leaf))
            next_leaf += 1
        else:
            span[vid] = (span[succ[0]][0], span[succ[-1]][1])
            pos[vid] = (depth[vid], (pos[succ[0]][1] + pos[succ[-1]][1]) / 2)
    return pos, span
