"""vLLM's render routes on the launched server (what vLLM's router asks each worker before a
``kv_aware`` decision): the ids rendered are exactly the ids the same request then runs on, in
vLLM's shape, behind the API key, with the API's errors."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers_app import launched_app

MESSAGES = [{"role": "system", "content": "You answer questions about harbours in one sentence."},
            {"role": "user", "content": "When does the ferry leave?"}]


@pytest.fixture(scope="module")
def served(make_module_engine):
    engine = make_module_engine(max_new_tokens_cap=8)
    with launched_app(engine, api_key="sesame") as url:
        yield url, engine.info().model_name


def post(url: str, path: str, body: dict, key: str | None = "sesame") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + path.lstrip("/"), json=body, headers=headers, timeout=60)


def test_chat_render_gives_the_ids_the_request_then_runs_on(served):
    url, model = served
    rendered = post(url, "/v1/chat/completions/render", {"model": model, "messages": MESSAGES, "max_tokens": 3})
    assert rendered.status_code == 200, rendered.text
    body = rendered.json()
    assert body["model"] == model and body["sampling_params"]["max_tokens"] == 3 and body["request_id"]
    ran = post(url, "/v1/chat/completions", {"model": model, "messages": MESSAGES, "max_tokens": 3, "temperature": 0,
                                            "return_token_ids": True}).json()
    assert body["token_ids"] == ran["prompt_token_ids"] and len(body["token_ids"]) == ran["usage"]["prompt_tokens"]


def test_completions_render_answers_a_list_of_one(served):
    url, model = served
    r = post(url, "/v1/completions/render", {"model": model, "prompt": "The harbour opens at"})
    assert r.status_code == 200 and isinstance(r.json(), list) and len(r.json()) == 1
    ids = r.json()[0]["token_ids"]
    assert post(url, "/v1/completions/render", {"model": model, "prompt": ids}).json()[0]["token_ids"] == ids


def test_render_keeps_the_apis_key_and_errors(served):
    url, model = served
    assert post(url, "/v1/chat/completions/render", {"messages": MESSAGES}, key=None).status_code == 401
    bad = post(url, "/v1/chat/completions/render", {"model": model, "messages": "not a list"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    assert post(url, "/v1/chat/completions/render", {"model": "another", "messages": MESSAGES}).status_code == 404
