"""The OpenAI-compatible API, tested with the official ``openai`` client against the app served on
loopback (same port as the page): chat and completions, streaming and not, cached tokens that
grow on a repeated prefix, cache salts, stop strings, OpenAI-shaped errors, a full queue, and a
client that goes away mid-stream."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from engine.engine import Engine
from engine.types import PUBLIC, EngineBusy, GenerationRequest, SamplingParams
from server.cache_scope import api_visitor
from server.openai_protocol import StopMatcher
from tests.helpers_app import assert_clean, launched_app, wait_idle

SYSTEM = "You are a careful assistant who answers questions about prefix caching in one short sentence. " * 3


served = launched_app  # the app as ``python app.py`` serves it: page, API and metrics on one port


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def shared(make_module_engine):
    """One engine with isolation off (local use) and its served app."""
    engine = make_module_engine(budget_bytes=64 * 2**20, max_new_tokens_cap=64)
    with served(engine) as url:
        yield engine, url, engine.info().model_name


def chat(c: openai.OpenAI, model: str, question: str, **kw):
    return c.chat.completions.create(model=model, messages=[{"role": "system", "content": SYSTEM},
                                                            {"role": "user", "content": question}],
                                     max_tokens=kw.pop("max_tokens", 6), temperature=0, **kw)


def test_chat_reports_cached_tokens_growing_on_a_repeated_prefix(shared):
    engine, url, model = shared
    c = client(url)
    assert [m.id for m in c.models.list().data] == [model]
    first = chat(c, model, "What is a radix tree?")
    second = chat(c, model, "What is a KV cache?")
    again = chat(c, model, "What is a KV cache?")
    assert first.object == "chat.completion" and first.choices[0].message.role == "assistant"
    assert first.usage.completion_tokens == 6 and first.choices[0].finish_reason == "length"
    assert second.usage.prompt_tokens_details.cached_tokens >= 50  # the system prompt
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens_details.cached_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert again.choices[0].message.content == second.choices[0].message.content  # reuse changes no answer
    m = engine.recent()[-1]  # the same engine as the page: it shows in the live tree and charts
    assert m.tag == "api" and m.cached_tokens == again.usage.prompt_tokens_details.cached_tokens
    assert any(n.token_ids for n in engine.snapshot().nodes)


def test_streaming_matches_the_plain_answer_and_ends_with_usage(shared):
    engine, url, model = shared
    c = client(url)
    plain = chat(c, model, "Stream this please.", max_tokens=12)
    chunks = list(chat(c, model, "Stream this please.", max_tokens=12, stream=True,
                       stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == plain.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == plain.usage.prompt_tokens - 1
    no_usage = list(chat(c, model, "Stream this please.", max_tokens=3, stream=True))
    assert all(ch.usage is None for ch in no_usage)


def test_completions_take_text_or_token_ids(shared):
    engine, url, model = shared
    c = client(url)
    by_text = c.completions.create(model=model, prompt="The radix tree keeps", max_tokens=5, temperature=0)
    ids = engine.encode("The radix tree keeps")
    by_ids = c.completions.create(model=model, prompt=ids, max_tokens=5, temperature=0)
    assert by_text.object == "text_completion"
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.usage.prompt_tokens_details.cached_tokens == len(ids) - 1
    streamed = c.completions.create(model=model, prompt="The radix tree keeps", max_tokens=5, temperature=0,
                                    stream=True, stream_options={"include_usage": True})
    parts = list(streamed)
    assert "".join(p.choices[0].text for p in parts if p.choices) == by_text.choices[0].text
    assert parts[-1].usage.prompt_tokens_details.cached_tokens == len(ids) - 1


def test_stop_strings_cut_the_text_and_end_the_request(shared):
    engine, url, model = shared
    c = client(url)
    full = c.completions.create(model=model, prompt="Hello world", max_tokens=12, temperature=0).choices[0].text
    stop = full[len(full) // 2:][:3]
    assert stop.strip(), full
    cut = full[: full.index(stop)]
    done = c.completions.create(model=model, prompt="Hello world", max_tokens=12, temperature=0, stop=[stop])
    assert done.choices[0].text == cut and done.choices[0].finish_reason == "stop"
    parts = list(c.completions.create(model=model, prompt="Hello world", max_tokens=12, temperature=0, stop=stop,
                                      stream=True))
    assert "".join(p.choices[0].text for p in parts) == cut
    assert parts[-1].choices[0].finish_reason == "stop"


def test_stop_matcher_holds_back_a_possible_start():
    m = StopMatcher(("END",))
    assert m.visible("abc E") == "abc "
    assert m.visible("abc EN") == "abc "
    assert m.visible("abc ENx") == "abc ENx"
    assert m.visible("abc ENx END more") == "abc ENx " and m.stopped
    assert StopMatcher(()).visible("x") == "x"


def test_cache_salts_share_within_a_salt_only(shared):
    engine, url, model = shared
    c = client(url)
    question = "Which salts share?"
    a1 = chat(c, model, question, extra_body={"cache_salt": "team-a"})
    a2 = chat(c, model, question, extra_body={"cache_salt": "team-a"})
    b1 = chat(c, model, question, extra_body={"cache_salt": "team-b"})
    assert a1.usage.prompt_tokens_details.cached_tokens == 0
    assert a2.usage.prompt_tokens_details.cached_tokens == a2.usage.prompt_tokens - 1
    assert b1.usage.prompt_tokens_details.cached_tokens == 0  # a different salt never shares
    salted = engine.recent()[-1].namespace
    assert salted.startswith("salt-") and "team" not in salted and salted != PUBLIC
    # No salt: shared with everyone (isolation is off), but not with the salted requests.
    assert chat(c, model, question).usage.prompt_tokens_details.cached_tokens < a2.usage.prompt_tokens - 1
    assert engine.recent()[-1].namespace == PUBLIC


def test_without_a_salt_an_isolated_server_shares_nothing(make_engine):
    engine = make_engine(budget_bytes=16 * 2**20, isolation=True, max_new_tokens_cap=8)
    other = make_engine(isolation=True)
    names = [e.namespace_for(api_visitor("", s)) for e, s in ((engine, None), (engine, None), (engine, "x"),
                                                              (engine, "x"), (other, "x"))]
    assert names[0] != names[1] and names[2] == names[3] == names[4]  # one secret per process
    other.close()
    with served(engine) as url:
        c, model = client(url), engine.info().model_name
        first, second = chat(c, model, "Private?", max_tokens=2), chat(c, model, "Private?", max_tokens=2)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert second.usage.prompt_tokens_details.cached_tokens == 0
        salted = [chat(c, model, "Private?", max_tokens=2, extra_body={"cache_salt": "me"}) for _ in range(2)]
        assert salted[1].usage.prompt_tokens_details.cached_tokens == salted[1].usage.prompt_tokens - 1
    wait_idle(engine)
    assert_clean(engine)


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10_000}, "max_tokens", "at most 64"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature", "number"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n", "one choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": [1]}, "stop", "strings"),
    ({"messages": [{"role": "user", "content": "hi"}], "cache_salt": ""}, "cache_salt", "non-empty"),
    ({"messages": [{"role": "user", "content": "  "}]}, "messages", "empty"),
    ({"messages": [{"role": "user", "content": "hi " * 5000}]}, "messages", "limit"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages",
     "text"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"}, "model", "does not exist"),
])
def test_bad_requests_get_openai_shaped_errors(shared, body, param, words):
    engine, url, model = shared
    before = len(engine.recent())
    with pytest.raises(openai.APIStatusError) as info:
        body = {"model": model} | body
        extra = {k: body.pop(k) for k in list(body) if k == "cache_salt"}  # vLLM's field: not in the client's API
        client(url).chat.completions.create(**body, extra_body=extra)
    error = info.value.response.json()["error"]
    assert info.value.status_code == (404 if param == "model" else 400)
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert words in error["message"] and "Traceback" not in error["message"]
    assert len(engine.recent()) == before
    assert_clean_after(engine)


def test_raw_bodies_that_are_not_json(shared):
    engine, url, _ = shared
    for content in (b"{not json", b"[1, 2]", b"\xff\xfe", b'{"prompt": NaN}'):
        r = httpx.post(url + "v1/completions", content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400, content
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_a_full_queue_answers_503(tiny_runner, make_engine):
    engine = make_engine(max_queue=1, max_new_tokens_cap=8)
    req = GenerationRequest(prompt="hello", sampling=SamplingParams(max_new_tokens=2))
    with served(engine) as url:
        handles = []
        with tiny_runner.lock:  # the model is busy: the worker takes one request and waits
            try:
                for _ in range(8):
                    handles.append(engine.submit(req))
                    time.sleep(0.05)
            except EngineBusy:
                pass
            with pytest.raises(openai.InternalServerError) as info:  # 503: the server is overloaded
                client(url).chat.completions.create(model=engine.info().model_name,
                                                    messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            assert info.value.status_code == 503 and info.value.response.json()["error"]["code"] == "queue_full"
            assert "busy" in info.value.response.json()["error"]["message"]
        for h in handles:
            assert list(h)[-1].done
    wait_idle(engine)
    assert_clean(engine)


def test_not_ready_answers_503():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from server.openai_api import ApiState, api_routes

    with TestClient(FastAPI(routes=api_routes(ApiState(get_engine=lambda: None)))) as http:
        for r in (http.get("/v1/models"), http.post("/v1/chat/completions", json={"messages": []})):
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"


def test_a_client_that_disconnects_mid_stream_cancels_its_request(tiny_runner, make_engine):
    engine = make_engine(budget_bytes=16 * 2**20, max_new_tokens_cap=900)
    with served(engine) as url:
        body = {"model": engine.info().model_name, "prompt": "Once upon a time", "max_tokens": 900,
                "temperature": 0, "stream": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", url + "v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            assert "choices" in json.loads(first[5:])
        wait_idle(engine)
        m = engine.recent()[-1]
        assert m.finish_reason == "cancelled" and m.output_tokens < 900
        # Not streamed: a client that gives up waiting (here, a read timeout) cancels too. Once the
        # request runs, the runner's lock holds the engine's steps past the timeout: the tiny model
        # could write all 900 tokens within the second.
        def pause_once_running() -> None:
            deadline = time.monotonic() + 30
            while engine.stats().running < 1 and time.monotonic() < deadline:
                time.sleep(0.001)
            with tiny_runner.lock:
                time.sleep(2.0)

        pauser = threading.Thread(target=pause_once_running)
        pauser.start()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "v1/completions", json=body | {"stream": False}, timeout=httpx.Timeout(60, read=1.0))
        pauser.join()
        wait_idle(engine)
        m = engine.recent()[-1]
        assert m.finish_reason == "cancelled" and m.output_tokens < 900 and len(engine.recent()) == 2
        assert httpx.get(url).status_code == 200  # the page keeps working
    assert_clean(engine)


def test_the_page_and_its_own_api_still_answer_on_the_same_port(shared):
    _, url, _ = shared
    assert httpx.get(url).status_code == 200
    assert httpx.get(url + "gradio_api/info").status_code == 200
    assert httpx.get(url + "v1/nothing").status_code == 404


def assert_clean_after(engine: Engine) -> None:
    wait_idle(engine)
    assert_clean(engine)


@pytest.mark.slow
def test_real_model_chat_reuses_its_prefix(real_runner, make_engine):
    engine = make_engine(real_runner, budget_bytes=256 * 2**20, max_new_tokens_cap=16)
    with served(engine) as url:
        c, model = client(url), engine.info().model_name
        first = chat(c, model, "Name one colour.", max_tokens=8)
        streamed = list(chat(c, model, "Name one colour.", max_tokens=8, stream=True,
                             stream_options={"include_usage": True}))
        assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == \
            first.choices[0].message.content
        assert first.choices[0].message.content.strip()
        assert streamed[-1].usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    wait_idle(engine)
    assert_clean(engine)


def test_metrics_count_cache_queries_hits_and_latencies(shared):
    from prometheus_client.parser import text_string_to_metric_families

    engine, url, model = shared

    def scrape() -> dict[str, float]:
        r = httpx.get(url + "metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        return {s.name: s.value for fam in text_string_to_metric_families(r.text) for s in fam.samples
                if not s.labels or s.labels.get("le") is None}

    before = scrape()
    c = client(url)
    chat(c, model, "Count me.", max_tokens=2)
    again = chat(c, model, "Count me.", max_tokens=2)
    wait_idle(engine)
    after = scrape()
    stats = engine.stats()
    assert after["radix_prefix_cache_queries_total"] == stats.prompt_tokens
    assert after["radix_prefix_cache_hits_total"] == stats.cached_tokens
    assert after["radix_prefix_cache_hits_total"] - before.get("radix_prefix_cache_hits_total", 0) >= \
        again.usage.prompt_tokens_details.cached_tokens
    assert after["radix_time_to_first_token_seconds_count"] == len(engine.recent())
    assert after["radix_prefill_seconds_count"] - before["radix_prefill_seconds_count"] == 2
    assert after["radix_cache_bytes"] == stats.cache_bytes > 0
    assert after["radix_cache_budget_bytes"] == stats.budget_bytes
    assert after["radix_num_requests_waiting"] == 0
    assert after["radix_evicted_tokens_total"] == stats.evicted_tokens
    assert after["radix_generation_tokens_total"] >= 4


def test_each_app_has_its_own_metrics_registry(make_engine):
    from server.metrics import EngineMetrics

    a, b = make_engine(max_new_tokens_cap=2), make_engine(max_new_tokens_cap=2)
    a.run(GenerationRequest(prompt="only in a", sampling=SamplingParams(max_new_tokens=1)))
    text_a, text_b = EngineMetrics(lambda: a).text().decode(), EngineMetrics(lambda: b).text().decode()
    assert "radix_time_to_first_token_seconds_count 1.0" in text_a
    assert "radix_time_to_first_token_seconds_count 0.0" in text_b
    assert "radix_cache_budget_bytes" in text_b
    assert EngineMetrics(lambda: None).text().startswith(b"# HELP radix_time_to_first_token")
