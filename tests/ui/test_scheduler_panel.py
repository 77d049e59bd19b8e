"""The scheduler panel draws the engine's real step log, the viewer's requests highlighted."""

from __future__ import annotations

from components.scheduler_panel import scheduler_markdown, timeline_figure
from engine.engine import Engine
from engine.types import GenerationRequest, SamplingParams


def test_timeline_from_a_real_batch(tiny_runner):
    engine = Engine(tiny_runner, isolation=True, chunk_tokens=8)
    reqs = [GenerationRequest(prompt_ids=tuple(range(20 + i, 40 + i)), namespace=ns,
                              sampling=SamplingParams(max_new_tokens=4)) for i, ns in enumerate(["v-me", "v-you"])]
    with tiny_runner.lock:
        handles = [engine.submit(r) for r in reqs]
    mine = [list(h)[-1].metrics for h in handles][0]
    steps = engine.step_log()
    fig = timeline_figure(steps, namespace="v-me")
    names = {t.name for t in fig.data}
    assert {"prefill chunk (yours)", "batched decode (yours)", "prefill chunk", "batched decode"} <= names
    yours = [t for t in fig.data if t.name.endswith("(yours)")]
    assert all(set(t.y) == {f"#{mine.request_id}"} for t in yours)
    assert all(t.marker.opacity == 1.0 for t in yours)
    # Shared engine: the viewer's last request is theirs.
    fig2 = timeline_figure(steps, None, {mine.request_id})
    assert {t.name for t in fig2.data if t.name.endswith("(yours)")}
    text = scheduler_markdown(engine, steps)
    assert "requests running" in text and "output tokens/s" in text


def test_mixed_forward_colours_each_request_by_its_work():
    from engine.types import StepRecord

    rec = StepRecord(step_id=3, kind="mixed", request_ids=(1, 2), namespaces=("v-a", "v-b"), batch_size=2,
                     computed_tokens=17, cached_tokens=40, duration_ms=80.0, finished_at=100.0,
                     prefill_request_ids=(2,))
    fig = timeline_figure([rec], namespace="v-a")
    by_name = {t.name: list(t.y) for t in fig.data}
    assert by_name == {"batched decode (yours)": ["#1"], "prefill chunk": ["#2"]}


def test_empty_timeline_says_so():
    fig = timeline_figure([])
    assert "No forwards yet" in fig.layout.annotations[0].text
