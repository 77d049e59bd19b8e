"""The chat's reuse check on the tiny model: the visitor's last prompt runs again with reuse and
without (a fresh namespace of theirs, nothing shareable), greedy, with logprobs, compared exactly;
the cold run's KV is cleared, and neither run counts in the playground's figures."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from analysis.reuse_check import ReuseCheck, check_reuse, compare, logprob_digest
from components.panels.common import playground_history
from components.panels.reuse_check_panel import check_markdown, check_requests, run_check
from components.session import page_keyed
from engine.engine import Engine
from engine.types import EngineError, GenerationRequest, RequestMetrics, SamplingParams, TokenLogprob

VISITOR = SimpleNamespace(session_hash="session-reuse-check", headers={}, client=SimpleNamespace(host="127.0.0.1"))


@pytest.fixture(params=[False, True], ids=["shared", "isolated"])
def engine(request, make_engine):
    e = make_engine(isolation=request.param, max_new_tokens_cap=32)
    yield e


def _ask(engine: Engine, prompt_ids: tuple[int, ...]) -> RequestMetrics:
    base = GenerationRequest(prompt_ids=prompt_ids, sampling=SamplingParams(max_new_tokens=4), tag="chat")
    return engine.run(page_keyed(engine, base, VISITOR).request(base))


def test_the_check_reruns_the_last_prompt_with_reuse_and_without(engine):
    ids = tuple(range(200, 290))
    _ask(engine, ids)
    last = _ask(engine, ids + (7, 8, 9))  # the visitor's last answer: most of it reused
    with_reuse, without = check_requests(engine, last, VISITOR)
    assert with_reuse.namespace == last.namespace and without.namespace != last.namespace
    assert without.public_len == 0 and without.prompt_ids == with_reuse.prompt_ids == tuple(last.prompt_ids)
    c = check_reuse(engine, with_reuse, without, new_tokens=12)
    assert c.fair and c.reused_tokens >= 90 and c.new_tokens == 12
    runs = engine.recent()[-2:]
    assert [m.tag for m in runs] == ["reuse-check", "reuse-check"]
    assert c == compare(*runs)  # the verdict is what the two runs' own logprobs say
    assert c.same_tokens  # float32: the same greedy tokens (the logprobs may differ in the last bits)
    assert c.reuse_digest == logprob_digest([t.logprob for t in runs[0].output_logprobs])
    assert not any(m.tag == "reuse-check" for m in playground_history(engine, namespace=None))


def test_the_page_handler_clears_the_cold_run_and_says_what_it_found(engine):
    ids = tuple(range(300, 360))
    last = _ask(engine, ids)
    text = run_check(engine, last, VISITOR)
    assert ("Identical, bit for bit" in text) or ("not bit for bit" in text), text
    cold = engine.recent()[-1]
    assert cold.cached_tokens == 0 and cold.namespace.startswith(last.namespace) and cold.namespace != last.namespace
    assert not [n for n in engine.snapshot().nodes if n.namespace == cold.namespace]  # cleared
    engine.check_invariants()
    assert "Send a message first" in run_check(engine, None, VISITOR)


def _metrics(ids: list[int], logprobs: list[float], cached: int) -> RequestMetrics:
    m = RequestMetrics.__new__(RequestMetrics)
    object.__setattr__(m, "output_ids", ids)
    object.__setattr__(m, "output_logprobs", [TokenLogprob(t, lp) for t, lp in zip(ids, logprobs, strict=True)])
    object.__setattr__(m, "cached_tokens", cached)
    return m


def test_compare_is_exact():
    a = _metrics([1, 2, 3], [-0.5, -1.25, -2.0], 40)
    same = compare(a, _metrics([1, 2, 3], [-0.5, -1.25, -2.0], 0))
    assert same.identical_logprobs and same.same_tokens and same.first_difference is None and same.fair
    assert "Identical, bit for bit" in check_markdown(same)
    close = compare(a, _metrics([1, 2, 3], [-0.5, -1.2500001, -2.0], 0))
    assert not close.identical_logprobs and close.same_tokens and close.first_difference == 1
    assert 0 < close.max_logprob_diff < 1e-6 and "not bit for bit" in check_markdown(close)
    parted = compare(a, _metrics([1, 5, 3], [-0.5, -1.3, -9.0], 0))
    assert not parted.same_tokens and parted.first_difference == 1 and parted.max_logprob_diff == pytest.approx(0.05)
    assert "part ways at token 2" in check_markdown(parted)
    unfair = compare(a, _metrics([1, 2, 3], [-0.5, -1.25, -2.0], 17))
    assert not unfair.fair and "no comparison" in check_markdown(unfair)
    assert isinstance(same, ReuseCheck)


def test_the_check_needs_the_same_prompt_on_both_sides(engine):
    a = GenerationRequest(prompt_ids=(1, 2, 3))
    with pytest.raises(EngineError, match="same prompt"):
        check_reuse(engine, a, GenerationRequest(prompt_ids=(1, 2, 4)))
