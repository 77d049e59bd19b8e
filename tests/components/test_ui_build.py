"""The dashboard on the tiny random Llama: the Blocks build without launching, panel helpers,
and the few-shot and tree endpoints through a launched app and gradio_client (fast)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import gradio as gr
import pytest

from analysis.no_reuse import run_measured
from components.chat_presets import FEW_SHOT_PRESETS
from components.demo import build_demo
from components.panels.fewshot_panel import parse_examples, shuffled
from components.panels.info_panel import info_markdown
from components.panels.latency_panel import latency_summary
from components.panels.memory_panel import memory_markdown
from components.panels.overview_panel import key_numbers_html
from engine.engine import Engine
from engine.types import GenerationRequest, SamplingParams
from tests.helpers_app import flat_text, launched_app, visitor

API = {"chat", "fewshot", "fewshot_batch", "tree_snapshot"}


@pytest.fixture(scope="module")
def engine(tiny_runner, make_module_engine) -> Engine:
    return make_module_engine(budget_bytes=4000 * tiny_runner.kv_bytes_per_token, max_new_tokens_cap=8)


def api_names(demo) -> set[str]:
    return {fn.api_name for fn in demo.fns.values() if getattr(fn, "api_name", None)
            and getattr(fn, "api_visibility", "public") == "public"}


@pytest.mark.parametrize("isolation", [False, True])
def test_blocks_build_without_launching(isolation, make_engine):
    demo = build_demo(make_engine(isolation=isolation))
    assert API <= api_names(demo)
    # Controls that change the shared engine stay off the public API.
    assert not {"set_budget", "clear_cache", "refresh", "on_select"} & api_names(demo)


def test_parse_examples_takes_any_table_shape():
    rows = [["a", "b"], ["", ""], [None, "x"], ["only input"], "loose", [1, 2, 3]]
    assert parse_examples(rows) == [("a", "b"), ("", "x"), ("only input", ""), ("loose", ""), ("1", "2")]
    assert parse_examples({"headers": ["Input", "Output"], "data": [["q", "a"]]}) == [("q", "a")]
    assert parse_examples(None) == parse_examples(42) == parse_examples({"data": None}) == []
    assert len(parse_examples([["x", "y"]] * 500)) == 64


def test_shuffle_always_changes_the_order_when_it_can():
    examples = list(FEW_SHOT_PRESETS["Sentiment"]["examples"])
    rng = random.Random(0)
    for _ in range(20):
        out = shuffled(examples, rng)
        assert out != examples and sorted(out) == sorted(examples)
    assert shuffled([("a", "b")] * 3, rng) == [("a", "b")] * 3


def test_panel_text_reports_real_numbers(engine):
    m = run_measured(engine, GenerationRequest(prompt="a shared prefix of some length", measure_baseline=True,
                                               sampling=SamplingParams(max_new_tokens=2)))
    m2 = run_measured(engine, GenerationRequest(prompt="a shared prefix of some length, twice",
                                                measure_baseline=True, sampling=SamplingParams(max_new_tokens=2)))
    assert m2.cached_tokens > 0
    html = key_numbers_html(engine, m2, "")
    assert f"{m2.cached_tokens:,} of {m2.prompt_tokens:,} tokens" in html
    assert "token hit rate" in html and "<script" not in html
    assert f"**{engine.stats().cached_tokens_now:,}**" in memory_markdown(engine)
    assert f"{engine.info().kv_bytes_per_token:,} bytes" in info_markdown(engine)  # the tiny model's own
    assert "**2 measured requests**" in latency_summary([m, m2])


def tree_paths(snapshot: dict) -> list[str]:
    """Text from the root to every leaf of a ``tree_snapshot`` answer."""
    nodes = {n["node_id"]: n for n in snapshot["nodes"]}
    parents = {n["parent_id"] for n in snapshot["nodes"]}
    out = []
    for n in snapshot["nodes"]:
        if n["node_id"] in parents:
            continue
        parts, cur = [], n
        while cur is not None:
            parts.append(cur["text"] or "")
            cur = nodes.get(cur["parent_id"])
        out.append("".join(reversed(parts)))
    return out


def test_fewshot_endpoints_and_tree_snapshot_through_the_app(engine):
    preset = FEW_SHOT_PRESETS["Translation (EN→FR)"]
    table = {"headers": ["Input", "Output"], "data": [list(e) for e in preset["examples"]]}
    with launched_app(engine) as url:
        client = visitor(url)
        answer, tokens, numbers = client.predict(preset["instruction"], table, "Good night.", False, 4, True,
                                                 api_name="/fewshot")
        assert "prompt tokens served from the cache" in numbers
        assert {t["class_or_confidence"] for t in tokens} <= {"cached", "computed"}
        job = client.submit(preset["instruction"], table, "Hello.\nGoodbye.", 3, False, 4, False,
                            api_name="/fewshot_batch")
        outputs = list(job)
        summary, chart, rows = job.result()
        assert len(outputs) >= 4  # progress streamed request by request
        assert summary.startswith("**3 requests:")
        assert [r[1] for r in rows["data"]] == ["Hello.", "Goodbye.", "Hello."]
        cached = [int(r[3].split("/")[0].replace(",", "")) for r in rows["data"]]
        assert cached[1] > 0 and cached[2] > cached[1]  # the examples, then the whole repeated prompt
        snap = client.predict(api_name="/tree_snapshot")
    ids = {n["node_id"] for n in snap["nodes"]}
    assert all(n["parent_id"] in ids | {0} for n in snap["nodes"])
    assert sum(n["num_tokens"] for n in snap["nodes"]) == snap["num_tokens"] == engine.snapshot().num_tokens
    paths = tree_paths(snap)
    for query in ("Good night.", "Hello.", "Goodbye."):
        assert any(preset["instruction"] in p and f"Input: {query}" in p for p in paths), query


def test_chat_history_is_per_visitor(engine):
    with launched_app(engine) as url:
        a, b = visitor(url), visitor(url)
        out_a = a.predict("Hello from A", [], "Pirate", "", 2, False, api_name="/chat")
        out_b = b.predict("Hello from B", [], "Pirate", "", 2, False, api_name="/chat")
        assert [flat_text(m["content"]) for m in out_a[0] if m["role"] == "user"] == ["Hello from A"]
        assert [flat_text(m["content"]) for m in out_b[0] if m["role"] == "user"] == ["Hello from B"]


def test_a_handler_sees_only_its_own_namespace_in_isolation(make_engine):
    from components.panels.tree_panel import tree_figure_for
    from components.session import visitor_namespace

    iso = make_engine(isolation=True, max_new_tokens_cap=4)
    a, b = SimpleNamespace(session_hash="a"), SimpleNamespace(session_hash="b")
    iso.run(GenerationRequest(prompt="secret of visitor a", namespace=visitor_namespace(a, iso)))
    fig_b = tree_figure_for(iso, b, None)
    hovers = " ".join(h for t in fig_b.data for h in (t.hovertext or ()))
    assert "secret" not in hovers and "another visitor" in hovers
    fig_a = tree_figure_for(iso, a, None)
    assert "secret" in " ".join(h for t in fig_a.data for h in (t.hovertext or ()))


def test_a_failing_refresh_keeps_the_picture_and_shows_no_error():
    from components.panels.live import _quiet

    def broken(seen, request=None):
        raise RuntimeError("boom")

    out = _quiet(broken, 2)(None)
    assert out == (gr.skip(), gr.skip())


def test_absurd_slider_values_are_clamped(engine):
    from components.panels.chat_panel import build_request, clamp_int

    assert [clamp_int(v, 7, 1, 10) for v in (None, "x", float("nan"), -5, 1e12, "3", 4.9)] == [7, 7, 7, 1, 10, 3, 4]
    req = build_request(engine, [{"role": "user", "content": "hi"}], float("inf"), "yes", None, tag="t")
    assert req.sampling.max_new_tokens == engine.max_new_tokens_cap


def test_the_memory_tab_shows_the_tiers_unwritten_spills_beside_the_budget(tiny_runner, tmp_path, make_engine):
    """Evicted KV waiting to be written to disk is held outside the pool's budget: the tab says how much,
    and its bound."""
    from engine.types import GenerationRequest, SamplingParams

    engine = make_engine(budget_bytes=300 * tiny_runner.kv_bytes_per_token, tier_bytes=2**24,
                         tier_dir=str(tmp_path))
    engine.run(GenerationRequest(prompt_ids=tuple(range(100, 260)), sampling=SamplingParams(max_new_tokens=2)))
    stats = engine.stats()
    assert stats.tier_queue_bound_bytes > 0 and stats.tier_queued_bytes == 0  # written after each eviction
    assert "spills waiting to be written 0 B (at most" in memory_markdown(engine)


def test_another_visitors_timing_buffer_shows_only_coarse_in_isolation(tiny_runner, make_engine):
    """The paired timing's scratch buffer is exactly one visitor's prompt: on a public deployment the
    memory tab shows it only in the tree's 256-token buckets, so a stranger reading it cannot tell a
    47-token prompt from a 66-token one; a private deployment shows the exact bytes."""
    from analysis.prefill_timing import timer_for
    from components.views.format import fmt_bytes
    from engine.snapshot_view import HIDDEN_BUCKET_TOKENS

    bpt = tiny_runner.kv_bytes_per_token
    for isolation in (True, False):
        engine = make_engine(isolation=isolation)
        timer, shown = timer_for(engine), []
        for prompt_tokens in (47, 66):
            with timer._scratch(prompt_tokens):  # what a visitor's no-reuse timing holds while it runs
                shown.append(memory_markdown(engine, [], "v-stranger" if isolation else None))
                exact = f"timing scratch buffers {fmt_bytes(prompt_tokens * bpt)} "
                assert (exact in shown[-1]) != isolation, shown[-1]
        if isolation:
            assert shown[0] == shown[1]
            assert f"timing scratch buffers ≤{fmt_bytes(HIDDEN_BUCKET_TOKENS * bpt)} " in shown[0]
