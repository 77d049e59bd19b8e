"""Radix tree: unit tests and a property test against a naive list of cached sequences."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kvcache.radix_tree import RadixTree
from engine.types import PUBLIC, CacheKey


def key(ids, ns=PUBLIC, public_len=0):
    return CacheKey(tuple(ids), ns, public_len)


def insert(tree, ids, ns=PUBLIC, public_len=0):
    k = key(ids, ns, public_len)
    m = tree.match(k, touch=False).length
    return tree.insert(k, [None] * m + [("slot", ns, tuple(ids[: i + 1])) for i in range(m, len(ids))])


def test_match_empty_tree():
    tree = RadixTree()
    assert tree.match(key([1, 2, 3])).length == 0


def test_insert_then_match_prefix_and_split():
    tree = RadixTree()
    insert(tree, [1, 2, 3, 4])
    assert tree.match(key([1, 2, 3, 4, 5])).length == 4
    assert tree.match(key([1, 2, 9])).length == 2
    assert len(tree.nodes()) == 1  # match never changes the shape
    res = insert(tree, [1, 2, 7])
    assert res.existing == 2
    assert sorted(len(n.key) for n in tree.nodes()) == [1, 2, 2]  # split [1,2] -> [3,4] | [7]
    tree.check_invariants()
    assert tree.num_tokens == 5


def test_values_follow_tokens_across_splits():
    tree = RadixTree()
    insert(tree, [5, 6, 7, 8])
    insert(tree, [5, 6, 1])
    m = tree.match(key([5, 6, 7, 8]))
    assert [v[2] for v in m.values] == [(5,), (5, 6), (5, 6, 7), (5, 6, 7, 8)]


def test_match_max_len_caps():
    tree = RadixTree()
    insert(tree, [1, 2, 3])
    assert tree.match(key([1, 2, 3]), max_len=2).length == 2


def test_locked_nodes_are_never_evicted():
    tree = RadixTree()
    insert(tree, [1, 2, 3])
    insert(tree, [4, 5])
    m = tree.match(key([1, 2, 3]))
    tree.lock(m.node)
    freed = tree.evict(100)
    assert len(freed) == 2  # only [4, 5]
    assert tree.match(key([1, 2, 3])).length == 3
    tree.unlock(m.node)
    assert len(tree.evict(100)) == 3
    tree.check_invariants()


def test_lock_survives_split_of_locked_node():
    tree = RadixTree()
    insert(tree, [1, 2, 3, 4])
    m = tree.match(key([1, 2, 3, 4]))
    tree.lock(m.node)
    insert(tree, [1, 2, 9])  # splits the locked node
    tree.check_invariants()
    assert tree.evict(100) == [("slot", PUBLIC, (1, 2, 9))]
    tree.unlock(m.node)
    tree.check_invariants()
    assert all(n.lock_ref == 0 for n in tree.nodes())


def test_evict_lru_first():
    clock = itertools.count()
    tree = RadixTree(clock=lambda: next(clock))
    insert(tree, [1, 1])
    insert(tree, [2, 2])
    tree.match(key([1, 1]))  # touch [1, 1]: now [2, 2] is older
    freed = tree.evict(1)
    assert [v[2] for v in freed] == [(2,), (2, 2)]


def test_namespaces_isolate_private_text_and_share_public_prefix():
    tree = RadixTree()
    insert(tree, [1, 2, 3, 4, 5], ns="alice", public_len=2)
    assert tree.match(key([1, 2, 3, 4, 5], ns="bob", public_len=2)).length == 2  # public part only
    assert tree.match(key([1, 2, 3, 4, 5], ns="alice", public_len=2)).length == 5
    assert tree.match(key([1, 2, 3], ns="bob", public_len=0)).length == 0  # nothing public claimed
    insert(tree, [1, 2, 3, 9], ns="bob", public_len=2)
    tree.check_invariants()
    namespaces = sorted(n.namespace for n in tree.nodes())
    assert namespaces == [PUBLIC, "alice", "bob"]
    assert len(tree.clear("alice")) == 3
    tree.check_invariants()


# ---------------------------------------------------------------- property test
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.lists(st.integers(0, 3), min_size=1, max_size=12), st.sampled_from("ab")),
        st.tuples(st.just("match"), st.lists(st.integers(0, 3), min_size=1, max_size=12), st.sampled_from("ab")),
        st.tuples(st.just("lock"), st.lists(st.integers(0, 3), min_size=1, max_size=12), st.sampled_from("ab")),
        st.tuples(st.just("unlock"), st.integers(0, 20), st.just("a")),
        st.tuples(st.just("evict"), st.integers(0, 30), st.just("a")),
    ),
    max_size=40,
)


def _lcp(a, b):
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@settings(max_examples=2000, deadline=None)
@given(ops)
def test_tree_matches_naive_reference(operations):
    """The reference is a plain set of cached sequences; a cached sequence implies
    all its prefixes are cached. Eviction can only drop unlocked suffixes."""
    tree = RadixTree()
    held: list[tuple] = []  # (node, ids, ns) locked
    for op, arg, ns in operations:
        if op == "insert":
            insert(tree, arg, ns=ns)
        elif op == "match":
            m = tree.match(key(arg, ns=ns))
            # Reference: longest common prefix with every cached path of that namespace.
            paths = _cached_paths(tree, ns)
            assert m.length == max((_lcp(arg, p) for p in paths), default=0)
            assert len(m.values) == m.length
            assert all(v[2] == tuple(arg[: i + 1]) for i, v in enumerate(m.values))
        elif op == "lock":
            m = tree.match(key(arg, ns=ns))
            if m.length:
                tree.lock(m.node)
                held.append((m.node, tuple(arg[: m.length]), ns))
        elif op == "unlock" and held:
            node, _, _ = held.pop(arg % len(held))
            tree.unlock(node)
        elif op == "evict":
            before = tree.num_tokens
            freed = tree.evict(arg)
            assert before - tree.num_tokens == len(freed)
        tree.check_invariants()
        for _, ids, ns_held in held:  # locked prefixes always survive
            assert tree.match(key(ids, ns=ns_held), touch=False).length == len(ids)
        values = tree.all_values()
        assert len(values) == len(set(values)) == tree.num_tokens
    for node, _, _ in held:
        tree.unlock(node)
    tree.check_invariants()
    tree.clear()
    assert tree.num_tokens == 0 and not tree.nodes()


def _cached_paths(tree, ns):
    out = []

    def walk(node, prefix):
        if node is not tree.root and node.is_leaf:
            out.append(prefix)
        for (child_ns, _), child in node.children.items():
            if child_ns == ns:
                walk(child, prefix + list(child.key))

    walk(tree.root, [])
    return out


# ------------------------------------------------------------------ fair share
def _owner_tokens(tree):
    return dict(tree.owner_tokens())


def test_fair_eviction_takes_from_the_inserter_over_its_share_first():
    tree = RadixTree(clock=itertools.count().__next__)
    insert(tree, range(1000, 1010), ns=PUBLIC)  # shipped: pinned against visitors' inserts
    insert(tree, range(100, 130), ns="v-b")  # victim, oldest entry
    for start in (200, 300):  # attacker's long unique prompts
        insert(tree, range(start, start + 40), ns="v-a")
    # capacity 130: share (130 - 10) / 2 = 60 each; a needs 40 more and holds 80: a's own go first
    freed = tree.evict(40, fair_for="v-a", capacity_tokens=130)
    assert len(freed) == 40 and all(v[1] == "v-a" for v in freed)
    assert _owner_tokens(tree) == {PUBLIC: 10, "v-b": 30, "v-a": 40}
    # a's own entries in use (locked): b, within its share, is not evicted for a; a stores less
    locked = [tree.match(key(range(s, s + 40), "v-a")).node for s in (200, 300) if
              tree.match(key(range(s, s + 40), "v-a"), touch=False).length]
    for node in locked:
        tree.lock(node)
    assert tree.evict(60, fair_for="v-a", capacity_tokens=130) == []
    for node in locked:
        tree.unlock(node)
    assert _owner_tokens(tree)["v-b"] == 30 and _owner_tokens(tree)[PUBLIC] == 10
    # plain LRU (the operator's clear / budget change) still drops everything
    tree.evict(tree.num_tokens)
    assert tree.num_tokens == 0


def test_fair_eviction_takes_from_owners_over_their_share_then_lru():
    tree = RadixTree(clock=itertools.count().__next__)
    insert(tree, range(100, 150), ns="v-a")  # 50 tokens
    insert(tree, range(200, 210), ns="v-b")  # 10
    insert(tree, range(300, 305), ns="v-c/lab-1")  # 5, a sub-namespace counts as c's
    # capacity 90, three owners: share 30. c needs 10 (ends at 15, within share): a is over, a pays
    freed = tree.evict(10, fair_for="v-c/lab-2", capacity_tokens=90)
    assert {v[1] for v in freed} == {"v-a"} and _owner_tokens(tree)["v-b"] == 10
    # nobody over share and c within it: plain LRU among visitors (b is the oldest)
    tree2 = RadixTree(clock=itertools.count().__next__)
    insert(tree2, range(200, 210), ns="v-b")
    insert(tree2, range(100, 110), ns="v-a")
    assert {v[1] for v in tree2.evict(5, fair_for="v-c", capacity_tokens=90)} == {"v-b"}


fair_ops = st.lists(st.tuples(st.sampled_from(["insert", "insert", "lock", "unlock", "fair"]),
                              st.lists(st.integers(0, 5), min_size=1, max_size=12),
                              st.sampled_from([PUBLIC, "v-a", "v-b", "v-b/lab-1", "v-c"]),
                              st.integers(1, 40)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(fair_ops)
def test_fair_eviction_invariants(operations):
    """Whatever happens: the tree stays consistent, locked and PUBLIC tokens survive a fair
    eviction, and an owner within its share loses tokens only to an inserter that ends
    within its own share (its new tokens included)."""
    tree = RadixTree()
    held = []
    for op, ids, ns, n in operations:
        if op == "insert":
            insert(tree, ids, ns=ns, public_len=n % 3)
        elif op == "lock":
            m = tree.match(key(ids, ns=ns, public_len=n % 3))
            if m.length:
                tree.lock(m.node)
                held.append((m.node, key(ids[: m.length], ns=ns, public_len=n % 3)))
        elif op == "unlock" and held:
            tree.unlock(held.pop(n % len(held))[0])
        elif op == "fair" and ns != PUBLIC:
            capacity = 60
            before = tree.owner_tokens()
            share = tree.fair_share(ns.split("/")[0], capacity, before)
            freed = tree.evict(n, fair_for=ns, capacity_tokens=capacity)
            after = tree.owner_tokens()
            assert sum(before.values()) - sum(after.values()) == len(freed)
            assert after[PUBLIC] == before[PUBLIC]
            me = ns.split("/")[0]
            if after[me] + n > share:  # ends over its share (n: its incoming tokens)
                for o, count in before.items():
                    if o not in (PUBLIC, me) and count <= share:
                        assert after[o] == count, (o, count, after[o], share)
        tree.check_invariants()
        for _, k in held:
            assert tree.match(k, touch=False).length == len(k.ids)
    for node, _ in held:
        tree.unlock(node)
    tree.check_invariants()
