"""The seven holes of issue 58, each replayed as two strangers on a public deployment would (the
tiny random Llama in isolation mode, visitors told apart by address): what visitor A does must
not show in what visitor B reads, and one address must not lock the others out. Each test
failed before its fix (docs/SECURITY.md lists them)."""

from __future__ import annotations

import json
import logging
import os

import httpx
import pytest

from analysis.prefill_timing import PrefillTimer, TimingPolicy
from components.chat_presets import DEFAULT_SYSTEM
from engine.engine import Engine
from engine.types import GenerationRequest, SamplingParams
from tests.engines import rand_ids
from tests.helpers_app import assert_clean, free_port, wait_idle

A_NS, B_NS = "v-aaaa/s-1", "v-bbbb/s-1"


def _run(engine: Engine, ids: list[int], namespace: str, public_len: int = 0):
    req = GenerationRequest(prompt_ids=tuple(ids), sampling=SamplingParams(max_new_tokens=2), public_len=public_len,
                            namespace=namespace)
    m = engine.run(req)
    return engine.cache_key(ids, req), m.cached_tokens


# ------------------------------------------------------------------ 1. the no-reuse timing memo
def test_1_no_reuse_memo_is_never_read_by_another_visitor(tiny_runner, make_engine):
    """A times a prompt under a shipped prefix; B sends another prompt of the same length under
    the same prefix: B's no-reuse figure is measured for B, never A's (length, time, runs)."""
    engine = make_engine(tiny_runner, isolation=True, budget_bytes=4000 * tiny_runner.kv_bytes_per_token)
    vocab = len(tiny_runner.text.tokenizer)
    shipped = rand_ids(9, 100, vocab)
    timer = PrefillTimer(engine, TimingPolicy(pairs=1, reuse_runs=1, memo_min_tokens=64, block_tokens=1024))
    _run(engine, shipped + rand_ids(20, 5, vocab), A_NS, public_len=100)  # the shipped prefix is cached
    key_a, cached_a = _run(engine, shipped + rand_ids(10, 12, vocab), A_NS, public_len=100)
    first = timer.time_pairs(key_a, cached_a)
    assert first.full_ms is not None and not first.full_from_memo
    key_b, cached_b = _run(engine, shipped + rand_ids(11, 12, vocab), B_NS, public_len=100)  # same length
    seen_by_b = timer.time_pairs(key_b, cached_b)
    assert not seen_by_b.full_from_memo and seen_by_b.full_measured_at != first.full_measured_at
    # A's own next prompt of that length still uses A's memo entry (the memo keeps its purpose).
    key_a2, cached_a2 = _run(engine, shipped + rand_ids(12, 12, vocab), A_NS, public_len=100)
    assert timer.time_pairs(key_a2, cached_a2).full_from_memo


@pytest.fixture(scope="module")
def public_app(tiny_runner, make_module_engine):
    """The app as a Space runs it: isolation, visitors told apart by ``X-Forwarded-For``."""
    old = os.environ.get("SYSTEM")
    os.environ["SYSTEM"] = "spaces"
    import app
    from components.demo import launch_kwargs

    engine = make_module_engine(tiny_runner, isolation=True, max_new_tokens_cap=2, max_queue=8)
    demo = app.build_app(engine, 8)
    try:
        demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=free_port(), quiet=True,
                    **launch_kwargs(app.app_kwargs(engine)))
        try:
            yield demo.local_url, engine, demo
        finally:
            demo.close()
        wait_idle(engine)
        assert_clean(engine)
    finally:
        if old is None:
            os.environ.pop("SYSTEM", None)
        else:
            os.environ["SYSTEM"] = old


def _from(address: str) -> dict:
    return {"x-forwarded-for": address}


def _call_chat(client: httpx.Client, address: str, text: str) -> httpx.Response:
    return client.post("gradio_api/call/chat", headers=_from(address),
                       json={"data": [text, [], DEFAULT_SYSTEM, "", 2, False]})


# ------------------------------------------------------------------ 2. one address fills the page's queue
def test_2_one_address_cannot_lock_the_others_out_of_the_page_queue(public_app):
    """While the queue dispatches nothing (every worker busy), one address posts 40 chat events:
    past its share it is told how many it already has waiting; another address still gets in,
    and its event waits ahead of the flooder's later ones (turns by address)."""
    from server.page_queue import origin_of_event, share_of

    url, engine, demo = public_app
    share = share_of(8)
    demo_queue = demo._queue
    fair_dispatch = demo_queue.get_events
    demo_queue.get_events = lambda: None  # the dispatcher takes nothing while the flood arrives
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            statuses = [_call_chat(client, "203.0.113.7", f"flood {i}") for i in range(40)]
            accepted = [r for r in statuses if r.status_code == 200]
            refused = [r for r in statuses if r.status_code != 200]
            assert len(accepted) == share, [r.status_code for r in statuses]
            assert all(r.status_code == 503 for r in refused)
            assert f"you already have {share} requests waiting" in refused[0].json()["detail"].lower()
            other = _call_chat(client, "198.51.100.20", "my own question")
            assert other.status_code == 200, other.text
            waiting = [e for q in demo_queue.event_queue_per_concurrency_id.values() for e in q.queue]
            order = [origin_of_event(e) for e in waiting]
            assert order.index("198.51.100.20") == 1, order  # after the flooder's first, before its second
    finally:
        demo_queue.get_events = fair_dispatch
    with httpx.Client(base_url=url, timeout=120) as client:
        event_id = other.json()["event_id"]
        stream = client.get(f"gradio_api/call/chat/{event_id}", headers=_from("198.51.100.20")).text
    assert "event: complete" in stream, stream[-400:]
    wait_idle(engine)


# ------------------------------------------------------------------ 4. echo with a lone surrogate
def test_4_echo_of_a_lone_surrogate_is_answered_and_the_connection_stays_usable(public_app, caplog):
    url = public_app[0]
    body = '{"prompt":"\\ud800 lone","max_tokens":2,"echo":true,"logprobs":1}'
    with httpx.Client(base_url=url, timeout=60) as client, caplog.at_level(logging.INFO):
        r = client.post("v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code in (200, 400), r.text
        if r.status_code == 200:
            assert json.loads(r.text)["choices"][0]["text"].startswith("\ud800 lone")
        else:
            assert "\n" not in r.json()["error"]["message"]
        again = client.post("v1/completions", json={"prompt": "Hello", "max_tokens": 2})  # same connection
        assert again.status_code == 200, again.text
    assert "Traceback" not in caplog.text and "UnicodeEncodeError" not in caplog.text


# ------------------------------------------------------------------ 3. the Scheduler tab's "others" bars
def test_3_scheduler_tab_shows_nothing_of_another_visitors_forwards(tiny_runner, make_engine):
    """B streams while A's long prompt and 7-token answer share B's forwards: B's timeline has B's
    own bars only, and the batch size of a shared forward is coarse (it would count A's chunks)."""
    from components.panels.scheduler_panel import timeline_figure

    engine = make_engine(tiny_runner, isolation=True, chunk_tokens=8)
    reqs = [GenerationRequest(prompt_ids=tuple(range(30, 50)), namespace=B_NS,
                              sampling=SamplingParams(max_new_tokens=6)),
            GenerationRequest(prompt_ids=tuple(range(60, 126)), namespace=A_NS,
                              sampling=SamplingParams(max_new_tokens=7))]
    with tiny_runner.lock:
        handles = [engine.submit(r) for r in reqs]
    mine = [list(h)[-1].metrics for h in handles][0]
    steps = engine.step_log()
    assert any(A_NS in r.namespaces and B_NS in r.namespaces for r in steps)  # they did share forwards
    fig = timeline_figure(steps, namespace=B_NS)
    bars = [(y, t) for trace in fig.data for y, t in zip(trace.y, trace.hovertext, strict=True)]
    assert {y for y, _ in bars} == {f"#{mine.request_id}"}
    assert len(bars) == sum(mine.request_id in r.request_ids for r in steps)
    assert not any("another visitor" in t or "for 2 request(s)" in t for _, t in bars)


# ------------------------------------------------------------------ 5. the Cache memory tab's bytes
def test_5_cache_memory_chart_does_not_count_another_visitors_tokens(tiny_runner, make_engine):
    """Between B's two requests A caches a 47- or a 66-token prompt: B's hit-rate chart (its cache
    line is everyone's KV) reads the same either way on a public deployment."""
    from components.panels.common import audience_of
    from components.views.charts import hit_rate_figure

    drawn = []
    for a_len in (47, 66):
        engine = make_engine(tiny_runner, isolation=True)
        sp = SamplingParams(max_new_tokens=2)
        engine.run(GenerationRequest(prompt_ids=tuple(range(30, 50)), namespace=B_NS, sampling=sp))
        engine.run(GenerationRequest(prompt_ids=tuple(range(100, 100 + a_len)), namespace=A_NS, sampling=sp))
        engine.run(GenerationRequest(prompt_ids=tuple(range(30, 56)), namespace=B_NS, sampling=sp))
        mine = [m for m in engine.recent() if m.namespace == B_NS]
        fig = hit_rate_figure(mine, audience=audience_of(engine))
        drawn.append([tr.y for tr in fig.data if tr.name.startswith("cache MiB")])
    assert drawn[0] == drawn[1], drawn


# ------------------------------------------------------------------ 6. the Fleet tab's server-wide figures
def _fleet(others_tokens: int, others_hits: float, others_running: float, others_landed: int):
    from engine.types import FleetRequest, FleetView, ReplicaView, TreeSnapshot

    empty = TreeSnapshot((), 0, 0, 0, 0, 0, 0, origin="events")
    replicas = tuple(ReplicaView(f"http://127.0.0.1:800{i}", empty, 32, (64 + others_tokens) // 32,
                                 64 + others_tokens, True, 1 + others_landed, others_hits, others_running)
                     for i in range(2))
    mine = (FleetRequest(1, 70, 0, "gained", 0, 0, 0, None, namespace=B_NS),)  # B's own request only
    held = 2 * (64 + others_tokens)
    return FleetView(replicas, mine, held, held - 64, 64, 64, 512.0, 64 * 512)


def test_6_fleet_tab_shows_a_stranger_no_exact_server_wide_figure():
    """Another visitor's requests (more tokens held, another hit rate, one more running and
    landed) do not change what B reads of the fleet on a public deployment; "of yours" counts
    B's own requests, not everyone's."""
    from components.views.fleet_tables import duplication_line, landed_of, replica_title, replicas_table
    from engine.visibility import Audience

    public = Audience(public=True, bytes_per_token=512)
    read = []
    for fleet in (_fleet(32, 0.25, 1.0, 0), _fleet(60, 0.75, 2.0, 5)):
        yours = landed_of(fleet)
        read.append([replica_title(i, r, public, yours[i]) for i, r in enumerate(fleet.replicas)]
                    + [replicas_table(fleet, public, yours), duplication_line(fleet, public)])
    assert read[0] == read[1], read
    assert "1 of yours landed here" in read[0][0] and "0 of yours landed here" in read[0][1]
    assert "hit rate not shown" in read[0][0]


# ------------------------------------------------------------------ 7. request ids, and the fair share
def test_7_request_ids_do_not_count_other_visitors_requests(tiny_runner, make_engine):
    engine = make_engine(tiny_runner, isolation=True)
    sp = SamplingParams(max_new_tokens=1)
    before = engine.run(GenerationRequest(prompt_ids=(5, 6, 7), namespace=B_NS, sampling=sp)).request_id
    for i in range(5):  # A's requests between two of B's
        engine.run(GenerationRequest(prompt_ids=(8, 9, 10 + i), namespace=A_NS, sampling=sp))
    after = engine.run(GenerationRequest(prompt_ids=(5, 6, 8), namespace=B_NS, sampling=sp)).request_id
    ids = [m.request_id for m in engine.recent()]
    assert len(set(ids)) == len(ids) == 7
    assert abs(after - before) > 2**20 or after - before not in range(1, 8)  # no gap to read
    assert min(ids) >= 2**47  # never a small count


def _b_keeps_after_a_asks(make_engine, tiny_runner, a_len: int) -> int:
    """B fills the cache over its share with 24-token prompts; A (a newcomer) asks ``a_len``
    tokens; how many of B's prompt tokens are still cached, as B's next ``cached_tokens`` say."""
    from engine.types import CacheKey

    engine = make_engine(tiny_runner, isolation=True, budget_bytes=1200 * tiny_runner.kv_bytes_per_token)
    sp = SamplingParams(max_new_tokens=1)
    capacity = engine.cache.pool.capacity
    prompts = []
    i = 0
    while engine.stats().cached_tokens_now + 30 < capacity:
        ids = (1000 + i,) + tuple(range(2000 + 30 * i, 2000 + 30 * i + 23))
        engine.run(GenerationRequest(prompt_ids=ids, namespace=B_NS, sampling=sp))
        prompts.append(ids)
        i += 1
    engine.run(GenerationRequest(prompt_ids=tuple(range(5000, 5000 + a_len)), namespace=A_NS, sampling=sp))
    return sum(engine.cache.match_len(CacheKey(p, B_NS)) for p in prompts)


def test_7_a_visitor_over_its_share_reads_a_newcomers_length_only_in_buckets(tiny_runner, make_engine):
    """What B still finds cached after A's question (the room came from B, over its share) is the
    same for a 47- and a 66-token question: whole buckets went, never exactly A's tokens."""
    kept = [_b_keeps_after_a_asks(make_engine, tiny_runner, n) for n in (47, 66)]
    assert kept[0] == kept[1], kept



def test_2_one_address_cannot_take_every_running_place_of_a_function():
    """Of a function's 16 running places one address holds at most 12: with 12 of the flooder's
    running and more of theirs waiting first, the dispatcher starts the other address's event."""
    from types import SimpleNamespace

    from server.page_queue import fair_get_events, running_cap

    def event(address: str):
        request = SimpleNamespace(headers={}, client=SimpleNamespace(host=address))
        return SimpleNamespace(request=request, concurrency_id="chat", fn=SimpleNamespace(batch=False))

    assert running_cap(16) == 12
    running = [[event("203.0.113.7")] for _ in range(12)]
    waiting = [event("203.0.113.7") for _ in range(3)] + [event("198.51.100.20")]
    chat = SimpleNamespace(queue=list(waiting), concurrency_limit=16, current_concurrency=12)
    queue = SimpleNamespace(active_jobs=running + [None] * 4, event_queue_per_concurrency_id={"chat": chat})
    events, batch, cid = fair_get_events(queue)
    assert events == [waiting[3]] and not batch and cid == "chat"
    running.append([waiting[3]])
    queue.active_jobs = running + [None] * 3
    chat.current_concurrency = 13
    assert fair_get_events(queue) is None  # the flooder's next waits: its 12 places are taken
