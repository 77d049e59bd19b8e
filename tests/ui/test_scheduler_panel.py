"""The scheduler panel draws the engine's real step log, the viewer's requests highlighted."""

from __future__ import annotations

from components.panels.scheduler_panel import scheduler_markdown, timeline_figure
from engine.types import GenerationRequest, SamplingParams
from tests.helpers_app import wait_idle


def test_timeline_from_a_real_batch(tiny_runner, make_engine):
    engine = make_engine(tiny_runner, isolation=True, chunk_tokens=8)
    reqs = [GenerationRequest(prompt_ids=tuple(range(20 + i, 40 + i)), namespace=ns,
                              sampling=SamplingParams(max_new_tokens=4)) for i, ns in enumerate(["v-me", "v-you"])]
    with tiny_runner.lock:
        handles = [engine.submit(r) for r in reqs]
    mine = [list(h)[-1].metrics for h in handles][0]
    steps = engine.step_log()
    fig = timeline_figure(steps, namespace="v-me")
    names = {t.name for t in fig.data}
    assert {"prefill chunk (yours)", "batched decode (yours)"} == names  # others' bars: not drawn (issue 58)
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
    assert by_name == {"batched decode (yours)": ["#1"]}  # others' bars withheld, no one else's id
    assert not any("#2" in t for trace in fig.data for t in trace.hovertext)
    assert all("for ≤4 request(s)" in t for trace in fig.data for t in trace.hovertext)  # batch size: coarse
    assert {t.name: list(t.y) for t in timeline_figure([rec]).data} == {  # a shared engine names them all
        "batched decode": ["#1"], "prefill chunk": ["#2"]}


def test_forwards_of_other_visitors_alone_are_not_shown_in_isolation(tiny_runner, make_engine):
    """A forward without the viewer's requests would tell, for another visitor's request, how many
    prefill chunks and decode tokens it took. In isolation mode the viewer sees the same timeline
    and figures whatever another visitor asked, and however long their answer was."""
    drawn = []
    for prompt_len, new_tokens in ((47, 3), (66, 7)):
        engine = make_engine(tiny_runner, isolation=True, chunk_tokens=8)
        other = engine.run(GenerationRequest(prompt_ids=tuple(range(40, 40 + prompt_len)), namespace="v-you",
                                             sampling=SamplingParams(max_new_tokens=new_tokens)))
        assert other.output_tokens == new_tokens
        wait_idle(engine)  # the figures read "running 0" only once the engine has finished its bookkeeping
        steps = engine.step_log()
        assert steps and not timeline_figure(steps, namespace="v-me").data  # nothing of theirs
        text = scheduler_markdown(engine, steps, "v-me")  # the coarse rate has its own test (below)
        drawn.append([line for line in text.splitlines() if "output tokens/s" not in line])
        assert timeline_figure(steps, None).data  # a shared engine shows everyone's forwards
    assert drawn[0] == drawn[1], drawn


def test_empty_timeline_says_so():
    fig = timeline_figure([])
    assert "No forwards yet" in fig.layout.annotations[0].text


def test_other_visitors_token_counts_are_coarse_in_isolation(tiny_runner, make_engine):
    """The tree's rule on the timeline: a forward that served another visitor shows its token
    counts only in 256-token buckets; the viewer's own forwards alone stay exact."""
    engine = make_engine(tiny_runner, isolation=True, chunk_tokens=8)
    reqs = [GenerationRequest(prompt_ids=tuple(range(30 + i, 67 + i)), namespace=ns,
                              sampling=SamplingParams(max_new_tokens=3)) for i, ns in enumerate(["v-me", "v-you"])]
    with tiny_runner.lock:
        handles = [engine.submit(r) for r in reqs]
    for h in handles:
        list(h)
    alone = engine.run(GenerationRequest(prompt_ids=tuple(range(100, 137)), namespace="v-me",
                                         sampling=SamplingParams(max_new_tokens=2)))
    steps = engine.step_log()
    shared = [r for r in steps if set(r.namespaces) == {"v-me", "v-you"}]
    own = [r for r in steps if set(r.namespaces) == {"v-me"} and alone.request_id in r.request_ids]
    assert shared and own
    texts = [t for trace in timeline_figure(steps, namespace="v-me").data for t in trace.hovertext]
    assert not any(" in step " in t for t in texts)  # the step counter counts everyone's forwards

    def shown(rec) -> list[str]:
        return [t for trace in timeline_figure([rec], namespace="v-me").data for t in trace.hovertext]

    for rec in shared:
        assert shown(rec) and all("≤256 tokens computed" in t for t in shown(rec)), shown(rec)
        assert not any(f"<br>{rec.computed_tokens:,} tokens computed" in t for t in shown(rec))
    for rec in own:
        assert all(f"<br>{rec.computed_tokens:,} tokens computed" in t for t in shown(rec))
    text = scheduler_markdown(engine, steps, "v-me")
    total = sum(r.computed_tokens for r in steps)
    assert "≤256 computed" in text or "≤512 computed" in text
    assert f"| {total:,} computed" not in text
    # Shared mode (isolation off): nothing is private, everything exact.
    assert f"| {total:,} computed" in scheduler_markdown(engine, steps, None)


def test_reserved_kv_of_everyone_is_coarse_in_isolation():
    from types import SimpleNamespace

    from engine.types import EngineStats

    bpt = 46_080
    stats = EngineStats(requests=0, prompt_tokens=0, cached_tokens=0, computed_tokens=0, prefill_ms=0,
                        cache_bytes=0, budget_bytes=2**30,
                        cached_tokens_now=0, num_nodes=0, evicted_tokens=0, queue_depth=0, running_bytes=37 * bpt)
    engine = SimpleNamespace(stats=lambda: stats, info=lambda: SimpleNamespace(kv_bytes_per_token=bpt))
    assert f"| {37 * bpt / 2**20:.1f} MiB of the" in scheduler_markdown(engine, [], None)
    coarse = scheduler_markdown(engine, [], "v-me")
    assert f"≤{256 * bpt / 2**20:.1f} MiB of the" in coarse and f"{37 * bpt / 2**20:.1f} MiB" not in coarse
    assert "1.0 GiB budget" in coarse  # the budget ships with the deployment: exact


def test_everyones_output_rate_is_coarse_in_isolation():
    """One visitor's answer (tens of tokens in the 10 s window) does not move the rate a stranger reads."""
    from types import SimpleNamespace

    from engine.types import EngineStats

    base = dict(requests=0, prompt_tokens=0, cached_tokens=0, computed_tokens=0, prefill_ms=0,
                cache_bytes=0, budget_bytes=2**30, cached_tokens_now=0, num_nodes=0,
                evicted_tokens=0, queue_depth=0)
    shown = {}
    for rate in (0.0, 4.7, 6.6, 9.9):  # idle, then answers of 47, 66 and 99 tokens in the window
        stats = EngineStats(**base, tokens_per_s=rate)
        engine = SimpleNamespace(stats=lambda s=stats: s, info=lambda: SimpleNamespace(kv_bytes_per_token=46_080))
        shown[rate] = scheduler_markdown(engine, [], "v-me")
        assert f"**{rate:.1f}**" in scheduler_markdown(engine, [], None)  # a private deployment: exact
    assert len(set(shown.values())) == 1, shown
