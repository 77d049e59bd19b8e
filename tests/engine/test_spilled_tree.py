"""The tree shows the second tier: a node evicted with the tier on is in the snapshot marked
``spilled`` (whole chunks, attached where its prefix leaves the resident tree, never counted
as pool tokens), is resident again once a request loads it back, and vanishes when the tier
drops its chunks; with the tier off there is none (tiny random Llama)."""

from __future__ import annotations

from engine.engine import Engine
from engine.kvcache.kv_tier import CHUNK_TOKENS
from engine.snapshot_view import HIDDEN_BUCKET_TOKENS, HIDDEN_SPILLED_BASE, for_viewer
from engine.types import NodeInfo, TreeSnapshot
from tests.engine.test_kv_tier import req, tier_engine
from tests.engines import rand_ids
from tests.helpers_app import assert_clean, wait_idle

C = CHUNK_TOKENS


def spilled(engine: Engine) -> list[NodeInfo]:
    engine.check_invariants()
    return [n for n in engine.cache.snapshot(engine.runner.text.decode).nodes if n.spilled]


def test_an_evicted_node_shows_spilled_then_resident_again_after_a_load(tiny_runner, tmp_path, make_engine):
    vocab = len(tiny_runner.text.tokenizer)
    engine = tier_engine(make_engine, tiny_runner, tmp_path, budget_tokens=1000)
    shared = rand_ids(1, 2 * C + 5, vocab)
    a, b = shared + rand_ids(2, 2 * C, vocab), shared + rand_ids(3, 2 * C, vocab)
    engine.run(req(a, 1))
    engine.run(req(b, 1))
    assert spilled(engine) == []
    cache = engine.cache
    engine.set_budget((cache.num_tokens - 1) * cache.bytes_per_token)  # evicts the least recent leaf: a's tail
    snap = cache.snapshot(engine.runner.text.decode)
    (node,) = [n for n in snap.nodes if n.spilled]
    parent = next(n for n in snap.nodes if n.node_id == node.parent_id)
    assert not parent.spilled and parent.depth_tokens == len(shared)  # hangs where its prefix leaves the pool
    assert node.depth_tokens == (len(a) // C) * C and node.depth_tokens - node.num_tokens == len(shared)
    assert node.text and node.token_ids == tuple(a[len(shared):node.depth_tokens])
    assert snap.tier_kind == "disk" and snap.num_tokens == cache.num_tokens  # spilled tokens are not pool tokens
    assert sum(n.num_tokens for n in snap.nodes if not n.spilled) == cache.num_tokens
    engine.check_invariants()
    engine.set_budget(1000 * cache.bytes_per_token)
    m = engine.run(req(a + [7], 1))
    assert m.tier_tokens > 0
    assert spilled(engine) == []  # loaded back: resident again
    wait_idle(engine)
    assert_clean(engine)


def test_a_whole_offload_shows_under_the_root_and_the_tier_dropping_it_removes_it(tiny_runner, tmp_path, make_engine):
    vocab = len(tiny_runner.text.tokenizer)
    chunk_bytes = C * tiny_runner.kv_bytes_per_token
    engine = make_engine(budget_bytes=1000 * tiny_runner.kv_bytes_per_token, tier_bytes=3 * chunk_bytes,
                         tier_dir=str(tmp_path))
    first, second = rand_ids(4, 3 * C + 9, vocab), rand_ids(5, 3 * C + 9, vocab)
    engine.run(req(first, 1))
    engine.offload_cache()
    nodes = spilled(engine)
    assert [(n.parent_id, n.num_tokens, n.token_ids) for n in nodes] == [(0, 3 * C, tuple(first[:3 * C]))]
    engine.run(req(second, 1))  # loads nothing of ``first``; evicting it now pushes ``first`` out of the tier
    engine.offload_cache()
    nodes = spilled(engine)
    assert engine.tier.dropped_chunks == 3
    assert [(n.parent_id, n.token_ids) for n in nodes] == [(0, tuple(second[:3 * C]))]
    m = engine.run(req(first + [1], 1))
    assert m.tier_tokens == 0  # really gone: recomputed
    wait_idle(engine)
    assert_clean(engine)


def test_no_spilled_nodes_without_a_tier(tiny_runner, make_engine):
    vocab = len(tiny_runner.text.tokenizer)
    engine = make_engine(budget_bytes=300 * tiny_runner.kv_bytes_per_token)
    for i in range(4):
        engine.run(req(rand_ids(10 + i, 2 * C + 3, vocab), 1))
    assert engine.cache.evicted_tokens > 0 and spilled(engine) == []
    assert engine.cache.snapshot().tier_kind == ""


def test_others_spilled_nodes_hide_like_resident_ones():
    """Same rule as resident nodes: one coarse "others" node per parent, here marked spilled
    (and not counted in the pool's tokens); the viewer's own spilled node stays as it is."""
    def node(i: int, parent: int, n: int, depth: int, ns: str, spilled: bool) -> NodeInfo:
        return NodeInfo(i, parent, n, depth, n, 0, 3, 1.0, ns, False, tuple(range(n)), "x", spilled)

    full = TreeSnapshot((node(1, 0, 64, 64, "", False), node(2, 1, 70, 134, "v-b", False),
                         node(3, 1, 64, 128, "v-b", True), node(4, 3, 64, 192, "v-b", True),
                         node(5, 1, 64, 128, "v-a", True)), 134, 134, 1000, 1000, 0, 1, "host memory")
    view = for_viewer(full, "v-a")
    hidden = {n.node_id: n for n in view.nodes if n.hidden}
    top = next(n.node_id for n in view.nodes if n.namespace == "")  # the shared node, under the viewer's id
    assert set(hidden) == {-1 - top, HIDDEN_SPILLED_BASE - top}
    assert hidden[-1 - top].num_tokens == hidden[HIDDEN_SPILLED_BASE - top].num_tokens == HIDDEN_BUCKET_TOKENS
    assert hidden[HIDDEN_SPILLED_BASE - top].spilled and not hidden[-1 - top].spilled
    assert all(n.text == "" and n.hits == 0 and n.token_ids == () and n.parent_id == top for n in hidden.values())
    assert next(n for n in view.nodes if n.namespace == "v-a").spilled
    assert view.num_tokens == 64 + HIDDEN_BUCKET_TOKENS and view.tier_kind == "host memory"


def test_after_a_restart_the_tree_shows_what_the_tier_kept(tiny_runner, tmp_path, caplog, make_engine):
    """The spilled paths persist beside the chunks: a new engine on the same folder draws them
    (as far as the tier still holds their chunks), and a request is then served from them."""
    vocab = len(tiny_runner.text.tokenizer)
    first = rand_ids(21, 2 * C + 7, vocab)
    engine = tier_engine(make_engine, tiny_runner, tmp_path, budget_tokens=1000)
    engine.run(req(first, 1))
    engine.close()  # persists the cache to the tier, with its paths
    again = tier_engine(make_engine, tiny_runner, tmp_path, budget_tokens=1000)
    nodes = spilled(again)
    assert [(n.parent_id, n.token_ids) for n in nodes] == [(0, tuple(first[:2 * C]))]
    m = again.run(req(first + [3], 1))
    assert m.tier_tokens == 2 * C and spilled(again) == []
    again.close()
    (tmp_path_file := next(tmp_path.rglob("spilled-paths.json"))).write_text("{not json")
    for chunk in tmp_path.rglob("*.kv"):  # and a tier that lost its chunks marks nothing either
        chunk.unlink()
    third = tier_engine(make_engine, tiny_runner, tmp_path, budget_tokens=1000)
    assert spilled(third) == [] and "spilled-paths.json" in caplog.text and tmp_path_file.exists()
    third.close()
