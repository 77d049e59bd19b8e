"""What to draw of the radix tree: snapshot in, marks and their positions out.

Owns the reading of a ``TreeSnapshot`` that makes it legible: which nodes hold
the visitor's last request (reused vs computed), collapsing chains of single
children into one mark, folding what does not fit (wide fans, big subtrees)
into group marks that say how many nodes and tokens they hold, and the
layouts: ``stable_layout`` (in ``tree_places.py``) for the tree view (a column per cached run, a row
per branch, both fixed when the tree grows, see there) and ``layout`` for the
icicle (leaf order, subtrees on adjacent rows). No plotting here
(``components.views.tree_figures`` draws), no Gradio, no engine object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.kvcache.radix_tree import common_prefix_len
from engine.types import NodeInfo, RequestMetrics, TreeSnapshot

REUSED, COMPUTED = "reused", "computed"


@dataclass(slots=True)
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
    spilled: bool = False  # in the second tier, not in the pool (``NodeInfo.spilled``)
    # A group mark (``grouped_nodes`` > 0) stands for whole subtrees folded to keep the view
    # readable: that many snapshot nodes holding ``grouped_tokens`` tokens, in ``grouped_branches``
    # sibling subtrees.
    grouped_nodes: int = 0
    grouped_tokens: int = 0
    grouped_branches: int = 0
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
    both look the same (owner, hidden, reused/computed status, in the pool or
    the second tier): a chat's turns
    read as one bar instead of twenty. Past ``max_nodes`` marks, or ``max_fan``
    children under one parent, whole subtrees are folded into group marks
    (see ``_fold``); the highlighted path is never folded.
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
        parent_mark = marks[owner[pid]]
        for n in siblings:
            status = path.get(n.node_id, "")
            size = max(0, n.num_tokens)
            if (collapse_chains and pid != 0 and len(siblings) == 1
                    and (parent_mark.hidden, parent_mark.namespace, parent_mark.status, parent_mark.spilled)
                    == (n.hidden, n.namespace, status, n.spilled)):
                m = parent_mark
                m.member_ids.append(n.node_id)
                m.end_tokens += size
                m.num_bytes += n.num_bytes
                m.hits = min(m.hits, n.hits)
                m.last_access_s_ago = min(m.last_access_s_ago, n.last_access_s_ago)
                m.lock_ref = max(m.lock_ref, n.lock_ref)
                if not n.hidden and len(m.text) < 600:
                    m.text += n.text
            else:
                # Positions add up along the path (not read from depth_tokens), so a
                # snapshot whose hidden nodes carry rounded sizes still draws without gaps.
                start = parent_mark.end_tokens
                m = VisualNode(n.node_id, parent_mark.vid, [n.node_id], start, start + size, n.num_bytes, n.hits,
                               n.last_access_s_ago, n.lock_ref, n.namespace, n.hidden, n.text, status, n.spilled)
                marks[m.vid] = m
                parent_mark.children.append(m.vid)
            owner[n.node_id] = m.vid
            stack.append(n.node_id)
    max_fan = max_fan or max_nodes
    widest = max(len(m.children) for m in marks.values())
    if len(marks) - 1 > max_nodes or widest > max_fan:
        _fold(marks, max_nodes, max_fan)
    return marks


@dataclass(slots=True)
class _Subtree:
    """What a mark's subtree holds, for ``_fold``."""

    marks: int = 1
    nodes: int = 0
    tokens: int = 0
    num_bytes: int = 0
    end_tokens: int = 0
    pinned: int = 0  # marks on the highlighted path
    widest: int = 0  # the largest fan inside
    last_access_s_ago: float = float("inf")
    hits: int = 0
    lock_ref: int = 0
    all_hidden: bool = True


def _fold(marks: dict[int, VisualNode], max_nodes: int, max_fan: int) -> None:
    """Fold whole subtrees into group marks until at most about ``max_nodes``
    marks remain and no parent shows more than ``max_fan`` children.

    Top down, each mark gets a budget of marks for its subtree. A parent keeps
    its children in order of importance (on the highlighted path, the viewer's
    own, most recently used, largest) while the budget and ``max_fan`` allow,
    and folds the rest into one group; the budget left is shared evenly among
    the kept children (a small subtree takes only what it needs, the rest goes
    to the others). A kept child whose budget is one mark becomes a group of
    its whole subtree. Marks on the highlighted path are always kept, so the
    total can exceed ``max_nodes`` by about the path's length.
    """
    info: dict[int, _Subtree] = {}
    order: list[int] = []
    stack = [0]
    while stack:  # preorder; reversed below, children come before parents
        vid = stack.pop()
        order.append(vid)
        stack.extend(marks[vid].children)
    for vid in reversed(order):
        m = marks[vid]
        s = _Subtree(1, len(m.member_ids), m.num_tokens, m.num_bytes, m.end_tokens, int(bool(m.status)), len(m.children),
                     m.last_access_s_ago, m.hits, m.lock_ref, m.hidden)
        for c in m.children:
            k = info[c]
            s.marks += k.marks
            s.nodes += k.nodes
            s.tokens += k.tokens
            s.num_bytes += k.num_bytes
            s.end_tokens = max(s.end_tokens, k.end_tokens)
            s.pinned += k.pinned
            s.widest = max(s.widest, k.widest)
            s.last_access_s_ago = min(s.last_access_s_ago, k.last_access_s_ago)
            s.hits += k.hits
            s.lock_ref = max(s.lock_ref, k.lock_ref)
            s.all_hidden = s.all_hidden and k.all_hidden
        info[vid] = s

    def rank(c: int) -> tuple:
        k = info[c]
        return (not k.pinned, k.all_hidden, k.last_access_s_ago, -k.nodes, c)

    work = [(0, max(1, max_nodes + 1))]
    while work:
        vid, budget = work.pop()
        m, s = marks[vid], info[vid]
        if not m.children or (s.marks <= budget and s.widest <= max_fan):
            continue
        room = max(0, budget - 1)  # the mark itself takes one
        ranked = sorted(m.children, key=rank)
        if len(ranked) <= min(max_fan, room):
            keep = ranked
        else:
            keep = ranked[: max(0, min(max_fan, room) - 1)]  # one place left for the group
            keep += [c for c in ranked[len(keep):] if info[c].pinned]
        kept = set(keep)
        fold = [c for c in m.children if c not in kept]
        if len(fold) == 1 and not marks[fold[0]].children:
            keep, fold = keep + fold, []  # a group of one leaf says less than the leaf
        share = _share([info[c].marks for c in keep], room - (1 if fold else 0))
        for c, b in zip(keep, share, strict=True):
            b = max(b, info[c].pinned)
            if b <= 1 and marks[c].children and not info[c].pinned:
                _replace_by_group(marks, info, vid, [c])
            else:
                work.append((c, b))
        if fold:
            _replace_by_group(marks, info, vid, fold)


def _share(sizes: list[int], budget: int) -> list[int]:
    """Split ``budget`` among subtrees of ``sizes`` marks: at least one each, evenly,
    none more than it needs (water filling)."""
    out = [0] * len(sizes)
    left, todo = budget, sorted(range(len(sizes)), key=lambda i: sizes[i])
    for n, i in enumerate(todo):
        out[i] = max(1, min(sizes[i], left // max(1, len(todo) - n)))
        left -= out[i]
    return out


def _replace_by_group(marks: dict[int, VisualNode], info: dict[int, _Subtree], parent: int, roots: list[int]) -> None:
    """Take the subtrees under ``roots`` out of ``marks`` and hang one group mark in their place."""
    members: list[int] = []
    stack = list(roots)
    while stack:
        gone = marks.pop(stack.pop())
        members.extend(gone.member_ids)
        stack.extend(gone.children)
    ks = [info[r] for r in roots]
    start = marks[parent].end_tokens
    group = VisualNode(
        vid=-min(roots), parent_vid=parent, member_ids=members, start_tokens=start,
        end_tokens=max(start, max(k.end_tokens for k in ks)), num_bytes=sum(k.num_bytes for k in ks),
        hits=sum(k.hits for k in ks), last_access_s_ago=min(k.last_access_s_ago for k in ks),
        lock_ref=max(k.lock_ref for k in ks), namespace="", hidden=all(k.all_hidden for k in ks), text="",
        grouped_nodes=sum(k.nodes for k in ks), grouped_tokens=sum(k.tokens for k in ks), grouped_branches=len(roots))
    marks[group.vid] = group
    gone = set(roots)
    kids = marks[parent].children
    kids[:] = [c for c in kids if c not in gone] + [group.vid]


def layout(marks: dict[int, VisualNode]) -> tuple[dict[int, tuple[int, float]], dict[int, tuple[int, int]]]:
    """Depth in marks (x) and leaf order (y), plus each mark's leaf span (rows ``[first, last)``).

    The icicle's layout (a subtree's leaves on adjacent rows, so a bar spans
    its children's), also the tree view's once a big tree is folded. Children
    are ordered by their oldest member id; a group of folded subtrees comes
    last among its siblings. A parent sits midway between its first and last
    child. A new branch shifts the rows below it: ``stable_layout`` does not.
    """
    order = {vid: (m.grouped_nodes > 0, min(m.member_ids, default=0)) for vid, m in marks.items()}
    kids = {vid: sorted(m.children, key=order.__getitem__) for vid, m in marks.items()}
    pos: dict[int, tuple[int, float]] = {}
    span: dict[int, tuple[int, int]] = {}
    next_leaf = 0
    stack: list[tuple[int, int, bool]] = [(0, 0, False)]
    while stack:  # depth first; a mark is placed after its children (postorder)
        vid, depth, children_done = stack.pop()
        succ = kids[vid]
        if not succ:
            span[vid] = (next_leaf, next_leaf + 1)
            pos[vid] = (depth, float(next_leaf))
            next_leaf += 1
        elif children_done:
            span[vid] = (span[succ[0]][0], span[succ[-1]][1])
            pos[vid] = (depth, (pos[succ[0]][1] + pos[succ[-1]][1]) / 2)
        else:
            stack.append((vid, depth, True))
            stack.extend((c, depth + 1, False) for c in reversed(succ))
    return pos, span
