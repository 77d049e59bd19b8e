"""A radix tree over token ids: match, insert, split, evict, lock.

Owns: the shape of the cache (which token sequences are cached, under which
namespace, who is using them). Knows nothing about tensors: each node carries
an opaque ``value`` sequence, one entry per token (slot indices in the KV pool,
or ``None`` when the tree runs as a pure simulation), which the tree only
slices and hands back on eviction.

Namespaces isolate visitors. Every token position belongs to one namespace::

    ids:       t0 t1 ... t(p-1) | tp ... t(n-1)
    namespace: PUBLIC ........  | key.namespace      (p = key.public_len)

Children are keyed by ``(namespace, first token)``, so two visitors with the
same private text never share a node, while content shipped with the app
(``public_len`` tokens, decided by the server) is shared by everyone.

Eviction is ``engine.kvcache.eviction``'s: it picks unlocked leaves by the tree's
``EvictionPolicy`` (least recently used by default, and the fair-share rule of isolation mode)
from the one heap of evictable leaves the tree keeps (``leaves``), and the tree takes each out
(``evict_leaf``) or puts them back after a trial (``restore``). ``evict`` and ``clear`` here
are shorthands for its ``evict`` (simulations, the remote shadow tree, tests).

Invariants (``check_invariants``):
- every non-root node has a non-empty edge, ``len(value) == len(key)``, and is
  stored in its parent under ``(namespace, key[0])``;
- ``lock_ref`` never negative, and a node's lock count is at least each child's;
- ``num_tokens`` equals the sum of the edge lengths, ``num_nodes`` the nodes,
  ``locked_tokens`` the tokens of nodes with ``lock_ref > 0`` and ``shared_tokens``
  those with ``lock_ref > 1`` (read by more than one running request): counters kept
  as the tree changes, so reading them is O(1);
- every unlocked leaf has an entry in ``leaves`` no later than its policy priority.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from engine.kvcache import eviction
from engine.kvcache.eviction import EvictionPolicy, LeafHeap, evictable, make_policy
from engine.namespaces import owner_of
from engine.types import PUBLIC, CacheKey


@dataclass(eq=False)
class Node:
    id: int
    key: tuple[int, ...]
    value: Sequence[Any]
    namespace: str
    parent: Node | None
    children: dict[tuple[str, int], Node] = field(default_factory=dict)
    lock_ref: int = 0
    hits: int = 0
    last_access: float = field(default_factory=time.monotonic)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def depth_tokens(self) -> int:
        """Tokens from the root to the end of this node."""
        n, node = 0, self
        while node is not None:
            n += len(node.key)
            node = node.parent
        return n


class MatchResult(NamedTuple):
    """Longest cached prefix of a key. ``node`` is the deepest node touched.

    ``values`` are the per-token values of the matched prefix, in order; they
    stay valid only while ``node`` is locked (an unlocked node may be evicted).
    """

    length: int
    node: Node
    values: list[Any]
    path: list[int]  # node ids from the root's child down to ``node``


class InsertResult(NamedTuple):
    existing: int  # tokens of the key that were already cached
    node: Node  # the node that ends the key


class RadixTree:
    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 policy: EvictionPolicy | str | None = None) -> None:
        """``policy``: the eviction policy, or its name in ``engine.kvcache.eviction.POLICIES``
        (default LRU)."""
        self._ids = itertools.count(1)
        self._clock = clock
        self.policy = make_policy(policy)
        self.leaves = LeafHeap(self.policy.priority)  # every evictable leaf, in the policy's order
        self.root = Node(id=0, key=(), value=(), namespace=PUBLIC, parent=None, lock_ref=1)
        self.num_tokens = 0
        self.num_nodes = 0
        self.locked_tokens = 0  # tokens of nodes with lock_ref > 0
        self.shared_tokens = 0  # tokens of nodes with lock_ref > 1
        self.evicted_tokens = 0
        # Optional observer of what is cached (``engine.kvcache.kv_events.KVEventPublisher``):
        # ``cached(node)`` after tokens become cached along root..node, ``removed(node)`` when a
        # node's tokens leave (its parent link still set). Called under the owner's lock.
        self.listener: Any = None

    # ------------------------------------------------------------------ match
    def match(self, key: CacheKey, max_len: int | None = None, touch: bool = True) -> MatchResult:
        """Longest cached prefix of ``key.ids[:max_len]``. Does not change the tree's shape.

        With ``touch`` the matched nodes get a new access time and a hit.
        """
        ids = key.ids if max_len is None else key.ids[:max_len]
        node, pos, values, path = self.root, 0, [], []
        now = self._clock()
        while pos < len(ids):
            child = node.children.get((key.ns_at(pos), ids[pos]))
            if child is None:
                break
            limit = min(len(ids), key.ns_end(pos)) - pos
            n = common_prefix_len(child.key, ids, pos, limit)
            values.extend(child.value[:n])
            path.append(child.id)
            if touch:
                child.last_access = now
                child.hits += 1
            pos += n
            node = child
            if n < len(child.key):
                break
        return MatchResult(pos, node, values, path)

    # ----------------------------------------------------------------- insert
    def insert(self, key: CacheKey, value: Sequence[Any], touch: bool = True) -> InsertResult:
        """Cache ``key``; ``value[i]`` belongs to ``key.ids[i]``.

        Entries of ``value`` for tokens already cached are ignored (the cached
        ones are kept), so a caller allocates values only for
        ``ids[self.match(key).length:]`` and passes placeholders before that.
        Without ``touch`` the nodes it walks keep their access times (a split only).
        """
        ids = key.ids
        assert len(value) == len(ids), "one value per token"
        node, pos, now, existing, created = self.root, 0, self._clock(), 0, False
        while pos < len(ids):
            ns = key.ns_at(pos)
            child = node.children.get((ns, ids[pos]))
            end = key.ns_end(pos)
            if child is None:
                new = Node(next(self._ids), tuple(ids[pos:end]), list(value[pos:end]), ns, node,
                           last_access=now)
                node.children[(ns, ids[pos])] = new
                self.num_tokens += end - pos
                self.num_nodes += 1
                node, pos, created = new, end, True
                continue
            n = common_prefix_len(child.key, ids, pos, end - pos)
            if n < len(child.key):
                child = self._split(child, n)
            if touch:
                child.last_access = now
            node, pos, existing, created = child, pos + n, existing + n, False
        if created:
            self._push_leaf(node)
        if self.listener is not None and existing < len(ids):
            self.listener.cached(node)
        return InsertResult(existing, node)

    def _split(self, node: Node, n: int) -> Node:
        """Split ``node`` after ``n`` tokens; return the new upper part.

        ``parent -> [key[:n]] -> [key[n:]] (old node, keeps its children)``
        """
        assert 0 < n < len(node.key)
        parent = node.parent
        assert parent is not None
        upper = Node(next(self._ids), node.key[:n], node.value[:n], node.namespace, parent,
                     lock_ref=node.lock_ref, hits=node.hits, last_access=node.last_access)
        node.key, node.value = node.key[n:], node.value[n:]
        node.parent = upper
        upper.children[(node.namespace, node.key[0])] = node
        parent.children[(upper.namespace, upper.key[0])] = upper
        self.num_nodes += 1  # the lock counters are unchanged: both parts keep the lock count
        return upper

    def unsplit(self, upper: Node) -> None:
        """Undo ``_split``: ``upper`` and its only child become one node again (the child
        keeps its id). For a caller that split to protect an exact prefix and then gave up."""
        (lower,) = upper.children.values()
        assert lower.namespace == upper.namespace and lower.lock_ref == upper.lock_ref
        parent = upper.parent
        lower.key, lower.value = upper.key + lower.key, list(upper.value) + list(lower.value)
        lower.parent = parent
        parent.children[(lower.namespace, lower.key[0])] = lower
        self.num_nodes -= 1

    # ------------------------------------------------------------------- lock
    def lock(self, node: Node) -> None:
        """Protect ``node`` and its ancestors from eviction."""
        while node is not self.root:
            node.lock_ref += 1
            if node.lock_ref == 1:
                self.locked_tokens += len(node.key)
            elif node.lock_ref == 2:
                self.shared_tokens += len(node.key)
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "unlock without lock"
            if node.lock_ref == 0:
                self.locked_tokens -= len(node.key)
                if node.is_leaf:
                    self._push_leaf(node)
            elif node.lock_ref == 1:
                self.shared_tokens -= len(node.key)
            node = node.parent

    # ------------------------------------------------------------------ evict
    def evict(self, num_tokens: int, namespace: str | None = None, fair_for: str | None = None,
              capacity_tokens: int = 0, incoming_tokens: int | None = None,
              removed: list[Node] | None = None) -> list[Any]:
        """``engine.kvcache.eviction.evict``: unlocked leaves in the policy's order until
        ``num_tokens`` tokens are freed or none is left (only ``namespace``'s, if given). With
        ``fair_for`` (the namespace about to insert ``incoming_tokens``, by default ``num_tokens``),
        the fair-share rule of ``capacity_tokens`` instead. Returns the freed values; the removed
        nodes are appended to ``removed`` if given (``restore`` undoes them)."""
        if fair_for is not None:
            incoming = num_tokens if incoming_tokens is None else incoming_tokens
            rule = eviction.Rule(fair=True, owner=owner_of(fair_for), capacity_tokens=capacity_tokens,
                                 incoming_tokens=incoming)
        else:
            rule = eviction.Rule(namespace=namespace)
        evicted = eviction.evict(self, num_tokens, rule)
        if removed is not None:
            removed.extend(evicted.removed)
        return evicted.freed

    def owner_tokens(self) -> Counter[str]:
        """Cached tokens per owner (``PUBLIC`` included)."""
        usage: Counter[str] = Counter()
        for n in self.nodes():
            usage[owner_of(n.namespace)] += len(n.key)
        return usage

    def fair_share(self, owner: str, capacity_tokens: int, usage: Counter[str] | None = None) -> float:
        """Tokens each owner may hold when ``owner`` inserts (``engine.kvcache.eviction.fair_share``)."""
        return eviction.fair_share(self.owner_tokens() if usage is None else usage, owner, capacity_tokens)

    def evict_leaf(self, node: Node) -> Sequence[Any]:
        """Take the unlocked leaf ``node`` out (for ``engine.kvcache.eviction``); returns its
        values. Its parent, if that is now an unlocked leaf, joins ``leaves``."""
        parent = node.parent
        del parent.children[(node.namespace, node.key[0])]
        self.num_tokens -= len(node.key)
        self.num_nodes -= 1
        self.evicted_tokens += len(node.key)
        if self.listener is not None:
            self.listener.removed(node)
        if parent is not self.root and parent.is_leaf and parent.lock_ref == 0:
            self._push_leaf(parent)
        return node.value

    def _push_leaf(self, node: Node) -> None:
        self.leaves.push(node)
        if len(self.leaves) > 4 * self.num_nodes + 64:  # mostly stale entries: start again
            self.leaves.rebuild(self.nodes())

    def restore(self, removed: Sequence[Node]) -> None:
        """Undo an ``evict`` that returned ``removed`` (nothing else changed the tree since):
        the nodes go back where they were, with their values, hits and access times."""
        for node in reversed(removed):
            node.parent.children[(node.namespace, node.key[0])] = node
            self.num_tokens += len(node.key)
            self.num_nodes += 1
            self.evicted_tokens -= len(node.key)
            if self.listener is not None:
                self.listener.cached(node)
        for node in removed:
            if evictable(node):
                self._push_leaf(node)

    def remove_subtree(self, node: Node) -> list[Any]:
        """Take ``node`` and everything below it (all unlocked) out of the tree; returns their
        values. Not an eviction (``evicted_tokens`` is unchanged): the caller drops a stretch it
        knows is gone (the second tier's map cuts a path at a dropped chunk)."""
        parent = node.parent
        assert parent is not None and parent.children.get((node.namespace, node.key[0])) is node
        del parent.children[(node.namespace, node.key[0])]
        if self.listener is not None:
            self.listener.removed(node)
        freed: list[Any] = []
        stack = [node]
        while stack:
            n = stack.pop()
            assert n.lock_ref == 0, "removing a locked node"
            freed.extend(n.value)
            self.num_tokens -= len(n.key)
            self.num_nodes -= 1
            stack.extend(n.children.values())
        if parent is not self.root and parent.is_leaf and parent.lock_ref == 0:
            self._push_leaf(parent)
        return freed

    def clear(self, namespace: str | None = None) -> list[Any]:
        """Evict everything that is not locked, the listener hearing each node (the cache's clear
        is ``engine.kvcache.eviction.clear``); return the freed values."""
        return self.evict(self.num_tokens, namespace)

    # ------------------------------------------------------------------ views
    def nodes(self) -> list[Node]:
        """Every node but the root, parents before children."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def all_values(self) -> list[Any]:
        return [v for n in self.nodes() for v in n.value]

    def remap_values(self, fn: Callable[[Sequence[Any]], Sequence[Any]]) -> None:
        """Replace every node's value by ``fn(value)`` (used when the pool is rebuilt)."""
        for node in self.nodes():
            node.value = fn(node.value)

    def check_invariants(self) -> None:
        total = locked = shared = 0
        nodes = self.nodes()
        assert len(nodes) == self.num_nodes, f"num_nodes {self.num_nodes} != {len(nodes)}"
        for node in nodes:
            locked += len(node.key) if node.lock_ref > 0 else 0
            shared += len(node.key) if node.lock_ref > 1 else 0
            assert node.key, f"node {node.id} has an empty edge"
            assert len(node.value) == len(node.key), f"node {node.id}: value/key lengths differ"
            assert node.parent.children.get((node.namespace, node.key[0])) is node, "bad child key"
            assert node.lock_ref >= 0, f"node {node.id} lock_ref {node.lock_ref}"
            if node.parent is not self.root:
                assert node.parent.lock_ref >= node.lock_ref, "child locked more than parent"
            total += len(node.key)
        assert total == self.num_tokens, f"num_tokens {self.num_tokens} != {total}"
        assert locked == self.locked_tokens, f"locked_tokens {self.locked_tokens} != {locked}"
        assert shared == self.shared_tokens, f"shared_tokens {self.shared_tokens} != {shared}"
        stamps = self.leaves.stamps()
        for node in nodes:
            if node.is_leaf and node.lock_ref == 0:
                stamp = stamps.get(node.id)
                assert stamp is not None and stamp <= self.policy.priority(node), \
                    f"leaf {node.id} missing from the leaf heap, or its priority went down"


def common_prefix_len(a: Sequence[int], b: Sequence[int], start: int = 0, limit: int | None = None) -> int:
    """Length of the common prefix of ``a`` and ``b[start:start+limit]``."""
    n = min(len(a), len(b) - start if limit is None else min(limit, len(b) - start))
    for i in range(n):
        if a[i] != b[start + i]:
            return i
    return max(n, 0)
