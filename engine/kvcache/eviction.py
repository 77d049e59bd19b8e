"""Eviction: which cached leaves go when room is needed, and the one transaction that takes them.

Owns: every eviction of a tree. ``evict`` takes leaves by a ``Rule`` (the policy's order, or the
fair-share rule); ``make_room`` is the one trial-and-restore transaction (the cache's admission,
tier loads and inserts: evict with the listener detached, restore if too little was freed, else
let the listener hear it); ``clear`` empties a tree, one ``cleared`` for a whole one. Also
``EvictionPolicy`` (the order unlocked leaves go in), ``LeafHeap`` (the one heap of evictable
leaves, which the tree keeps between calls) and the registry that picks a policy by name
(``make_policy``; the app's ``--eviction-policy``). The tree (``engine.kvcache.radix_tree``)
keeps only the structural steps: ``leaves``, ``evict_leaf``, ``restore``. Every tree takes a
policy (``RadixTree(policy=...)``): the engine's cache, the replay's ``SimCache`` and the remote
engine's shadow tree evict through it, so they cannot disagree. Knows nothing about tensors,
pools, tiers or locks: a node's values are opaque here, as in the tree; the caller holds its
lock and spills what comes back.

A policy is one method, ``priority(node)``: the leaf with the lowest priority goes first, ties
by node id (older nodes first). A node's priority may never decrease while it is in the tree:
the heap is lazy (an entry whose stamp went stale is pushed again with the node's new priority
when it reaches the top), so the first valid entry popped is the true minimum.
``RadixTree.check_invariants`` checks that every evictable leaf has an entry no later than its
priority. **Adding a policy**: a subclass here with ``name``, ``priority`` and ``describe``, and
one line in ``POLICIES``.

Fair share (``Rule(fair=True)``; isolation mode): each *owner* (a namespace's part before any
``/``, so a visitor's sub-namespaces count as theirs) may hold ``(C - PUBLIC tokens) / owners``
tokens of a capacity of ``C``. Room for an inserting owner ``N`` is taken first from ``N``
itself if ``N`` would end over its share, then from the owner most over its share, and only
then in the policy's order; an owner within its share is never evicted for an owner that would
end over its own. The ``PUBLIC`` namespace (content shipped with the app) is counted but never
evicted for a visitor. With no inserting owner (the operator's budget shrink or offload) the
owners over their share go first, then the policy's order, and ``PUBLIC`` last of all. A plain
``Rule()`` (the operator's clear, and every cache without isolation) is the policy's order alone.
When an inserting owner's room comes from another owner, at least ``num_tokens`` rounded up to
whole ``OTHERS_BUCKET_TOKENS`` is taken, the part past ``num_tokens`` only from owners over
their share: what a visitor then finds of their own
prefixes (their ``cached_tokens``) tells another's prompt length only in buckets, as the tree's
"others" nodes do (issue 58: a visitor over their share read a newcomer's exact token count).
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from engine.namespaces import owner_of
from engine.types import PUBLIC

if TYPE_CHECKING:
    from engine.kvcache.radix_tree import Node, RadixTree

Priority = tuple[float, ...]
OTHERS_BUCKET_TOKENS = 256  # = engine.snapshot_view.HIDDEN_BUCKET_TOKENS (imported there would be circular)


def _bucket_up(num_tokens: int) -> int:
    return -(-num_tokens // OTHERS_BUCKET_TOKENS) * OTHERS_BUCKET_TOKENS


def attached(node: Node) -> bool:
    """Is ``node`` still in its tree (every link up to the root intact)? A removed node keeps
    its parent link (a listener and the tier read the path), so the links are checked."""
    while node.parent is not None:
        parent = node.parent
        if not node.key or parent.children.get((node.namespace, node.key[0])) is not node:
            return False
        node = parent
    return node.id == 0  # the root


def evictable(node: Node) -> bool:
    """An unlocked leaf that is still in the tree (the root is never one)."""
    return node.parent is not None and not node.children and node.lock_ref == 0 and attached(node)


class LeafHeap:
    """Evictable leaves, lowest ``priority`` first (ties by node id).

    Lazy: entries are never updated in place. An entry whose node is no longer an evictable
    leaf is dropped when it reaches the top; one whose node's priority moved is pushed again
    with the new one. The owner pushes every node that becomes an evictable leaf."""

    def __init__(self, priority: Callable[[Node], Priority]) -> None:
        self._priority = priority
        self._entries: list[tuple[Priority, int, Node]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, node: Node) -> None:
        heapq.heappush(self._entries, (self._priority(node), node.id, node))

    def rebuild(self, nodes: Iterable[Node]) -> None:
        """Start again from ``nodes`` (the evictable leaves among them): drops stale entries."""
        self._entries = [(self._priority(n), n.id, n) for n in nodes if evictable(n)]
        heapq.heapify(self._entries)

    def top_key(self) -> tuple[Priority, int] | None:
        """``(priority, node id)`` of the leaf that goes first (it stays); None when none."""
        entries = self._entries
        while entries:
            stamp, node_id, node = entries[0]
            if not evictable(node):
                heapq.heappop(entries)
                continue
            now = self._priority(node)
            if stamp != now:
                heapq.heapreplace(entries, (now, node_id, node))
                continue
            return stamp, node_id
        return None

    def pop(self) -> Node | None:
        """The evictable leaf that goes first, out of the heap; None when none is left."""
        if self.top_key() is None:
            return None
        return heapq.heappop(self._entries)[2]

    def stamps(self) -> dict[int, Priority]:
        """The earliest stamp held for each node id (for ``RadixTree.check_invariants``)."""
        out: dict[int, Priority] = {}
        for stamp, node_id, _ in self._entries:
            if node_id not in out or stamp < out[node_id]:
                out[node_id] = stamp
        return out


def fair_share(usage: Counter[str], owner: str | None, capacity_tokens: int) -> float:
    """Tokens each owner may hold: what ``PUBLIC`` leaves of the capacity, split between the
    owners holding tokens and ``owner`` (the one inserting, None when nobody is)."""
    owners = {o for o, n in usage.items() if o != PUBLIC and n > 0} | ({owner} if owner is not None else set())
    return max(0, capacity_tokens - usage[PUBLIC]) / max(1, len(owners))


class EvictionPolicy(ABC):
    """The order leaves go in (``priority``); ``evict`` below takes leaves by it."""

    name: ClassVar[str]

    @abstractmethod
    def priority(self, node: Node) -> Priority:
        """Lower goes first. Must never decrease while ``node`` is in the tree."""

    @abstractmethod
    def describe(self) -> str:
        """The order in words, for the UI: "least recently used first"."""


class LRU(EvictionPolicy):
    """Least recently used first: the leaf matched or inserted longest ago."""

    name = "lru"

    def priority(self, node: Node) -> Priority:
        return (node.last_access,)

    def describe(self) -> str:
        return "least recently used first"


class LFU(EvictionPolicy):
    """Least frequently used first: the fewest hits (matches that reused the node), then LRU."""

    name = "lfu"

    def priority(self, node: Node) -> Priority:
        return (node.hits, node.last_access)  # both only grow: the heap's rule holds

    def describe(self) -> str:
        return "least frequently used first (fewest hits, then least recently used)"


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRU, "lfu": LFU}
DEFAULT_POLICY = "lru"


def make_policy(policy: str | EvictionPolicy | None = None) -> EvictionPolicy:
    """The policy named ``policy`` (None: the default, LRU); an instance is returned as is.
    Raises ``ValueError`` naming the known policies for an unknown name."""
    if isinstance(policy, EvictionPolicy):
        return policy
    name = (policy or DEFAULT_POLICY).strip().lower()
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {policy!r}: choose one of {', '.join(sorted(POLICIES))}")
    return POLICIES[name]()


# ------------------------------------------------------------------ eviction
@dataclass(frozen=True)
class Rule:
    """Which leaves may go, and in what order (the module docstring). ``fair``: the fair-share
    rule of ``capacity_tokens``, ``owner`` inserting ``incoming_tokens`` (None: the operator's
    eviction). Else the policy's order alone, only ``namespace``'s leaves if given (a clear)."""

    fair: bool = False
    owner: str | None = None
    capacity_tokens: int = 0
    incoming_tokens: int = 0
    namespace: str | None = None


def rule_for(namespace: str | None, fair_share: bool, capacity_tokens: int, incoming_tokens: int) -> Rule:
    """The cache's rule for room for ``namespace``'s ``incoming_tokens`` (None: the operator's
    budget shrink or offload). Isolation mode (``fair_share``) is fair to visitors; ``PUBLIC``
    content is stored by the policy's order alone, as everything is without isolation."""
    if not fair_share or namespace == PUBLIC:
        return Rule()
    if namespace is None:
        return Rule(fair=True, capacity_tokens=capacity_tokens)
    return Rule(fair=True, owner=owner_of(namespace), capacity_tokens=capacity_tokens, incoming_tokens=incoming_tokens)


class Evicted(NamedTuple):
    """What one eviction took: the removed nodes in the order they went (each keeps its parent
    link: the listener and the tier read its path), and their values (pool slots, not yet free)."""

    removed: list[Node]
    freed: list[Any]


def evict(tree: RadixTree, num_tokens: int, rule: Rule) -> Evicted:
    """Take unlocked leaves by ``rule`` until ``num_tokens`` tokens are freed or none may go.
    The tree's listener hears each removal as it happens (``RadixTree.evict_leaf``)."""
    if rule.fair:
        return _evict_fair(tree, num_tokens, rule)
    heap, removed, freed, aside = tree.leaves, [], [], []
    while len(freed) < num_tokens:
        node = heap.pop()
        if node is None:
            break
        if rule.namespace is not None and node.namespace != rule.namespace:
            aside.append(node)  # not this clear's: back in the heap afterwards
            continue
        freed.extend(tree.evict_leaf(node))
        removed.append(node)
    for node in aside:
        heap.push(node)
    return Evicted(removed, freed)


def _evict_fair(tree: RadixTree, num_tokens: int, rule: Rule) -> Evicted:
    """The fair-share rule of the module docstring, each owner's leaves in the policy's order."""
    owner, priority = rule.owner, tree.policy.priority
    usage = tree.owner_tokens()
    share = fair_share(usage, owner, rule.capacity_tokens)
    heaps: dict[str, LeafHeap] = {}  # owner -> its evictable leaves (PUBLIC: its own heap)
    public = LeafHeap(priority)

    def push(n: Node) -> None:
        if n is tree.root or n.children or n.lock_ref:
            return
        if n.namespace == PUBLIC:
            if owner is None:
                public.push(n)
            return
        key = owner_of(n.namespace)
        if key not in heaps:
            heaps[key] = LeafHeap(priority)
        heaps[key].push(n)

    for n in tree.nodes():
        push(n)
    removed: list[Node] = []
    freed: list[Any] = []
    target = num_tokens  # raised to a whole bucket once another owner pays for the inserting one
    while len(freed) < target:
        ends_over = owner is not None and usage[owner] + rule.incoming_tokens > share
        ready = [o for o, h in heaps.items() if h.top_key() is not None]
        over = [o for o in ready if o != owner and usage[o] > share]
        if len(freed) >= num_tokens:  # past what was asked: only an over-share owner's bucket is filled up
            if not over:
                break
            ends_over = False
        if ends_over and owner in ready:
            victim, heap = owner, heaps[owner]
        elif over:
            victim = max(over, key=lambda o: usage[o] - share)
            heap = heaps[victim]
        elif not ends_over and ready:
            victim = min(ready, key=lambda o: heaps[o].top_key())
            heap = heaps[victim]
        elif owner is None and public.top_key() is not None:
            victim, heap = PUBLIC, public
        else:
            break  # the rest would come from owners within their share: store less instead
        if owner is not None and victim not in (owner, PUBLIC):
            target = max(target, _bucket_up(num_tokens))
        node = heap.pop()
        freed.extend(tree.evict_leaf(node))
        usage[victim] -= len(node.key)
        removed.append(node)
        push(node.parent)
    return Evicted(removed, freed)


def make_room(tree: RadixTree, num_tokens: int, rule: Rule, all_or_nothing: bool = True) -> Evicted | None:
    """The one trial-and-restore transaction: evict up to ``num_tokens`` tokens by ``rule`` with the
    tree's listener detached. All or nothing: when that frees fewer, the tree is restored as it was
    and None comes back, the listener told nothing. Else the eviction stands: the listener hears
    each removed node, in order, and the caller owns the freed values (spill, then free them)."""
    listener, tree.listener = tree.listener, None
    try:
        evicted = evict(tree, num_tokens, rule)
        if all_or_nothing and len(evicted.freed) < num_tokens:
            tree.restore(evicted.removed)
            return None
    finally:
        tree.listener = listener
    if listener is not None:
        for node in evicted.removed:
            listener.removed(node)
    return evicted


def clear(tree: RadixTree, namespace: str | None = None) -> list[Any]:
    """Evict every unlocked leaf (only ``namespace``'s, if given); returns the freed values. A clear
    that empties the whole tree is one ``cleared`` for the listener, as vLLM's reset is one
    ``AllBlocksCleared``; any other clear is heard node by node."""
    everything, listener = Rule(namespace=namespace), tree.listener
    if namespace is not None or tree.locked_tokens or listener is None:
        return evict(tree, tree.num_tokens, everything).freed
    tree.listener = None
    try:
        freed = evict(tree, tree.num_tokens, everything).freed
    finally:
        tree.listener = listener
    listener.cleared()
    return freed
