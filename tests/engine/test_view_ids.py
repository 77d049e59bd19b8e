"""A viewer's node ids (``engine.snapshot_view.view_ids``): the visible nodes numbered in the order
the tree made them, never the tree's counter, whose gaps would count the nodes other visitors
made. Real engine, real tree: what a visitor sees is the same whether others made no nodes or
many, from one snapshot to the next, and in another process; a split keeps the lower part's id
and numbers the upper part last, as the layout expects (``components.views.tree_places``)."""

from __future__ import annotations

from engine.snapshot_view import HIDDEN_SPILLED_BASE
from engine.types import GenerationRequest, SamplingParams
from tests.helpers_app import assert_clean, wait_idle

A, B = "v-a/s-1", "v-b/s-1"


def _run(engine, ids, namespace: str) -> None:
    engine.run(GenerationRequest(prompt_ids=tuple(ids), namespace=namespace,
                                 sampling=SamplingParams(max_new_tokens=1)))


def _ids_by_end(engine, viewer: str) -> dict[int, int]:
    """The viewer's visible nodes: where each ends (tokens from the root) -> its id."""
    return {n.depth_tokens: n.node_id for n in engine.snapshot(viewer=viewer).nodes if not n.hidden}


def _visible(engine, viewer: str) -> set[tuple[int, int, int]]:
    return {(n.node_id, n.parent_id, n.depth_tokens) for n in engine.snapshot(viewer=viewer).nodes if not n.hidden}


def test_others_work_never_shows_in_a_viewers_ids(make_engine):
    """A asks, others make (and split) any number of nodes, A asks again: A's view is the same
    whatever the others did (the tree's counter would have counted their nodes in A's new ids)."""
    views = []
    for others in (0, 5):
        engine = make_engine(isolation=True, max_new_tokens_cap=2)
        _run(engine, range(100, 140), A)
        first = _visible(engine, A)
        assert _visible(engine, A) == first  # the same from one snapshot to the next
        for k in range(others):
            _run(engine, [100 + j for j in range(20)] + [7000 + 50 * k + j for j in range(30)], B)
        assert _visible(engine, A) == first
        _run(engine, list(range(100, 120)) + list(range(300, 330)), A)
        view = engine.snapshot(viewer=A)
        assert sorted(n.node_id for n in view.nodes if not n.hidden) == list(range(1, len(_visible(engine, A)) + 1))
        visible = {n.node_id for n in view.nodes if not n.hidden}
        assert all(n.node_id in (-1 - n.parent_id, HIDDEN_SPILLED_BASE - n.parent_id)
                   and n.parent_id in visible | {0} for n in view.nodes if n.hidden)
        assert any(n.hidden for n in view.nodes) == bool(others)
        views.append(_visible(engine, A))
        wait_idle(engine)
        assert_clean(engine)
    assert views[0] == views[1]


def test_a_split_numbers_the_upper_part_last_and_a_new_engine_gives_the_same_ids(make_engine):
    first = make_engine(isolation=True, max_new_tokens_cap=2)
    _run(first, range(100, 160), A)
    whole = _ids_by_end(first, A)
    _run(first, list(range(100, 130)) + list(range(900, 920)), A)  # splits A's node at 30 tokens
    after = _ids_by_end(first, A)
    ends = sorted(after)
    assert 30 in after and 30 not in whole and after[30] > max(whole.values())  # the upper part: numbered after
    assert all(after[end] == whole[end] for end in whole)  # the lower part kept its id
    second = make_engine(isolation=True, max_new_tokens_cap=2)  # another process's secret, other counters
    _run(second, range(5000, 5090), B)
    _run(second, range(100, 160), "v-z/s-9")
    _run(second, list(range(100, 130)) + list(range(900, 920)), "v-z/s-9")
    assert _ids_by_end(second, "v-z/s-9") == after, ends  # the same content, the same ids
    for engine in (first, second):
        wait_idle(engine)
        assert_clean(engine)
