"""What one visitor may see of the tree, derived from a full snapshot.

Owns: ``for_viewer``, the viewer's copy of a snapshot taken with ``viewer=None``, by the rule
``RadixCache.snapshot(viewer=...)`` applies under the cache lock, so a dashboard can take one
full snapshot per tick and give every visitor their view of it without walking the tree (or
decoding a token) again per visitor. The rule, as ``engine/prefix_cache.py`` states it:

- every subtree of other namespaces hanging from a visible node (or the root) becomes one
  ``hidden`` "others" node, id ``-1 - parent id``, its size rounded up to whole
  ``HIDDEN_BUCKET_TOKENS`` buckets, with no text, hits, lock or access time;
- shared (``PUBLIC``) nodes show no hits, locks or access times (others use them too);
- the totals count hidden tokens, and evictions, in the same buckets.

``tests/engine/test_snapshot_view.py`` checks node for node that both give the same answer.
Pure: plain data in, plain data out.
"""

from __future__ import annotations

from dataclasses import replace

from engine.prefix_cache import coarse_tokens
from engine.radix_tree import PUBLIC
from engine.types import NodeInfo, TreeSnapshot


def visible_to(namespace: str, viewer: str) -> bool:
    """Public content, the viewer's own namespace and its sub-namespaces (``<viewer>/...``)."""
    return namespace in (PUBLIC, viewer) or namespace.startswith(viewer + "/")


def owns_any(namespaces: frozenset[str], viewer: str) -> bool:
    """Whether any of ``namespaces`` is the viewer's own: if not, the viewer sees what any
    stranger sees (public nodes only), so one derived view serves all of them."""
    return any(ns != PUBLIC and visible_to(ns, viewer) for ns in namespaces)


def namespaces_of(snapshot: TreeSnapshot) -> frozenset[str]:
    return frozenset(n.namespace for n in snapshot.nodes)


def for_viewer(full: TreeSnapshot, viewer: str) -> TreeSnapshot:
    """``full`` (taken with ``viewer=None``, nodes parents first) as ``viewer`` may see it."""
    infos: list[NodeInfo] = []
    depth: dict[int, int] = {0: 0}  # visible node id (0: the root) -> depth in tokens
    anchor: dict[int, int] = {}  # hidden node id -> the visible node (or root) its subtree hangs from
    hidden_under: dict[int, int] = {}  # visible parent id -> tokens of others hanging from it, in order
    for n in full.nodes:
        if not visible_to(n.namespace, viewer):
            top = anchor.get(n.parent_id, n.parent_id)
            anchor[n.node_id] = top
            hidden_under[top] = hidden_under.get(top, 0) + n.num_tokens
            continue
        depth[n.node_id] = n.depth_tokens
        if n.namespace == PUBLIC:
            n = replace(n, lock_ref=0, hits=0, last_access_s_ago=0.0)
        infos.append(n)
    bpt = full.bytes_per_token
    for parent, tokens in hidden_under.items():
        size = coarse_tokens(tokens)
        infos.append(NodeInfo(
            node_id=-1 - parent, parent_id=parent, num_tokens=size, depth_tokens=depth[parent] + size,
            num_bytes=size * bpt, lock_ref=0, hits=0, last_access_s_ago=0.0, namespace="other", hidden=True,
            token_ids=(), text=""))
    num_tokens = sum(n.num_tokens for n in infos)
    return TreeSnapshot(tuple(infos), num_tokens, num_tokens * bpt, full.budget_bytes, full.capacity_tokens,
                        coarse_tokens(full.evicted_tokens), bpt)
