"""Radix tree: unit tests and a property test against a naive list of cached sequences."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.radix_tree import PUBLIC, CacheKey, RadixTree


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
