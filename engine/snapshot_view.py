"""What a viewer may see of a cache tree, and how a tree node becomes display data.

Owns the one rule every view applies (the local cache, the remote engine's shadow tree,
the dashboard's shared per-tick snapshot) and the one ``Node -> NodeInfo`` conversion (the
cache, the remote shadow tree, the replay simulation and the figure bench):

- ``may_see(viewer, namespace)``: public content, the viewer's own namespace and its
  sub-namespaces (``<viewer>/...``);
- ``node_infos(tree, ...)``: a tree's nodes as ``NodeInfo`` (parents first, no text: call it
  under the owner's lock), then ``with_text`` decodes outside that lock;
- ``for_viewer(full, viewer)``: a full snapshot as one viewer may see it:

  - every subtree of other namespaces hanging from a visible node (or the root) becomes one
    ``hidden`` "others" node, id ``-1 - parent id``, its size rounded up to whole
    ``HIDDEN_BUCKET_TOKENS`` buckets, with no text, hits, lock or access time (others'
    second-tier nodes, which isolation never writes, fold the same way into a ``spilled``
    "others" node of their own, id ``HIDDEN_SPILLED_BASE - parent id``);
  - the visible nodes are numbered 1, 2, 3... in the order of their ids in the full snapshot
    (``view_ids``): the order the tree made them, which the layout keeps places by
    (``components.views.tree_places``), without the gaps, which would count the nodes anyone
    else made. Others' work never changes them (nodes of others are never above a visible
    one); a visible node that goes renumbers those made after it;
  - shared (``PUBLIC``) nodes show no hits, locks or access times (others use them too);
  - the totals count hidden tokens, and evictions, in the same buckets; second-tier
    (``spilled``) nodes never count as pool tokens.

A viewer's stats (totals over their own requests, the cache's figures as their view gives
them) are built from these by ``engine.facade``. So a dashboard can take one full snapshot
per tick and give every visitor their view of it without walking the tree (or decoding a
token) again per visitor. Pure: plain data in, plain data out; reads tree nodes but never
changes a tree, and knows nothing about KV or the UI.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from engine.kvcache.radix_tree import Node, RadixTree
from engine.types import PUBLIC, NodeInfo, TreeSnapshot

HIDDEN_BUCKET_TOKENS = 256  # others' activity shows only in whole buckets: one chat turn fits in one
HIDDEN_SPILLED_BASE = -(1 << 50)  # ids of hidden "others" nodes of the second tier (below every other id)


RATE_BUCKET_TOKENS_PER_S = 10.0  # everyone's output rate, as a stranger sees it: 100 tokens in a 10 s window


def coarse_rate(tokens_per_s: float) -> float:
    """Everyone's output tokens/s rounded down to whole ``RATE_BUCKET_TOKENS_PER_S``: one visitor's
    answer (tens of tokens) does not move it, a server under load still reads as one."""
    return (max(0.0, tokens_per_s) // RATE_BUCKET_TOKENS_PER_S) * RATE_BUCKET_TOKENS_PER_S


def coarse_tokens(num_tokens: int) -> int:
    """``num_tokens`` rounded up to whole ``HIDDEN_BUCKET_TOKENS`` buckets."""
    return -(-num_tokens // HIDDEN_BUCKET_TOKENS) * HIDDEN_BUCKET_TOKENS


def coarse_bytes(num_bytes: int, bytes_per_token: int) -> int:
    """``num_bytes`` of KV as the bytes of the whole ``HIDDEN_BUCKET_TOKENS`` buckets its tokens fill."""
    return coarse_tokens(-(-num_bytes // bytes_per_token)) * bytes_per_token


def is_own(viewer: str, namespace: str) -> bool:
    """Whether ``namespace`` is the viewer's own namespace or one of its sub-namespaces."""
    return namespace == viewer or namespace.startswith(viewer + "/")


def may_see(viewer: str | None, namespace: str) -> bool:
    """Whether ``viewer`` (None: the operator, who sees everything) may see ``namespace``'s
    content: public content, the viewer's own namespace and its sub-namespaces."""
    return viewer is None or namespace == PUBLIC or is_own(viewer, namespace)


def owns_any(namespaces: frozenset[str], viewer: str) -> bool:
    """Whether any of ``namespaces`` is the viewer's own: if not, the viewer sees what any
    stranger sees (public nodes only), so one derived view serves all of them."""
    return any(ns != PUBLIC and is_own(viewer, ns) for ns in namespaces)


def namespaces_of(snapshot: TreeSnapshot) -> frozenset[str]:
    return frozenset(n.namespace for n in snapshot.nodes)


# ---------------------------------------------------------------- node -> NodeInfo
def node_info(node: Node, depth_tokens: int, now: float, bytes_per_token: int, *, node_id: int | None = None,
              parent_id: int | None = None, key: Sequence[int] | None = None, spilled: bool = False) -> NodeInfo:
    """``node`` as display data, without text. ``key`` (default: the node's edge), ``node_id``
    and ``parent_id`` let a caller show part of an edge under ids of its own (second-tier nodes)."""
    key = node.key if key is None else key
    return NodeInfo(
        node_id=node.id if node_id is None else node_id, parent_id=node.parent.id if parent_id is None else parent_id,
        num_tokens=len(key), depth_tokens=depth_tokens, num_bytes=len(key) * bytes_per_token,
        lock_ref=node.lock_ref, hits=node.hits, last_access_s_ago=max(0.0, now - node.last_access),
        namespace=node.namespace, hidden=False, token_ids=tuple(key), text="", spilled=spilled)


def node_infos(tree: RadixTree, now: float, bytes_per_token: int) -> list[NodeInfo]:
    """Every node of ``tree`` as ``NodeInfo``, parents before children, without text (call it
    under the lock that guards ``tree``; ``with_text`` decodes after it is released)."""
    depth = {tree.root.id: 0}
    out = []
    for node in tree.nodes():  # parents before children
        depth[node.id] = depth[node.parent.id] + len(node.key)
        out.append(node_info(node, depth[node.id], now, bytes_per_token))
    return out


def with_text(infos: Iterable[NodeInfo], decode: Callable[[Sequence[int]], str] | None,
              max_text_tokens: int) -> tuple[NodeInfo, ...]:
    """``infos`` with their text decoded (at most ``max_text_tokens`` of each, "…" past that);
    hidden nodes carry no tokens and keep no text. Without ``decode`` the text stays empty."""
    if decode is None:
        return tuple(infos)
    out = []
    for n in infos:
        ids = n.token_ids
        if n.hidden or not ids:
            out.append(n)
            continue
        shown = ids if len(ids) <= max_text_tokens else ids[:max_text_tokens]
        out.append(replace(n, text=decode(shown) + ("…" if len(ids) > max_text_tokens else "")))
    return tuple(out)


# ---------------------------------------------------------------- one viewer's view
def pool_tokens(nodes: Iterable[NodeInfo]) -> int:
    """Tokens of ``nodes`` held in the pool (second-tier nodes are not)."""
    return sum(n.num_tokens for n in nodes if not n.spilled)


def for_viewer(full: TreeSnapshot, viewer: str) -> TreeSnapshot:
    """``full`` (taken with ``viewer=None``, nodes parents first) as ``viewer`` may see it."""
    infos: list[NodeInfo] = []
    depth: dict[int, int] = {0: 0}  # visible node id (0: the root) -> depth in tokens
    anchor: dict[int, int] = {}  # hidden node id -> the visible node (or root) its subtree hangs from
    hidden_under: dict[tuple[int, bool], int] = {}  # (visible parent id, spilled) -> others' tokens, in order
    ids = view_ids(full, viewer)
    for n in full.nodes:
        if not may_see(viewer, n.namespace):
            top = anchor.get(n.parent_id, n.parent_id)
            anchor[n.node_id] = top
            hidden_under[top, n.spilled] = hidden_under.get((top, n.spilled), 0) + n.num_tokens
            continue
        n = replace(n, node_id=ids[n.node_id], parent_id=ids[n.parent_id])
        depth[n.node_id] = n.depth_tokens
        if n.namespace == PUBLIC:
            n = replace(n, lock_ref=0, hits=0, last_access_s_ago=0.0)
        infos.append(n)
    bpt = full.bytes_per_token
    for (top, spilled), tokens in hidden_under.items():
        parent, size = ids[top], coarse_tokens(tokens)
        infos.append(NodeInfo(
            node_id=(HIDDEN_SPILLED_BASE if spilled else -1) - parent, parent_id=parent, num_tokens=size,
            depth_tokens=depth[parent] + size, num_bytes=size * bpt, lock_ref=0, hits=0, last_access_s_ago=0.0,
            namespace="other", hidden=True, token_ids=(), text="", spilled=spilled))
    num_tokens = pool_tokens(infos)
    return TreeSnapshot(tuple(infos), num_tokens, num_tokens * bpt, full.budget_bytes, full.capacity_tokens,
                        coarse_tokens(full.evicted_tokens), bpt, full.tier_kind, full.origin)


def view_ids(full: TreeSnapshot, viewer: str) -> dict[int, int]:
    """The full snapshot's id -> the viewer's, for the root (0) and the nodes ``viewer`` may see:
    1, 2, 3... in the order of the full ids (see the module docstring)."""
    visible = sorted(n.node_id for n in full.nodes if may_see(viewer, n.namespace))
    return {0: 0} | {node_id: rank for rank, node_id in enumerate(visible, 1)}
