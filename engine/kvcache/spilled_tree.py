"""Which prefixes the second tier holds, as a pure radix tree, so the tree view can show them.

Owns: ``SpilledTree``, a ``RadixTree`` (no KV) of the token paths whose chunks the cache
spilled, and the map from a chunk's key to where it sits on those paths. Knows nothing
about tensors or files (``engine.kvcache.kv_tier`` keeps the bytes) and nothing about the pool:
``RadixCache`` tells it what it spilled and what the tier dropped, and asks it for the
spilled nodes of a snapshot.

A path runs from the root (chunks are keyed by the whole prefix); each token position
carries a mark, ``True`` where the tier holds the chunk over it, ``None`` where the path only
passes (it was in the pool when the chunk below was spilled)::

    path:   [0 ........ a) [a ......... a+C) [a+C ...... a+2C)
    marks:   None (was       True (chunk      True
             in the pool)    a+C in tier)

What is spilled is what the pool lacks and the tier can give: a snapshot follows each path
through the resident tree (``infos``), and where the path leaves it, the marked positions
after that point are the spilled node, attached to the deepest resident node the path holds
whole (a path that leaves the resident tree inside a node hangs from that node's parent,
since a snapshot cannot hang a node mid-edge; its ``depth_tokens`` still says where it
ends). Loading a stretch back needs no bookkeeping (it is then resident, so the walk skips
it); a chunk the tier drops cuts every path at that chunk's start (nothing past a missing
chunk can be loaded), so the tree never holds more than the tier.

Invariants (``check``): the tree's own; marks are ``True`` or ``None``; every leaf ends on a
chunk boundary; every marked chunk and every mapped key is in the tier.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.kvcache.kv_tier import CHUNK_TOKENS
from engine.kvcache.radix_tree import Node, RadixTree
from engine.snapshot_view import node_info
from engine.types import PUBLIC, CacheKey, NodeInfo

SPILLED_IDS = 1 << 40  # snapshot ids of spilled nodes: this plus the spilled tree's node id (no clash)

ChunkKeyOf = Callable[[CacheKey, int], str]  # (path, chunk end) -> the tier's key of that chunk


class SpilledTree:
    """The second tier's paths (see the module docstring). Not thread-safe: the cache calls it
    under its lock; only ``dropped`` may be called from anywhere (the tier's ``on_drop``)."""

    def __init__(self) -> None:
        self.tree = RadixTree()
        self._at: dict[str, tuple[Node, int]] = {}  # chunk key -> (a node on its path, chunk end)
        self._dropped: list[str] = []  # keys the tier let go, not yet applied

    def dropped(self, key: str) -> None:
        """The tier's ``on_drop``: remembered, applied by ``apply_drops`` under the cache's lock."""
        self._dropped.append(key)

    # ------------------------------------------------------------- changes
    def record(self, path: CacheKey, chunks: list[tuple[int, str, bool]]) -> None:
        """The cache spilled along ``path``: ``(chunk end, chunk key, kept)`` in order. The kept
        chunks before the first one the tier lacks are marked; at that one the path is cut."""
        kept: list[tuple[int, str]] = []
        for stop, key, ok in chunks:
            if not ok:
                self.cut(path, stop - CHUNK_TOKENS)
                break
            kept.append((stop, key))
        if not kept:
            return
        first, end = kept[0][0] - CHUNK_TOKENS, kept[-1][0]
        node = self.tree.insert(path.prefix(end), [None] * end).node
        n, hi = node, end
        while n is not self.tree.root and hi > first:  # mark [first, end) node by node, upwards
            lo = hi - len(n.key)
            for i in range(max(lo, first), hi):
                n.value[i - lo] = True
            n, hi = n.parent, lo
        for stop, key in kept:
            self._at[key] = (node, stop)

    def cut(self, path: CacheKey, at: int) -> None:
        """Remove everything at and past position ``at`` of ``path`` (and what branches off after it)."""
        if self.tree.match(path, touch=False).length <= at:
            return
        top = self.tree.insert(path.prefix(at), [None] * at).node if at else self.tree.root
        below = top.children.get((path.ns_at(at), path.ids[at]))
        if below is not None:
            self.tree.remove_subtree(below)

    def apply_drops(self, in_tier: Callable[[str], bool]) -> None:
        """Cut the paths at every chunk the tier dropped since the last call (unless it holds it again)."""
        while self._dropped:
            key = self._dropped.pop()
            entry = self._at.pop(key, None)
            if entry is None:
                continue
            if in_tier(key):  # written again since: the entry is the new one
                self._at[key] = entry
                continue
            path = self.path_of(entry[0])
            if len(path.ids) >= entry[1]:  # else a cut took the chunk already
                self.cut(path, entry[1] - CHUNK_TOKENS)

    def leaf_paths(self) -> list[CacheKey]:
        """Every spilled path, root to leaf (what a restart needs to draw the tier again)."""
        return [self.path_of(n) for n in self.tree.nodes() if n.is_leaf and n is not self.tree.root]

    def path_of(self, node: Node) -> CacheKey:
        """The path from the root to the end of ``node``, or of its deepest ancestor still in the
        tree when a cut took ``node`` (a cut keeps the part above it, so that part still holds
        every chunk of ``node``'s path that ends before the cut)."""
        chain = []
        while node is not self.tree.root:
            chain.append(node)
            node = node.parent
        ids: list[int] = []
        public, namespace, parent = 0, PUBLIC, self.tree.root
        for n in reversed(chain):
            if parent.children.get((n.namespace, n.key[0])) is not n:
                break
            ids.extend(n.key)
            if n.namespace == PUBLIC:
                public += len(n.key)
            else:
                namespace = n.namespace
            parent = n
        return CacheKey(tuple(ids), namespace, public)

    # ------------------------------------------------------------- views
    def infos(self, resident: RadixTree, now: float, bytes_per_token: int) -> list[NodeInfo]:
        """The spilled nodes of a snapshot of ``resident`` (parents first, no text): per spilled
        edge, the marked tokens past where its path leaves the resident tree."""
        out: list[NodeInfo] = []
        # spilled node id -> where its end is: (resident node, tokens into it, None) while the path is
        # resident, (None, 0, snapshot id) once it is spilled; absent when nothing reachable is there
        at: dict[int, tuple[Node | None, int, int | None]] = {self.tree.root.id: (resident.root, 0, None)}
        depth = {self.tree.root.id: 0}
        for s in self.tree.nodes():  # parents before children
            depth[s.id] = depth[s.parent.id] + len(s.key)
            where = at.get(s.parent.id)
            if where is None:
                continue
            m, k, parent_id = where
            r = 0
            if parent_id is None:
                m, k, r = _follow(m, k, s)
                if r == len(s.key):
                    at[s.id] = (m, k, None)
                    continue
                parent_id = m.id if k == len(m.key) else m.parent.id
            n = r
            while n < len(s.key) and s.value[n] is True:
                n += 1
            if n == r:
                continue  # the tier lacks what comes next: nothing below is reachable
            out.append(node_info(s, depth[s.id] - len(s.key) + n, now, bytes_per_token, node_id=SPILLED_IDS + s.id,
                                 parent_id=parent_id, key=s.key[r:n], spilled=True))
            if n == len(s.key):
                at[s.id] = (None, 0, SPILLED_IDS + s.id)
        return out

    def check(self, in_tier: Callable[[str], bool], key_of: ChunkKeyOf) -> None:
        """Assert the invariants of the module docstring (after ``apply_drops``)."""
        self.tree.check_invariants()
        assert not self._dropped, "drops not applied"
        assert all(in_tier(k) for k in self._at), "a mapped chunk is not in the tier"
        for node in self.tree.nodes():
            assert node.lock_ref == 0 and all(v in (True, None) for v in node.value), f"spilled node {node.id}"
            path = self.path_of(node)
            end = len(path.ids)
            assert end == node.depth_tokens(), f"spilled node {node.id} is not in the tree"
            if node.is_leaf:
                assert end % CHUNK_TOKENS == 0, f"spilled leaf {node.id} ends inside a chunk ({end})"
            start = end - len(node.key)
            for i, mark in enumerate(node.value):
                stop = start + i + 1
                if mark and stop % CHUNK_TOKENS == 0:
                    assert in_tier(key_of(path, stop)), f"spilled chunk ending at {stop} is not in the tier"


def _follow(m: Node, k: int, s: Node) -> tuple[Node, int, int]:
    """Follow ``s``'s edge through the resident tree from ``k`` tokens into ``m``: where the
    path stands after the resident part, and how many of ``s``'s tokens that part holds."""
    r = 0
    while r < len(s.key):
        if k == len(m.key):
            child = m.children.get((s.namespace, s.key[r]))
            if child is None:
                break
            m, k = child, 0
        if m.namespace != s.namespace or m.key[k] != s.key[r]:
            break
        k, r = k + 1, r + 1
    return m, k, r
