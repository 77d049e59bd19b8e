"""Remote mode: the dashboard in front of an OpenAI-compatible server.

The backend is a second instance of this app served on loopback (a real HTTP server, no mock
transport); broken backends are tiny real TCP servers that answer in vLLM's shapes and then
misbehave. Response bodies in vLLM's, SGLang's and llama.cpp's shapes (tests/app/fixtures/)
are parsed as each engine writes them."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import app
from analysis.no_reuse import run_measured
from engine.types import CacheKey, EngineError, GenerationRequest, SamplingParams
from server.remote.engine import RemoteEngine
from server.remote.usage import BackendUsage, error_message, parse_choice, parse_usage
from tests.helpers_app import assert_clean, free_port, launched_app, shown_logs, visitor, wait_idle

FIXTURES = Path(__file__).parent / "fixtures"
SYSTEM = "You are a patient tutor who explains how serving engines reuse the KV cache of shared prefixes. " * 2


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def stream_chunks(name: str) -> list[dict]:
    lines = (FIXTURES / name).read_text().splitlines()
    return [json.loads(line[5:]) for line in lines if line.startswith("data:") and line.strip() != "data: [DONE]"]


# ------------------------------------------------------------------ the parser, on each engine's shapes
def test_vllm_usage_with_and_without_prompt_tokens_details():
    assert parse_usage(fixture("vllm_chat_with_details.json")) == BackendUsage(812, 3, 800)
    assert parse_usage(fixture("vllm_chat_without_details.json")) == BackendUsage(812, 3, None)
    assert parse_choice(fixture("vllm_chat_with_details.json")).text == "Paris."


def test_vllm_stream_carries_usage_on_its_last_chunk():
    chunks = stream_chunks("vllm_completions_stream.txt")
    assert [parse_usage(c) for c in chunks[:-1]] == [None] * (len(chunks) - 1)  # "usage": null
    assert parse_usage(chunks[-1]) == BackendUsage(64, 2, 48)
    assert "".join(parse_choice(c).text for c in chunks[:-1]) == " The cache"
    assert parse_choice(chunks[-2]).finish_reason == "length" and parse_choice(chunks[-1]) is None


def test_sglang_native_meta_info_and_openai_cache_report():
    native = fixture("sglang_generate.json")
    assert parse_usage(native) == BackendUsage(40, 8, 32)
    assert parse_choice(native).finish_reason == "length" and parse_choice(native).text.startswith(" Paris")
    assert parse_usage(fixture("sglang_chat_cache_report.json")) == BackendUsage(36, 3, 32)


def test_llamacpp_recorded_exchange():
    """A real llama-server (tools/llamacpp.py record): usage carries cached_tokens and timings.cache_n."""
    chat = fixture("llamacpp_chat.json")
    assert parse_usage(chat) == BackendUsage(48, 24, 0)  # the first turn: nothing cached yet
    assert chat["timings"]["cache_n"] == 0 and parse_choice(chat).text.startswith("A radix tree")
    turn2 = stream_chunks("llamacpp_chat_stream.txt")
    assert parse_usage(turn2[-1]) == BackendUsage(91, 24, 71) == parse_usage({"timings": {"cache_n": 71,
                                                                                           "prompt_n": 91,
                                                                                           "predicted_n": 24}})
    assert turn2[-1]["choices"] == [] and turn2[-1]["timings"]["cache_n"] == 71  # the first turn, from the slot
    assert "".join(parse_choice(c).text for c in turn2[:-1] if parse_choice(c)) == \
        "".join((c["choices"][0]["delta"].get("content") or "") for c in turn2[:-1])
    sent = stream_chunks("llamacpp_completions_stream.txt")  # remote mode's request: token ids in, text out
    assert parse_usage(sent[-1]) == BackendUsage(48, 8, 47)  # the chat's prompt, all but one token cached
    assert parse_choice(sent[-1]).finish_reason == "length" and parse_choice(sent[-1]).text == ""
    assert all(parse_choice(c).token_ids == () for c in sent)  # it ignores return_token_ids
    models = fixture("llamacpp_models.json")
    assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct"]
    metrics = (FIXTURES / "llamacpp_metrics.txt").read_text()
    assert "llamacpp:prompt_tokens_cached_total" in metrics and "llamacpp:requests_processing" in metrics


def test_remote_mode_reads_a_recorded_llamacpp_stream(tokenizer):
    from tools.llamacpp import SYSTEM as RECORDED_SYSTEM

    asked = ({"role": "system", "content": RECORDED_SYSTEM}, {"role": "user", "content": "What is a radix tree?"})
    with scripted_backend((FIXTURES / "llamacpp_completions_stream.txt").read_bytes(), finish=True) as url:
        remote = RemoteEngine(url, "SmolLM2-135M-Instruct", tokenizer)
        m = remote.run(GenerationRequest(messages=asked, sampling=SamplingParams(max_new_tokens=8)))
    assert m.prompt_tokens == 48  # the recorded request's prompt, tokenized here as llama.cpp did there
    assert m.cached_tokens_reported and m.cached_tokens == 47 and m.computed_tokens == 1
    assert m.output_tokens == 8 and m.finish_reason == "length" and m.output_text.startswith("A radix tree")
    assert m.output_ids == tokenizer.encode(m.output_text, add_special_tokens=False)


def test_error_bodies():
    assert error_message(fixture("vllm_error.json")) == "The model `gpt-4` does not exist."
    assert error_message({"object": "error", "message": "flat", "type": "BadRequestError"}) == "flat"
    assert parse_usage({"usage": {"prompt_tokens": True}}) == BackendUsage(None, None, None)
    assert parse_usage([]) is None and parse_choice({"choices": []}) is None


# ------------------------------------------------------------------ against a second instance of this app
@pytest.fixture(scope="module")
def backend(make_module_engine):
    """This app, served on loopback as the backend, with an API key."""
    engine = make_module_engine(budget_bytes=64 * 2**20, max_new_tokens_cap=16)
    from components.demo import launch_kwargs

    demo = app.build_app(engine)
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=free_port(), quiet=True,
                **launch_kwargs(app.app_kwargs(engine, api_key="sesame")))
    try:
        yield engine, demo.local_url
    finally:
        demo.close()


def remote_for(url: str, tokenizer, key: str | None = "sesame", **kw) -> RemoteEngine:
    engine = RemoteEngine(url, "", tokenizer, api_key=key, max_new_tokens_cap=16, **kw)
    engine.check_backend()
    return engine


def _requests() -> list[GenerationRequest]:
    ask = [("user", "What is a radix tree?"), ("user", "And a KV cache?"), ("user", "What is a radix tree?")]
    out = []
    for _, question in ask:
        msgs = ({"role": "system", "content": SYSTEM}, {"role": "user", "content": question})
        out.append(GenerationRequest(messages=msgs, sampling=SamplingParams(max_new_tokens=6), measure_baseline=True,
                                     tag="chat"))
    out.append(GenerationRequest(prompt="Hello there, general", sampling=SamplingParams(max_new_tokens=4)))
    return out


def _tree(snapshot) -> list[tuple]:
    return sorted((n.depth_tokens, n.token_ids) for n in snapshot.nodes)


def test_remote_mode_shows_what_local_mode_shows(backend, tokenizer, make_engine):
    _, url = backend
    remote = remote_for(url, tokenizer)
    local = make_engine(budget_bytes=64 * 2**20, max_new_tokens_cap=16)
    for req in _requests():
        r, m = run_measured(remote, req), run_measured(local, req)  # the no-reuse figure as the page takes it
        assert (r.prompt_tokens, r.cached_tokens, r.output_text, r.output_ids) == \
            (m.prompt_tokens, m.cached_tokens, m.output_text, m.output_ids)
        assert r.cached_tokens_reported and r.ttft_ms > 0
        assert (r.baseline_prefill_ms is None) == (m.baseline_prefill_ms is None)
    assert remote.recent()[2].cached_tokens == remote.recent()[2].prompt_tokens - 1
    assert _tree(remote.snapshot()) == _tree(local.snapshot())  # the same tree, node for node
    assert remote.stats().cached_tokens == local.stats().cached_tokens
    assert remote.cache_reported is True
    remote.check_invariants()
    metrics = remote.backend_metrics()
    assert metrics["radix_prefix_cache_hits_total"] >= remote.stats().cached_tokens
    wait_idle(local)
    assert_clean(local)


def test_clearing_a_namespace_starts_it_cold_on_the_server(backend, tokenizer):
    _, url = backend
    remote = remote_for(url, tokenizer)
    req = GenerationRequest(prompt="A prompt to forget about, please.", sampling=SamplingParams(max_new_tokens=2),
                            namespace="visitor-1")
    remote.run(req)
    assert remote.run(req).cached_tokens > 0
    assert remote.clear_cache("visitor-1") > 0
    assert remote.run(req).cached_tokens == 0  # a new salt: nothing on the server for it
    other = GenerationRequest(prompt="A prompt to forget about, please.", sampling=SamplingParams(max_new_tokens=2),
                              namespace="visitor-2")
    assert remote.run(other).cached_tokens == 0  # namespaces stay apart on the server too


def test_the_page_runs_in_remote_mode(backend, tokenizer):
    backend_engine, url = backend
    remote = remote_for(url, tokenizer)
    with launched_app(remote) as page:
        a = visitor(page)
        first = a.predict("What is a radix tree?", [], "Pirate", "", 4, True, api_name="/chat")
        second = a.predict("And a KV cache?", first[0], "Pirate", "", 4, True, api_name="/chat")
        assert len(second[0]) == 4 and "served from the cache" in second[3]
        assert "Remote server" in second[3] and remote.recent()[-1].cached_tokens > 0
        assert backend_engine.recent()[-1].tag == "api"  # it really ran on the backend
    remote.check_invariants()


# ------------------------------------------------------------------ backends that go wrong
def test_wrong_url_key_and_model_each_get_one_clear_message(backend, tokenizer, capsys):
    _, url = backend
    with pytest.raises(EngineError, match="Cannot reach the backend .* is it running"):
        remote_for(f"http://127.0.0.1:{free_port()}", tokenizer)
    with pytest.raises(EngineError, match="refused the API key \\(HTTP 401\\).*RADIX_BACKEND_API_KEY"):
        remote_for(url, tokenizer, key="wrong")
    with pytest.raises(EngineError, match="does not serve 'nope'.*--backend-model"):
        RemoteEngine(url, "nope", tokenizer, api_key="sesame").check_backend()
    assert app.main(["--backend", f"http://127.0.0.1:{free_port()}"]) == 1
    assert "error: Cannot reach the backend" in capsys.readouterr().err


@contextmanager
def scripted_backend(answer: bytes, finish: bool) -> Iterator[str]:
    """A real HTTP server on loopback that answers every request with ``answer`` as a chunked
    event stream, then ends the body properly (``finish``) or drops the connection mid-stream."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.1)  # so the loop sees ``stop`` soon
    stop = threading.Event()

    def read_request(conn: socket.socket) -> bool:
        data = b""
        while b"\r\n\r\n" not in data:
            more = conn.recv(65536)
            if not more:
                return False
            data += more
        head, body = data.split(b"\r\n\r\n", 1)
        length = next((int(h.split(b":")[1]) for h in head.split(b"\r\n")
                       if h.lower().startswith(b"content-length")), 0)
        while len(body) < length:
            more = conn.recv(65536)
            if not more:
                return False
            body += more
        return True

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(10)
                if not read_request(conn):
                    continue
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                conn.sendall(f"{len(answer):x}\r\n".encode() + answer + b"\r\n")
                if finish:
                    conn.sendall(b"0\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)
        server.close()


def test_a_backend_that_goes_away_mid_stream(tokenizer):
    half = (FIXTURES / "vllm_completions_stream.txt").read_bytes().split(b"\n\n")[0] + b"\n\n"
    with scripted_backend(half, finish=False) as url:
        remote = RemoteEngine(url, "m", tokenizer)
        with pytest.raises(EngineError, match="closed the connection in the middle of the answer"):
            remote.run(GenerationRequest(prompt="Tell me a story", sampling=SamplingParams(max_new_tokens=4)))
        with launched_app(remote) as page:
            job = visitor(page).submit("Tell me a story", [], "Pirate", "", 4, False, api_name="/chat")
            history = job.result(timeout=60)[0]
            assert any("closed the connection" in msg and level == "warning" for msg, level in shown_logs(job))
            assert len(history) == 2  # the question stays; the page keeps working
    assert remote.stats().requests == 0


def test_a_backend_without_cache_reporting_says_so(tokenizer):
    text = (FIXTURES / "vllm_completions_stream.txt").read_text()
    without = text.replace(',"prompt_tokens_details":{"cached_tokens":48}', "").encode()
    assert b"prompt_tokens_details" not in without
    with scripted_backend(without, finish=True) as url:
        remote = RemoteEngine(url, "m", tokenizer)
        m = remote.run(GenerationRequest(prompt="Tell me a story", sampling=SamplingParams(max_new_tokens=2)))
        assert m.output_text == " The cache" and m.output_tokens == 2 and m.finish_reason == "length"
        assert m.cached_tokens == 0 and m.cached_tokens_reported is False and remote.cache_reported is False
        with launched_app(remote) as page:
            out = visitor(page).predict("Tell me a story", [], "Pirate", "", 2, False, api_name="/chat")
            assert "Cached tokens unknown" in out[3] and "--enable-prompt-tokens-details" in out[3]
    with scripted_backend(text.encode(), finish=True) as url:  # the same stream with the details
        m = RemoteEngine(url, "m", tokenizer).run(GenerationRequest(prompt="Tell me a story"))
        assert m.cached_tokens == min(48, m.prompt_tokens) and m.cached_tokens_reported


def test_the_ordering_lab_runs_on_a_remote_server_as_it_does_locally(backend, tokenizer, make_engine):
    from analysis.lab.ordering_runs import LabPrompt, Variant, run_lab_to_end

    _, url = backend
    remote = remote_for(url, tokenizer)
    shared = "Reference: " + "the radix cache keeps every computed prefix. " * 4
    variants = [Variant("static first", tuple(LabPrompt(f"q{i}", prompt=shared + f"Question {i}?") for i in range(3))),
                Variant("dynamic first", tuple(LabPrompt(f"q{i}", prompt=f"Question {i}? " + shared) for i in range(3)))]
    local = make_engine(budget_bytes=64 * 2**20, max_new_tokens_cap=16)
    got = run_lab_to_end(remote, variants, measure_baseline=False)
    want = run_lab_to_end(local, variants, measure_baseline=False)
    assert [[q.cached_tokens for q in v.requests] for v in got] == [[q.cached_tokens for q in v.requests]
                                                                    for v in want]
    assert got[0].cached_tokens > got[1].cached_tokens
    assert remote.snapshot().num_tokens == 0  # each variant's namespace is cleared after it ran


def test_app_flags_build_the_remote_engine_and_serve_only_metrics_and_health(backend, tokenizer, monkeypatch):
    _, url = backend
    monkeypatch.setenv("RADIX_BACKEND_API_KEY", "sesame")
    args = app.parse_args(["--backend", url.rstrip("/") + "/v1", "--max-new-tokens", "16"])
    remote = app.build_remote_engine(args, tokenizer=tokenizer)
    assert remote.model == "tiny-random-llama" and remote.base_url == url.rstrip("/")
    # the backend serves its own /v1; /metrics here adds what its KV events say (none from this backend),
    # /health is the backend's health (tests/server/test_health.py)
    assert [r.path for r in app.app_kwargs(remote)["routes"]] == ["/metrics", "/health"]
    assert remote.events is None and remote.snapshot().origin == "shadow"
    assert remote.info().backend == remote.base_url
    with pytest.raises(EngineError, match="budget cannot be set"):
        remote.set_budget(1)


def test_fleet_flag_needs_a_backend_and_takes_a_list(monkeypatch):
    """``--fleet URL,URL`` (env ``RADIX_FLEET``) names the replicas behind the router ``--backend``;
    alone it is refused in one line (the real fleet is tests/server/remote/test_fleet.py's)."""
    with pytest.raises(SystemExit):
        app.parse_args(["--fleet", "http://127.0.0.1:1"])
    args = app.parse_args(["--backend", "http://127.0.0.1:9", "--fleet", " http://a:1, http://b:2 ,"])
    assert args.fleet == ["http://a:1", "http://b:2"]
    monkeypatch.setenv("RADIX_FLEET", "http://c:3")
    assert app.parse_args(["--backend", "http://127.0.0.1:9"]).fleet == ["http://c:3"]


def test_server_package_imports_no_ui():
    from tests.test_layering import ROOT, UI_LIBS, _imports

    offenders = [f"{p.name}: {n}" for p in sorted((ROOT / "server").glob("*.py"))
                 for n in _imports(p) if n.split(".")[0] in UI_LIBS]
    assert not offenders, offenders


# ------------------------------------------------------------------ the shadow tree: bounded, one hiding rule
def test_the_shadow_tree_is_bounded_least_recently_sent_first(tokenizer):
    text = (FIXTURES / "vllm_completions_stream.txt").read_bytes()
    with scripted_backend(text, finish=True) as url:
        remote = RemoteEngine(url, "m", tokenizer, shadow_tokens=60)
        prompts = [f"Prompt number {i}: " + "tell me about caches. " * 3 for i in range(12)]
        for p in prompts:
            remote.run(GenerationRequest(prompt=p, sampling=SamplingParams(max_new_tokens=2)))
            assert remote.tree.num_tokens <= 60
            remote.check_invariants()
        last = remote.encode(prompts[-1])
        assert remote.tree.match(CacheKey(tuple(last)), touch=False).length == len(last)  # the newest stays
        first = remote.encode(prompts[0])
        assert remote.tree.match(CacheKey(tuple(first)), touch=False).length < len(first)  # the oldest went
        before = remote.tree.num_tokens
        m = remote.run(GenerationRequest(prompt="Not worth keeping: nobody can reuse it.", store=False,
                                         sampling=SamplingParams(max_new_tokens=2)))
        assert m.inserted_tokens == 0 and remote.tree.num_tokens == before
        assert remote.step_log() == []  # the backend schedules: no forwards of this app to draw


def test_remote_snapshot_hides_others_by_the_local_rule(tokenizer):
    from engine.snapshot_view import HIDDEN_BUCKET_TOKENS

    text = (FIXTURES / "vllm_completions_stream.txt").read_bytes()
    with scripted_backend(text, finish=True) as url:
        remote = RemoteEngine(url, "m", tokenizer, isolation=True)
        for ns, prompt in (("v-a", "Visitor A's secret prompt"), ("v-b", "Visitor B's secret prompt, longer one"),
                           ("v-b/lab", "Visitor B's lab prompt")):
            remote.run(GenerationRequest(prompt=prompt, namespace=ns, sampling=SamplingParams(max_new_tokens=2)))
        snap = remote.snapshot(viewer="v-a")
    hidden = [n for n in snap.nodes if n.hidden]
    assert len(hidden) == 1  # both of B's namespaces: one coarse "others" node under the root
    assert hidden[0].num_tokens == HIDDEN_BUCKET_TOKENS and hidden[0].text == "" and hidden[0].hits == 0
    assert hidden[0].last_access_s_ago == 0.0 and hidden[0].token_ids == ()
    assert all("Visitor B" not in n.text for n in snap.nodes)
    assert any("Visitor A" in n.text for n in snap.nodes if not n.hidden)
    assert remote.snapshot().num_tokens == remote.tree.num_tokens  # no viewer: everything


def test_ignore_eos_goes_to_the_backend_only_when_asked():
    from server.remote.client import BackendClient

    client = BackendClient("http://127.0.0.1:9", "m")
    try:
        assert "ignore_eos" not in client._body([1, 2], SamplingParams(max_new_tokens=3), 3, None)
        assert client._body([1, 2], SamplingParams(max_new_tokens=3, ignore_eos=True), 3, None)["ignore_eos"] is True
    finally:
        client.http.close()
