"""Bit for bit through the API (issue 44, item 7): a client checks for itself that neither its
batch nor the cache changes what the model computes.

Twelve different questions behind one shared system prompt, greedy, 16 new tokens each, with
their logprobs (the chosen token's and the 5 likeliest), asked three ways:

- **alone**: one by one (the system prompt is reused from the second question on);
- **batched**: all at once, beside a few clients with long prompts of their own (prefill
  chunks packed with decode rows, several rows per forward);
- **no reuse**: each with a fresh ``cache_salt`` (nothing cached to reuse).

The answers' text, tokens and top-5 tokens must be identical in all three, and where the engine
runs exact (``ModelRunner.runs_exact``: our C kernels on a CPU, the default) so must their
logprobs, bit for bit, in float32 and bfloat16; where it does not (PyTorch's kernels), within 1e-4
in float32. Each run prints the largest difference it found. On the tiny random model (fast) and
the embedded model (slow).

Before the exact forward (5 Dec 2026, 2-core Xeon, float32), nothing was bit for bit: SmolLM2
differed in 167-178 of 192 logprobs, by up to 1.7e-5; in bfloat16 10 of 12 answers were identical
batched and 8 of 12 without reuse. With it (6 Dec, AMD EPYC Zen 4): 0.0 both ways, both dtypes.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from engine.engine import Engine
from tests.helpers_app import assert_clean, launched_app, wait_idle

SYSTEM = ("You are the help desk of a small library. Answer in one or two plain sentences, name the shelf or "
          "service you mean, and never invent a rule the library does not have. Opening hours are nine to six "
          "on weekdays and ten to four on Saturdays; the reading room is on the first floor; loans last three "
          "weeks and may be renewed twice unless someone has reserved the book.")
QUESTIONS = ("When do you open on Saturday?", "Where is the reading room?", "How long is a loan?",
             "Can I renew a book twice?", "What if someone reserved my book?", "Do you open on Sunday?",
             "Is there a quiet place to study?", "How many times may I renew?", "Who do I ask about a lost card?",
             "Can children borrow books?", "Where are the newspapers?", "What time do you close on Monday?")
LONG_WORDS = ("archive", "catalogue", "periodical", "manuscript", "atlas", "folio", "index", "lending")
NEW_TOKENS = 16
TOP = 5
TOLERANCE = 1e-4  # float32 on PyTorch's kernels (no exact forward): logprobs; tokens and text identical
PAIRS = ("alone vs batched", "alone vs no reuse")


@dataclass(frozen=True)
class Answer:
    text: str
    ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # the chosen token's, one per token
    tops: tuple[tuple[float, ...], ...]  # the TOP likeliest tokens' logprobs, per token
    top_tokens: tuple[tuple[str, ...], ...]
    cached_tokens: int


def ask(url: str, question: str, salt: str) -> Answer:
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": TOP,
            "return_token_ids": True, "cache_salt": salt}
    r = httpx.post(url + "v1/chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    return Answer(choice["message"]["content"], tuple(choice["token_ids"]), tuple(e["logprob"] for e in content),
                  tuple(tuple(t["logprob"] for t in e["top_logprobs"]) for e in content),
                  tuple(tuple(t["token"] for t in e["top_logprobs"]) for e in content),
                  r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def long_client(url: str, i: int, words: int) -> None:
    """A client with a long prompt of its own: its prefill chunks share forwards with the questions."""
    text = " ".join(LONG_WORDS[(i + k) % len(LONG_WORDS)] + str(k % 97) for k in range(words))
    r = httpx.post(url + "v1/completions", json={"prompt": text, "max_tokens": 8, "temperature": 0,
                                                 "cache_salt": f"long-{i}"}, timeout=600)
    assert r.status_code == 200, r.text


@dataclass(frozen=True)
class Runs:
    alone: tuple[Answer, ...]
    batched: tuple[Answer, ...]
    no_reuse: tuple[Answer, ...]
    batch_size_max: int  # the largest decode forward the batched run's questions took part in

    def pairs(self) -> dict[str, tuple[tuple[Answer, ...], tuple[Answer, ...]]]:
        return dict(zip(PAIRS, ((self.alone, self.batched), (self.alone, self.no_reuse)), strict=True))


def three_runs(engine: Engine, url: str, long_words: int) -> Runs:
    alone = tuple(ask(url, q, "alone") for q in QUESTIONS)
    wait_idle(engine)
    before = len(engine.recent())
    with ThreadPoolExecutor(len(QUESTIONS) + 3) as pool:
        longs = [pool.submit(long_client, url, i, long_words) for i in range(3)]
        batched = tuple(f.result() for f in [pool.submit(ask, url, q, "batched") for q in QUESTIONS])
        for f in longs:
            f.result()
    wait_idle(engine)
    size = max(m.batch_size_max for m in engine.recent()[before:] if m.output_tokens == NEW_TOKENS)
    no_reuse = tuple(ask(url, q, f"fresh-{i}") for i, q in enumerate(QUESTIONS))
    return Runs(alone, batched, no_reuse, size)


def max_difference(a: tuple[Answer, ...], b: tuple[Answer, ...]) -> float:
    """The largest difference between two runs' logprobs: chosen tokens' and the top lists'."""
    diffs = [abs(x - y) for p, q in zip(a, b, strict=True) for x, y in zip(p.logprobs, q.logprobs, strict=True)]
    diffs += [abs(x - y) for p, q in zip(a, b, strict=True) for s, t in zip(p.tops, q.tops, strict=True)
              for x, y in zip(s, t, strict=True)]
    return max(diffs)


def report(name: str, runs: Runs) -> dict[str, float]:
    found = {pair: max_difference(*answers) for pair, answers in runs.pairs().items()}
    print(f"\n[{name}] largest logprob difference (batched decode forwards of up to {runs.batch_size_max} rows): "
          + ", ".join(f"{pair}: {d:.3g}" for pair, d in found.items()))
    return found


def check_runs(name: str, runs: Runs) -> None:
    assert runs.batch_size_max > 1, "the batched run never batched: it proves nothing"
    assert all(a.cached_tokens > 0 for a in runs.alone[1:]), "the alone run reused the system prompt"
    assert all(a.cached_tokens == 0 for a in runs.no_reuse)
    found = report(name, runs)
    for pair, (a, b) in runs.pairs().items():
        assert [x.text for x in a] == [y.text for y in b], pair
        assert [x.ids for x in a] == [y.ids for y in b], pair
        assert [x.top_tokens for x in a] == [y.top_tokens for y in b], pair
        assert found[pair] <= TOLERANCE, (pair, found[pair])


def check_exact(runs: Runs, pair: str) -> None:
    a, b = runs.pairs()[pair]
    assert [x.logprobs for x in a] == [y.logprobs for y in b] and [x.tops for x in a] == [y.tops for y in b]


def runs_through_the_app(make_engine, runner, budget_mb: int, long_words: int) -> Runs:
    """The three runs through a launched app on an engine ``make_engine`` builds on ``runner``; the
    engine left clean."""
    engine = make_engine(runner, budget_bytes=budget_mb * 2**20, max_new_tokens_cap=NEW_TOKENS)
    with launched_app(engine) as url:
        runs = three_runs(engine, url, long_words=long_words)
    wait_idle(engine)
    assert_clean(engine)
    return runs


@pytest.fixture(scope="module")
def tiny_runs(tiny_runner, make_module_engine) -> Runs:
    return runs_through_the_app(make_module_engine, tiny_runner, 128, 300)


def test_alone_batched_and_without_reuse_agree(tiny_runs):
    check_runs("tiny float32", tiny_runs)


def exact_or_skip(runner) -> None:
    if not runner.runs_exact:
        pytest.skip("the exact forward does not run here (no C compiler, or a CPU without AVX2)")


@pytest.mark.parametrize("pair", PAIRS)
def test_logprobs_are_bit_identical_alone_batched_and_without_reuse(tiny_runner, tiny_runs, pair):
    exact_or_skip(tiny_runner)
    check_exact(tiny_runs, pair)


@pytest.fixture(scope="module")
def tiny_runs_bf16(tiny_runner_bf16, make_module_engine) -> Runs:
    return runs_through_the_app(make_module_engine, tiny_runner_bf16, 128, 300)


@pytest.mark.parametrize("pair", PAIRS)
def test_bfloat16_logprobs_are_bit_identical_too(tiny_runner_bf16, tiny_runs_bf16, pair):
    exact_or_skip(tiny_runner_bf16)
    report("tiny bfloat16", tiny_runs_bf16)
    a, b = tiny_runs_bf16.pairs()[pair]
    assert [x.text for x in a] == [y.text for y in b] and [x.ids for x in a] == [y.ids for y in b]
    check_exact(tiny_runs_bf16, pair)


@pytest.fixture(scope="module")
def real_runs(real_runner, make_module_engine) -> Runs:
    return runs_through_the_app(make_module_engine, real_runner, 512, 400)


@pytest.mark.slow
def test_real_model_alone_batched_and_without_reuse_agree(real_runs):
    check_runs("SmolLM2 float32", real_runs)


@pytest.mark.slow
@pytest.mark.parametrize("pair", PAIRS)
def test_real_model_logprobs_are_bit_identical_alone_batched_and_without_reuse(real_runner, real_runs, pair):
    exact_or_skip(real_runner)
    check_exact(real_runs, pair)
