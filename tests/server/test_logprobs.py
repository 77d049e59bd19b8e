"""Log-probabilities through the OpenAI-compatible API (issue 44, item 3): OpenAI's shapes for chat
(``logprobs``, ``top_logprobs``) and completions (``logprobs``, ``echo``), streamed and not, the
400s for bad values, remote mode's refusal, and the values themselves: the log-softmax of the
logits the runner computes for the same tokens run directly (teacher-forced), the greedy token
first among the alternatives. On the tiny random model with the app served on loopback."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

from engine.types import EngineError, GenerationRequest
from tests.helpers_app import assert_clean, launched_app, wait_idle

SYSTEM = "You are a careful assistant who answers questions about prefix caching in one short sentence. " * 2
PROMPT = "The radix tree keeps every prompt it has seen, so"


@pytest.fixture(scope="module")
def shared(make_module_engine):
    engine = make_module_engine(budget_bytes=64 * 2**20, max_new_tokens_cap=32)
    with launched_app(engine) as url:
        yield engine, url
    wait_idle(engine)
    assert_clean(engine)


def post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(url + "v1/" + route, json=body, timeout=60)


def chat_body(question: str = "What is a radix tree?", **kw) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": 6, "temperature": 0, "ignore_eos": True} | kw


def streamed(url: str, route: str, body: dict) -> list[dict]:
    """Every data chunk of a streamed answer, parsed, up to ``[DONE]``."""
    out = []
    with httpx.stream("POST", url + "v1/" + route, json=body | {"stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    assert "error" not in out[-1], out[-1]
    return out


def reference(runner, ids: list[int]) -> torch.Tensor:
    """Log-softmax rows of the runner's own forward over ``ids`` at once (no cache, no batch)."""
    return torch.log_softmax(runner.forward(ids, runner.new_request_kv(len(ids) + 1)).float(), dim=-1)


# ------------------------------------------------------------------ chat
def test_chat_logprobs_have_openais_shape_and_the_runners_values(shared, tiny_runner):
    engine, url = shared
    r = post(url, "chat/completions", chat_body(logprobs=True, top_logprobs=3, return_token_ids=True))
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    content = choice["logprobs"]["content"]
    assert set(choice["logprobs"]) == {"content", "refusal"}
    assert len(content) == body["usage"]["completion_tokens"] == 6
    ids = choice["token_ids"]
    ref = reference(tiny_runner, body["prompt_token_ids"] + ids)
    p = len(body["prompt_token_ids"])
    for i, (entry, tok) in enumerate(zip(content, ids, strict=True)):
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["token"] == engine.decode([tok]) and bytes(entry["bytes"]) == engine.token_texts([tok])[0][1]
        assert entry["logprob"] == pytest.approx(ref[p - 1 + i, tok].item(), abs=1e-4)
        top = entry["top_logprobs"]
        assert len(top) == 3 and all(set(t) == {"token", "logprob", "bytes"} for t in top)
        assert top[0]["token"] == entry["token"] and top[0]["logprob"] == entry["logprob"]  # greedy: top-1
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert sum(math.exp(t["logprob"]) for t in top) <= 1.0
        assert [t["token"] for t in top] == [engine.decode([j]) for j in torch.topk(ref[p - 1 + i], 3).indices]
    assert "".join(e["token"] for e in content) == choice["message"]["content"]
    # asked without alternatives: empty lists; not asked: null
    zero = post(url, "chat/completions", chat_body(logprobs=True)).json()["choices"][0]["logprobs"]["content"]
    assert [e["top_logprobs"] for e in zero] == [[]] * 6
    assert post(url, "chat/completions", chat_body()).json()["choices"][0]["logprobs"] is None


def test_chat_logprobs_streamed_chunk_by_chunk(shared):
    _, url = shared
    plain = post(url, "chat/completions", chat_body("Stream it.", logprobs=True, top_logprobs=2)).json()
    chunks = streamed(url, "chat/completions", chat_body("Stream it.", logprobs=True, top_logprobs=2))
    assert chunks[0]["choices"][0]["logprobs"] is None  # the role chunk
    entries = [e for c in chunks for e in ((c["choices"][0]["logprobs"] or {}).get("content") or [])]
    want = plain["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in entries] == [e["token"] for e in want]
    for got, exp in zip(entries, want, strict=True):
        assert got["logprob"] == pytest.approx(exp["logprob"], abs=1e-4)  # the stream reused the cached prompt
        assert [t["token"] for t in got["top_logprobs"]] == [t["token"] for t in exp["top_logprobs"]]
    for c in chunks[1:]:  # each content chunk carries the tokens that made its text
        delta = c["choices"][0]["delta"].get("content")
        if delta:
            assert "".join(e["token"] for e in c["choices"][0]["logprobs"]["content"]) == delta


# ------------------------------------------------------------------ completions
def test_completion_logprobs_with_echo(shared, tiny_runner):
    engine, url = shared
    post(url, "completions", {"prompt": PROMPT, "max_tokens": 2})  # cached now: echo must not reuse it
    body = post(url, "completions", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                                     "logprobs": 2, "echo": True, "return_token_ids": True}).json()
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    prompt_ids, out_ids = body["prompt_token_ids"], choice["token_ids"]
    ids = prompt_ids + out_ids
    assert len(lp["tokens"]) == len(ids) and lp["tokens"] == [engine.decode([i]) for i in ids]
    assert choice["text"].startswith(PROMPT) and "".join(lp["tokens"]) == choice["text"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # every prompt row computed here
    assert lp["text_offset"][0] == 0 and lp["text_offset"][len(prompt_ids)] == len(PROMPT)
    assert all(choice["text"][o:].startswith(t) for o, t in zip(lp["text_offset"], lp["tokens"], strict=True))
    ref = reference(tiny_runner, ids)
    for pos in range(1, len(ids)):
        assert lp["token_logprobs"][pos] == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4)
        top = lp["top_logprobs"][pos]
        assert 2 <= len(top) <= 3 and lp["tokens"][pos] in top  # the two likeliest and the chosen one
        assert sum(math.exp(v) for v in top.values()) <= 1.0
    for pos in range(len(prompt_ids), len(ids)):  # greedy: each new token is the likeliest
        assert max(lp["top_logprobs"][pos].values()) == lp["token_logprobs"][pos]


def test_completion_logprobs_streamed_with_and_without_echo(shared):
    _, url = shared
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    plain = post(url, "completions", body | {"echo": True}).json()["choices"][0]
    chunks = streamed(url, "completions", body | {"echo": True})
    first = chunks[0]["choices"][0]
    assert first["text"] == PROMPT and first["logprobs"]["token_logprobs"][0] is None
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    joined = {k: [x for p in parts for x in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == plain["text"]
    assert joined["tokens"] == plain["logprobs"]["tokens"] and joined["text_offset"] == plain["logprobs"]["text_offset"]
    assert joined["token_logprobs"][1:] == pytest.approx(plain["logprobs"]["token_logprobs"][1:], abs=1e-4)
    no_echo = streamed(url, "completions", body | {"logprobs": 0})
    parts = [c["choices"][0]["logprobs"] for c in no_echo if c["choices"] and c["choices"][0]["logprobs"]]
    tokens = [t for p in parts for t in p["tokens"]]
    assert len(tokens) == 6 and "".join(tokens) == "".join(c["choices"][0]["text"] for c in no_echo if c["choices"])
    assert all(list(top) == [tok] for p in parts for tok, top in zip(p["tokens"], p["top_logprobs"], strict=True))
    assert [o for p in parts for o in p["text_offset"]][0] == 0


def test_echo_without_logprobs_puts_the_prompt_first(shared):
    _, url = shared
    r = post(url, "completions", {"prompt": PROMPT, "max_tokens": 3, "echo": True}).json()["choices"][0]
    assert r["text"].startswith(PROMPT) and r["logprobs"] is None
    chunks = streamed(url, "completions", {"prompt": PROMPT, "max_tokens": 3, "echo": True})
    assert chunks[0]["choices"][0]["text"] == PROMPT


# ------------------------------------------------------------------ refusals
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
@pytest.mark.parametrize(("route", "body", "param", "words"), [
    ("chat/completions", CHAT | {"logprobs": "yes"}, "logprobs", "true or false"),
    ("chat/completions", CHAT | {"logprobs": 1}, "logprobs", "true or false"),
    ("chat/completions", CHAT | {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "from 0 to 20"),
    ("chat/completions", CHAT | {"logprobs": True, "top_logprobs": -1}, "top_logprobs", "from 0 to 20"),
    ("chat/completions", CHAT | {"logprobs": True, "top_logprobs": 2.5}, "top_logprobs", "whole number"),
    ("chat/completions", CHAT | {"logprobs": True, "top_logprobs": "3"}, "top_logprobs", "whole number"),
    ("chat/completions", CHAT | {"top_logprobs": 3}, "top_logprobs", "needs 'logprobs': true"),
    ("chat/completions", CHAT | {"logprobs": False, "top_logprobs": 3}, "top_logprobs", "needs 'logprobs': true"),
    ("chat/completions", CHAT | {"echo": True}, "echo", "/v1/completions"),
    ("chat/completions", CHAT | {"logprobs": True, "n": 2}, "n", "one choice"),
    ("completions", {"prompt": "hi", "logprobs": 6}, "logprobs", "from 0 to 5"),
    ("completions", {"prompt": "hi", "logprobs": True}, "logprobs", "whole number"),
    ("completions", {"prompt": "hi", "logprobs": [1]}, "logprobs", "whole number"),
    ("completions", {"prompt": "hi", "logprobs": 2, "top_logprobs": 2}, "top_logprobs", "chat"),
    ("completions", {"prompt": "hi", "echo": "yes"}, "echo", "true or false"),
    ("completions", {"prompt": "hi", "logprobs": 1, "n": 3}, "n", "one choice"),
])
def test_bad_logprob_requests_get_400s_naming_the_parameter(shared, route, body, param, words):
    engine, url = shared
    before = len(engine.recent())
    r = post(url, route, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert len(engine.recent()) == before


def test_remote_mode_refuses_what_it_cannot_pass_through_instead_of_dropping_it(tokenizer):
    """Remote mode passes each chosen token's logprob through from its backend (``logprobs`` 0; the
    reuse check runs on it, tested against a real vLLM) and refuses alternatives and prompt logprobs."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from server.openai_api import ApiState, api_routes
    from server.remote.engine import RemoteEngine

    remote = RemoteEngine("http://127.0.0.1:9", "", tokenizer)  # nothing listens: nothing is sent
    try:
        assert remote.capabilities.logprobs
        for kw in ({"logprobs": 1}, {"logprobs": 0, "prompt_logprobs": 1}):
            with pytest.raises(EngineError, match="remote mode"):
                remote.submit(GenerationRequest(prompt="hi", **kw))
        with TestClient(FastAPI(routes=api_routes(ApiState(get_engine=lambda: remote, model_name="m")))) as http:
            for route, body in (("chat/completions", CHAT | {"logprobs": True, "top_logprobs": 2}),
                                ("completions", {"prompt": "hi", "logprobs": 1})):
                r = http.post("/v1/" + route, json=body)
                assert r.status_code == 400 and "remote mode" in r.json()["error"]["message"], r.text
    finally:
        remote.close()


# ------------------------------------------------------------------ the shapes, pure
def test_shapes_from_plain_entries():
    from engine.types import TokenLogprob
    from server import openai_logprobs as lps

    names = {1: ("a", b"a"), 2: ("b", b"b"), 3: ("a", b"a"), 4: ("\ufffd", b"\xe6")}

    def texts(ids):
        return [names[i] for i in ids]

    def pieces(ids):
        return [names[i][0] for i in ids]

    entries = [TokenLogprob(2, -0.5, ((1, -0.2), (3, -0.3))), TokenLogprob(4, float("-inf"), ((1, -0.1),))]
    chat = lps.chat_logprobs(entries, texts)
    assert chat["content"][1] == {"token": "\ufffd", "logprob": lps.UNLIKELY, "bytes": [0xE6],
                                  "top_logprobs": [{"token": "a", "logprob": -0.1, "bytes": [97]}]}
    done = lps.completion_logprobs([1, 2, 4], [None, *entries], texts, pieces, start=10)
    assert done["token_logprobs"] == [None, -0.5, lps.UNLIKELY] and done["text_offset"] == [10, 11, 12]
    assert done["top_logprobs"] == [None, {"a": -0.2, "b": -0.5}, {"a": -0.1, "\ufffd": lps.UNLIKELY}]
    trail = lps.LogprobTrail(False, texts, pieces, start=5)
    first, second = trail.part(entries[:1]), trail.part(entries)
    assert first["text_offset"] == [5] and second["tokens"] == ["\ufffd"] and second["text_offset"] == [6]
    assert lps.joined(first, second)["tokens"] == ["b", "\ufffd"]
