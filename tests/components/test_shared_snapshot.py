"""One tree walk per tick, whoever watches: every visitor's view of the tree is derived from one
full snapshot (``engine.snapshot_view.for_viewer``), which gives exactly what the cache's own
``snapshot(viewer=...)`` gives; the tab's refresh and the public ``tree_snapshot`` endpoint
share that walk, so N visitors (or N calls to the endpoint) cost one walk, not N."""

from __future__ import annotations

import dataclasses

import pytest

from components.panels import live
from components.panels.live import shared_snapshot
from components.panels.tree_panel import snapshot_summary_for
from engine.engine import Engine
from engine.snapshot_view import for_viewer
from engine.types import PUBLIC, GenerationRequest, SamplingParams, TreeSnapshot

SHARED = "You are the shop's assistant. Answer in one short sentence, politely and precisely. " * 2


def no_clock(snap: TreeSnapshot) -> TreeSnapshot:
    """The snapshot without access times (two snapshots are never taken at the same instant)."""
    return dataclasses.replace(snap, nodes=tuple(dataclasses.replace(n, last_access_s_ago=0.0) for n in snap.nodes))


@pytest.fixture(scope="module")
def engine(tiny_runner, make_module_engine) -> Engine:
    """An isolating engine holding public content, two visitors (one with a sub-namespace and a
    two-turn chat, so hidden subtrees have several nodes) and an eviction or two."""
    engine = make_module_engine(tiny_runner, isolation=True, max_new_tokens_cap=4,
                                budget_bytes=900 * tiny_runner.kv_bytes_per_token)
    public = len(engine.encode(SHARED)) - 1
    runs = [("v-a", SHARED + "Where are the hammers?"), ("v-b", SHARED + "Where are the nails?"),
            ("v-b", SHARED + "Where are the nails? And the screws, please?"), ("v-a/lab-1", "Lab variant one."),
            ("v-c", "Another visitor's private words " * 12), (PUBLIC, SHARED + "Opening hours?")]
    for ns, prompt in runs:
        engine.run(GenerationRequest(prompt=prompt, namespace=ns, sampling=SamplingParams(max_new_tokens=3),
                                     public_len=public if prompt.startswith(SHARED) else 0))
    for i in range(6):  # private traffic past the budget: evictions, counted coarse for viewers
        engine.run(GenerationRequest(prompt=f"Filler {i} " * 40, namespace="v-d",
                                     sampling=SamplingParams(max_new_tokens=2)))
    assert engine.cache.evicted_tokens > 0
    return engine


@pytest.mark.parametrize("viewer", ["v-a", "v-b", "v-c", "v-d", "v-nobody"])
def test_for_viewer_gives_what_the_cache_gives(engine, viewer):
    decode = engine.runner.text.decode
    full = engine.cache.snapshot(decode, viewer=None)
    want = engine.cache.snapshot(decode, viewer=viewer)
    got = for_viewer(full, viewer)
    assert no_clock(got) == no_clock(want)
    assert any(n.hidden for n in got.nodes)


def test_viewers_share_one_walk_per_tick(engine, monkeypatch):
    walks: list[str | None] = []
    real = engine.snapshot

    def counting(viewer=None):
        walks.append(viewer)
        return real(viewer=viewer)

    monkeypatch.setattr(engine, "snapshot", counting)
    live.forget(engine)
    viewers = ["v-a", "v-b", "v-c", "v-d"] + [f"v-stranger-{i}" for i in range(4)]
    views = {v: shared_snapshot(engine, v, max_age_s=60) for v in viewers}
    assert walks == [None]  # eight viewers: one walk, of the whole tree
    for v in viewers:
        assert no_clock(views[v]) == no_clock(real(viewer=v))
    assert views["v-stranger-0"] is views["v-stranger-3"]  # owning nothing, they share one view
    assert shared_snapshot(engine, "v-a", max_age_s=60) is views["v-a"]  # and each keeps theirs for the tick
    # The public endpoint rides on the same walk and builds each summary once per view.
    summaries = [snapshot_summary_for(engine, f"v-caller-{i}") for i in range(20)]
    assert walks == [None] and all(s is summaries[0] for s in summaries)
    texts = [n.get("text") for n in summaries[0]["nodes"]]
    assert not any(t and "private words" in t for t in texts)
    # A new tick (the tree changed): one more walk for everyone.
    engine.run(GenerationRequest(prompt="One more private line.", namespace="v-a",
                                 sampling=SamplingParams(max_new_tokens=2)))
    for v in viewers:
        shared_snapshot(engine, v, max_age_s=60)
    assert walks == [None, None]


def test_the_cards_and_the_memory_tab_ride_on_the_same_walk(engine, monkeypatch):
    """``engine.stats(viewer)`` walks the tree for every visitor; the side cards and the memory tab
    read the cache's figures off the shared snapshot instead (the same figures)."""
    from components.panels.live import cache_figures
    from components.panels.memory_panel import memory_markdown
    from components.panels.overview_panel import key_numbers_html

    walks: list[str | None] = []
    real = engine.cache.snapshot

    def counting(decode=None, viewer=None, **kw):
        walks.append(viewer)
        return real(decode, viewer=viewer, **kw)

    monkeypatch.setattr(engine.cache, "snapshot", counting)
    live.forget(engine)
    viewers = ["v-a", "v-b", "v-c", "v-d"] + [f"v-stranger-{i}" for i in range(4)]
    for v in viewers:
        key_numbers_html(engine, None, v)
        memory_markdown(engine, [], v)
    figures = {v: cache_figures(engine, v) for v in viewers}
    assert walks == [None]  # eight visitors, both panels: one walk
    monkeypatch.setattr(engine.cache, "snapshot", real)
    for v in viewers:
        s = engine.stats(v)
        got = figures[v]
        assert (got.kv_bytes.value, got.budget.value, got.tokens.value, got.nodes.value, got.evicted.value) == (
            s.cache_bytes, s.budget_bytes, s.cached_tokens_now, s.num_nodes, s.evicted_tokens)


def test_open_tabs_share_one_figure_per_change(engine, make_engine):
    """N sessions with the tree tab open draw one figure per snapshot, not one each."""
    from types import SimpleNamespace

    from components.panels.tree_panel import tree_figure_for

    live.forget(engine)
    shared = make_engine(engine.runner, max_new_tokens_cap=4)  # a shared cache: every session sees the same tree
    shared.run(GenerationRequest(prompt="a shared line", sampling=SamplingParams(max_new_tokens=2)))
    figs = [tree_figure_for(shared, SimpleNamespace(session_hash=f"s{i}"), None) for i in range(8)]
    assert all(f is figs[0] for f in figs)
    shared.run(GenerationRequest(prompt="another shared line", sampling=SamplingParams(max_new_tokens=2)))
    assert tree_figure_for(shared, SimpleNamespace(session_hash="s0"), None) is not figs[0]
