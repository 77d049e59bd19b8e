"""The ordering-lab tab: pure figure and text builders on real (tiny-model) results, and
the tab launched alone, driven by gradio_client through its ``ordering_lab`` and
``ordering_schedule`` endpoints."""

from __future__ import annotations

import re

import gradio as gr
import pytest

from analysis.lab.ordering_runs import run_lab_to_end
from components.lab_presets import CUSTOM_TEMPLATE, CUSTOM_VALUES, PRESETS
from components.panels.lab.tab import build_ordering_lab, cost_view, custom_variants, granularity_rows
from components.views.format import ratio_words
from components.views.lab import figures as figs
from components.views.lab import markdown as views
from engine.engine import Engine
from engine.types import EngineError
from tests.helpers_app import free_port, wait_idle


@pytest.fixture(scope="module")
def engine(make_module_engine) -> Engine:
    return make_module_engine()


@pytest.fixture(scope="module")
def results(engine):
    return run_lab_to_end(engine, PRESETS["RAG: documents vs question"].variants(3), measure_baseline=True)


def test_figures_are_pure_functions_of_results(results):
    summary = figs.prefill_summary_figure(results)
    assert [t.name for t in summary.data] == ["without reuse (measured)", "with the radix cache"]
    assert any(w in summary.layout.title.text for w in ("slower", "faster", "about the same"))
    per_request = figs.per_request_figure(results)
    assert len(per_request.data) == 4  # cached + computed, per ordering
    assert list(per_request.data[0].y) == [q.cached_tokens for q in results[0].requests]
    trees = figs.trees_figure(results)
    drawn = sum(len(t.x) for t in trees.data if t.type == "bar")
    assert drawn == sum(len(r.tree) for r in results)
    assert figs.granularity_figure(granularity_rows(results)).data
    good_reuse = figs.reuse_counts(results[0])
    assert max(good_reuse.values()) == len(results[0].requests) - 1  # the shared trunk served every later one
    assert all(v >= 0 for v in figs.reuse_counts(results[1]).values())
    for empty in (figs.prefill_summary_figure([]), figs.per_request_figure([]), figs.trees_figure([]),
                  figs.schedule_figure([]), figs.granularity_figure([])):
        assert empty.layout.annotations  # a friendly placeholder, not an error


def test_tree_rows_put_parents_between_children():
    from engine.types import NodeInfo

    def node(i, parent, depth, n=5):
        return NodeInfo(i, parent, n, depth, 0, 0, 0, 0.0, "ns", False, (), "")

    rows = figs.tree_rows([node(1, 0, 10, 10), node(2, 1, 15), node(3, 1, 15), node(4, 0, 5)])
    assert rows[2] == (0.0, 1) and rows[3] == (1.0, 1) and rows[1] == (0.5, 2) and rows[4] == (2.0, 1)


def test_text_views(results):
    head = views.headline_markdown(results)
    assert ("×" in head or "about the same speed" in head) and "Bad ordering" in head and " the good ordering (" in head
    table = views.results_table(results)
    assert len(table) == 6 and table[0][3] == 0
    data = views.results_json(results, "t")
    assert data["variants"][0]["hit_rate"] > data["variants"][1]["hit_rate"]
    choice = views.default_explainer_choice(results)
    assert choice.startswith("1:") and choice != "1:0"  # the bad ordering, past its cold start
    rows = granularity_rows(results)
    note = views.granularity_markdown(rows, [[q.cached_tokens for q in r.requests] for r in results])
    assert "simulation" in note.lower() and "reproduces the engine" in note
    cost = cost_view(results, 2.5, 0.5, 1024, 128, 4)
    assert "Estimate" in cost and "$" in cost
    assert "⚠️" in cost_view(results, 2.5, 3, 1024, 128, 4)


def test_custom_variants():
    mine, suggested = custom_variants(CUSTOM_TEMPLATE, "", CUSTOM_VALUES)
    assert len(mine.prompts) == 6 and suggested.name == "Suggested order"
    assert suggested.prompts[0].prompt.startswith("You are the assistant")
    assert len(custom_variants("A {x} B", "B A {x}", '{"x": 1}\n{"x": 2}')) == 2
    for bad in (("{x}", "", '{"x": 1}'), ("{x}", "", "not json"), ("{y}", "", '{"x": 1}\n{"x": 2}')):
        with pytest.raises(EngineError):
            custom_variants(*bad)


def test_tab_runs_through_gradio_client(engine):
    from gradio_client import Client

    with gr.Blocks() as demo:
        build_ordering_lab(engine)
    demo.queue()
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=free_port(), quiet=True)
    try:
        client = Client(demo.local_url, verbose=False, download_files=False)
        job = client.submit("Tool list placement", 3, 1, True, api_name="/ordering_lab")
        streamed = list(job)
        out = job.result()
        assert len(streamed) >= 3  # progress was streamed before the final result
        data = next(o for o in out if isinstance(o, dict) and "variants" in o)
        good, bad = data["variants"]
        assert good["requests"] == bad["requests"] == 3
        assert good["hit_rate"] > bad["hit_rate"]
        assert good["baseline_total_ms"] is not None
        assert "slower" in out[0] or "faster" in out[0]
        sched = client.predict(2, 2, 520, api_name="/ordering_schedule")
        assert "longest-prefix-match first" in sched[0]
        wait_idle(engine)
        engine.check_invariants()
        assert engine.cache.locked_tokens() == 0
    finally:
        demo.close()


def test_template_headline_names_both_orderings_the_right_way_round(engine):
    """Issue 15 item 2: "Other order ordering: prefill 0.6× faster" said it backwards."""
    results = run_lab_to_end(engine, custom_variants(CUSTOM_TEMPLATE, "", CUSTOM_VALUES), measure_baseline=False)
    mine, suggested = results
    head = views.headline_markdown(results, title="Your template against the suggested order")
    assert "## Suggested order: prefill" in head and " your template (" in head and "ordering:" not in head
    assert ratio_words(mine.total_prefill_ms, suggested.total_prefill_ms) in head
    assert all(float(r) >= 1 for r in re.findall(r"(\d+\.\d)×", head))  # never "0.6× faster"
    assert "Suggested order" in figs.prefill_summary_figure(results).layout.title.text
