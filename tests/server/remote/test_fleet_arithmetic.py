"""The Fleet tab's arithmetic on hand-built block trees (``server.remote.fleet``): each replica's
match of a prompt in whole blocks, which replica a request is attributed to and by which rule,
and the duplication counted by content (not by hash: two replicas hash alike blocks differently)."""

from __future__ import annotations

from server.remote.block_tree import BlockTree, RemovedEvent, StoredEvent
from server.remote.fleet import (
    AMBIGUOUS,
    COUNTED,
    GAINED,
    NO_EVENTS,
    REPORTED,
    attribute,
    cached_blocks_tokens,
    duplication,
)

BS = 4


def tree_with(chains: list[list[int]], hash_base: int) -> BlockTree:
    """A tree holding each chain's whole blocks, hashes numbered from ``hash_base`` (so two trees
    holding the same content have different hashes, as two processes would)."""
    t = BlockTree()
    seen: dict[tuple[int, ...], int] = {}
    for ids in chains:
        parent = None
        for i in range(len(ids) // BS):
            prefix = tuple(ids[:(i + 1) * BS])
            if prefix not in seen:
                seen[prefix] = hash_base + len(seen)
                t.apply(StoredEvent([seen[prefix]], parent, ids[i * BS:(i + 1) * BS], BS))
            parent = seen[prefix]
    t.check_invariants()
    return t


SYSTEM = list(range(100, 112))  # three blocks
A = SYSTEM + [1, 2, 3, 4, 5, 6]  # one more whole block, two tokens over
B = SYSTEM + [7, 8, 9, 10]


def test_match_is_whole_blocks_and_never_the_last_token():
    t = tree_with([A], 0)
    assert cached_blocks_tokens(t, A, None) == 16  # 4 blocks; 18 tokens, the last one is computed anyway
    assert cached_blocks_tokens(t, A[:16], None) == 12  # all 16 held, but the 16th token is computed
    assert cached_blocks_tokens(t, A[:16], None, cap_last=False) == 16
    assert cached_blocks_tokens(t, B, None) == 12  # the shared system prompt only
    assert cached_blocks_tokens(BlockTree(), A, None) == 0


def test_the_replica_whose_tree_grew_ran_it():
    assert attribute([12, 12, 0], [12, 16, 0], reported=12, block_size=BS) == (1, GAINED)


def test_no_growth_falls_back_to_exact_counters_then_to_the_reported_blocks():
    before, after = [12, 12, 0], [12, 12, 0]  # the answer added no whole block anywhere
    counts = [((100.0, 50.0), (100.0, 50.0)), ((80.0, 40.0), (98.0, 54.0)), (None, None)]
    assert attribute(before, after, reported=14, block_size=BS, counts=counts, prompt_tokens=18) == (1, COUNTED)
    # counters that do not add up exactly (another request ran meanwhile) are not trusted
    wrong = [((100.0, 50.0), (130.0, 60.0)), ((80.0, 40.0), (99.0, 54.0)), (None, None)]
    assert attribute(before, after, 14, BS, wrong, 18) == (None, AMBIGUOUS)  # 12 on two replicas: no tell
    assert attribute([12, 8, 0], [12, 8, 0], 14, BS, wrong, 18) == (0, REPORTED)  # 14 -> 12 in whole blocks: only 0
    assert attribute([None, None], [None, None], 3, BS) == (None, NO_EVENTS)


def test_exact_counters_overrule_a_gain_they_contradict():
    """The previous request's last events arrive late on replica 0 (its match of this prompt's
    shared prefix grows) before replica 1, which ran this one, publishes: the counters say 1."""
    counts = [((100.0, 50.0), (100.0, 50.0)), ((80.0, 40.0), (98.0, 54.0)), ((70.0, 30.0), (70.0, 30.0))]
    assert attribute([8, 12, 0], [12, 12, 0], reported=14, block_size=BS, counts=counts, prompt_tokens=18) == (1, COUNTED)
    assert attribute([12, 8, 0], [12, 16, 0], 14, BS, counts, 18) == (1, GAINED)  # both agree: the events' word
    no_tell = [((100.0, 50.0), (118.0, 64.0)), ((80.0, 40.0), (98.0, 54.0)), (None, None)]  # two add up
    assert attribute([8, 12, 0], [12, 12, 0], 14, BS, no_tell, 18) == (0, GAINED)  # counters that cannot tell


def test_two_replicas_that_grew_are_told_apart_by_the_reported_count():
    assert attribute([8, 0, 0], [16, 16, 0], reported=8, block_size=BS) == (0, REPORTED)


def test_duplication_counts_content_held_on_more_than_one_replica():
    r0 = tree_with([A], 0)
    r1 = tree_with([B], 1000)  # the same system prompt under other hashes
    r2 = tree_with([[9] * 8], 2000)
    d = duplication([r0, r1, r2])
    assert (d.tokens_held, d.tokens_distinct, d.tokens_on_several) == (16 + 16 + 8, 16 + 4 + 8, 12)
    assert d.duplicate_copy_tokens == 12
    # a salted first block is other content: not a duplicate of the unsalted one
    salted = BlockTree()
    salted.apply(StoredEvent([5000], None, SYSTEM[:4], BS, extra_keys=[["salt-x"]]))
    assert duplication([r0, salted]).tokens_on_several == 0


def test_a_block_whose_parent_left_is_never_anothers_duplicate():
    r0, r1 = tree_with([A], 0), tree_with([A], 1000)
    r1.apply(RemovedEvent([1000]))  # its first block evicted: the rest hang detached
    d = duplication([r0, r1])
    assert d.tokens_on_several == 0 and d.tokens_held == 16 + 12
