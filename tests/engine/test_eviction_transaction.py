"""The eviction transaction (``engine.kvcache.eviction``, issue 47 point 6): a trial that cannot
make the room asked for leaves the tree, its leaf heap and its listener as they were; one that
stands is heard node by node, in the order the nodes went, once all of them are out; a clear of
the whole tree is one ``cleared``; the cache's rule is chosen in one place. Pure tree, no pool."""

from __future__ import annotations

import itertools

from engine.kvcache import eviction
from engine.kvcache.eviction import Rule, make_room, rule_for
from engine.kvcache.radix_tree import RadixTree
from engine.types import PUBLIC, CacheKey

SEQS = [((1, 2, 3), PUBLIC), ((1, 2, 4, 5), PUBLIC), ((7, 8), "v-a"), ((9,), "v-b"), ((6, 6, 6), "v-a/lab")]


class Recorder:
    """The tree listener's interface (``engine.kvcache.kv_events.KVEventPublisher``), recording
    each call with the tokens the tree held when it was made."""

    def __init__(self, tree: RadixTree) -> None:
        self.tree, self.events = tree, []

    def cached(self, node) -> None:
        self.events.append(("cached", node.id, self.tree.num_tokens))

    def removed(self, node) -> None:
        self.events.append(("removed", node.id, self.tree.num_tokens))

    def cleared(self) -> None:
        self.events.append(("cleared", self.tree.num_tokens))


def _tree(lock: tuple[int, ...] | None = (7, 8)) -> RadixTree:
    tree = RadixTree(clock=itertools.count().__next__)
    for ids, ns in SEQS:
        tree.insert(CacheKey(ids, ns), [(ns, ids[:i + 1]) for i in range(len(ids))])
    if lock is not None:
        tree.lock(tree.match(CacheKey(lock, "v-a"), touch=False).node)
    return tree


def _shape(tree: RadixTree) -> list:
    return sorted((n.id, n.key, n.namespace, tuple(n.value), n.hits, n.last_access, n.lock_ref) for n in tree.nodes())


def test_a_trial_that_falls_short_leaves_everything_as_it_was():
    tree, twin = _tree(), _tree()
    listener = Recorder(tree)
    tree.listener = listener
    unlocked = tree.num_tokens - tree.locked_tokens
    before = (_shape(tree), tree.num_tokens, tree.num_nodes, tree.evicted_tokens)
    assert make_room(tree, unlocked + 1, Rule()) is None
    assert (_shape(tree), tree.num_tokens, tree.num_nodes, tree.evicted_tokens) == before
    assert listener.events == [] and tree.listener is listener
    tree.check_invariants()
    tree.listener = None  # the heap gives the same order as on a tree that never had the trial
    order = [[n.id for n in eviction.evict(t, 5, Rule()).removed] for t in (tree, twin)]
    assert order[0] == order[1]


def test_a_trial_that_stands_is_heard_after_it_in_eviction_order():
    tree = _tree()
    listener = Recorder(tree)
    tree.listener = listener
    evicted = make_room(tree, 3, Rule())
    assert evicted is not None and len(evicted.freed) >= 3
    assert [v for n in evicted.removed for v in n.value] == evicted.freed
    assert listener.events == [("removed", n.id, tree.num_tokens) for n in evicted.removed]
    tree.check_invariants()


def test_a_partial_trial_keeps_what_it_could_take():
    tree = _tree()
    tree.listener = listener = Recorder(tree)
    unlocked = tree.num_tokens - tree.locked_tokens
    evicted = make_room(tree, unlocked + 10, Rule(), all_or_nothing=False)
    assert evicted is not None and len(evicted.freed) == unlocked
    assert tree.num_tokens == tree.locked_tokens
    assert [e[1] for e in listener.events] == [n.id for n in evicted.removed]
    tree.check_invariants()


def test_a_whole_clear_is_one_cleared_and_any_other_is_heard_node_by_node():
    tree = _tree(lock=None)
    tree.listener = listener = Recorder(tree)
    total = tree.num_tokens
    assert len(eviction.clear(tree)) == total and listener.events == [("cleared", 0)]
    tree = _tree()  # something locked: what goes is heard node by node
    tree.listener = listener = Recorder(tree)
    eviction.clear(tree)
    assert listener.events and all(e[0] == "removed" for e in listener.events)
    tree = _tree(lock=None)
    tree.listener = listener = Recorder(tree)
    assert len(eviction.clear(tree, "v-a")) == 2 and [e[0] for e in listener.events] == ["removed"]
    tree.check_invariants()


def test_the_caches_rule_is_chosen_in_one_place():
    assert rule_for("v-a/lab", False, 100, 7) == Rule()  # no isolation: the policy's order
    assert rule_for(PUBLIC, True, 100, 7) == Rule()  # shipped content: the policy's order
    assert rule_for(None, True, 100, 7) == Rule(fair=True, capacity_tokens=100)  # the operator's
    assert rule_for("v-a/lab", True, 100, 7) == Rule(fair=True, owner="v-a", capacity_tokens=100, incoming_tokens=7)


def test_the_tree_shorthand_is_the_same_eviction():
    for kwargs, rule in (({}, Rule()), ({"namespace": "v-b"}, Rule(namespace="v-b")),
                         ({"fair_for": "v-b", "capacity_tokens": 12},
                          Rule(fair=True, owner="v-b", capacity_tokens=12, incoming_tokens=4))):
        tree, twin = _tree(), _tree()
        removed: list = []
        freed = tree.evict(4, removed=removed, **kwargs)
        evicted = eviction.evict(twin, 4, rule)
        assert freed == evicted.freed and [n.id for n in removed] == [n.id for n in evicted.removed]
