"""The real embedded model (SmolLM2-135M-Instruct): reuse changes no output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.types import GenerationRequest, SamplingParams

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

SYSTEM = ("You are a helpful travel assistant. Answer briefly and accurately. Always mention one practical tip. "
          "Never invent prices.")


def chat(*turns):
    msgs = [{"role": "system", "content": SYSTEM}]
    for i, t in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return tuple(msgs)


def greedy(messages=None, prompt=None, n=12):
    return GenerationRequest(messages=messages, prompt=prompt, sampling=SamplingParams(max_new_tokens=n))


@pytest.fixture(scope="module")
def engines(real_runner, make_module_engine):
    return make_module_engine(real_runner), make_module_engine(real_runner, enable_cache=False)


def fed(m):
    """Tokens whose KV was computed: the last sampled token is only fed if decoding went on."""
    return m.prompt_ids + (m.output_ids[:-1] if m.finish_reason == "length" else m.output_ids)


def lcp(a, b):
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_multi_turn_chat_identical_with_and_without_reuse(engines):
    on, off = engines
    history: list[str] = []
    seen: list[list[int]] = []
    for question in ["What should I pack for Iceland?", "And for Morocco?", "Which of the two is cheaper?"]:
        history.append(question)
        m_on, m_off = on.run(greedy(chat(*history))), off.run(greedy(chat(*history)))
        assert m_on.output_ids == m_off.output_ids
        assert m_off.cached_tokens == 0
        expected = max((lcp(m_on.prompt_ids, s) for s in seen), default=0)
        assert m_on.cached_tokens == min(expected, m_on.prompt_tokens - 1)
        seen.append(fed(m_on))
        history.append(m_on.output_text)
        on.check_invariants()
    assert on.recent(1)[0].cached_tokens > 40  # later turns reuse system prompt, history and replies


def test_few_shot_identical_with_and_without_reuse(engines):
    on, off = engines
    shots = ("Review: great battery life -> positive\nReview: broke in a day -> negative\n"
             "Review: works perfectly -> positive\nReview: waste of money -> negative\n")
    prompts = [shots + f"Review: {q} ->" for q in ("love it", "terrible support", "pretty good value")]
    seen: list[list[int]] = []
    for p in prompts:
        m_on, m_off = on.run(greedy(prompt=p, n=3)), off.run(greedy(prompt=p, n=3))
        assert m_on.output_ids == m_off.output_ids
        expected = max((lcp(m_on.prompt_ids, s) for s in seen), default=0)
        assert m_on.cached_tokens == min(expected, m_on.prompt_tokens - 1)
        seen.append(fed(m_on))
    assert on.recent(1)[0].cached_tokens >= 30


def test_stream_larger_than_budget_stays_under_it(real_runner, make_engine):
    """Six prompts that together are far larger than the budget (each about 115 tokens, one
    request's prompt and answer fit): each evicts what came before, answers are unchanged."""
    budget = 130 * real_runner.kv_bytes_per_token
    engine = make_engine(real_runner, budget_bytes=budget)
    off = make_engine(real_runner, enable_cache=False)
    for i in range(6):
        p = f"Story {i}: " + " ".join(f"word{i}x{j}" for j in range(25))
        m = engine.run(greedy(prompt=p, n=4))
        assert m.cache_bytes <= budget
        assert m.output_ids == off.run(greedy(prompt=p, n=4)).output_ids
        engine.check_invariants()
    assert engine.stats().evicted_tokens > 0


def test_replay_cli_on_small_trace(tmp_path):
    trace = tmp_path / "trace.jsonl"
    lines = [{"prompt": "The capital of France is", "max_new_tokens": 3},
             {"prompt": "The capital of France is a city that", "max_new_tokens": 3},
             {"messages": [{"role": "user", "content": "Hi!"}], "max_new_tokens": 3, "session": "s1"}]
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "tools.replay", str(trace), "--baseline", "--budget-mb", "64"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(x) for x in out.stdout.splitlines()]
    assert len(records) == 4 and "summary" in records[-1]
    assert records[1]["cached_tokens"] == 5  # "The capital of France is"
    for key in ("index", "prompt_tokens", "cached_tokens", "computed_tokens", "prefill_ms", "baseline_prefill_ms",
                "ttft_ms", "output_text", "prompt_ids", "output_ids", "cache_bytes", "cache_budget_bytes",
                "evicted_tokens"):
        assert key in records[0]
    assert records[0]["baseline_prefill_ms"] is not None
    summary = records[-1]["summary"]
    assert summary["requests"] == 3 and summary["tokens_saved"] == 5 and summary["peak_cache_bytes"] > 0
    off = subprocess.run([sys.executable, "-m", "tools.replay", str(trace), "--no-cache"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert off.returncode == 0, off.stderr[-2000:]
    off_records = [json.loads(x) for x in off.stdout.splitlines()]
    assert all(r["cached_tokens"] == 0 for r in off_records[:-1])
    assert all(r["baseline_prefill_ms"] is None for r in off_records[:-1])
    assert [r["output_ids"] for r in off_records[:-1]] == [r["output_ids"] for r in records[:-1]]
