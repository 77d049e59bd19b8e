"""Log-probabilities in the engine: the pure function over logits rows, and requests that ask for
them on the tiny random model, checked against the runner's own teacher-forced forward."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from engine.engine import Engine
from engine.model.logprobs import ROWS_PER_BLOCK, logprobs_of, token_logprob
from engine.model.sampling import sample
from engine.types import EngineError, GenerationEvent, GenerationRequest, SamplingParams, TokenLogprob

PROMPT = "The radix tree keeps every prompt it has seen, so the next request can reuse it."


# ------------------------------------------------------------------ the pure function
def test_logprobs_are_the_float32_log_softmax_of_the_row():
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 4
    out = logprobs_of(logits, [7, 0, 49], top=5)
    ref = torch.log_softmax(logits.float(), dim=-1)
    for row, (entry, tok) in enumerate(zip(out, [7, 0, 49], strict=True)):
        assert entry.token_id == tok and entry.logprob == ref[row, tok].item()
        values, ids = torch.topk(ref[row], 5)
        assert entry.top == tuple(zip(ids.tolist(), values.tolist(), strict=True))
        assert [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)
        assert sum(math.exp(v) for _, v in entry.top) <= 1.0 + 1e-6


def test_the_greedy_token_is_the_top_one_and_zero_alternatives_is_empty():
    torch.manual_seed(1)
    row = torch.randn(1000)
    tok = sample(row, SamplingParams(temperature=0), None)
    entry = token_logprob(row, tok, top=20)
    assert entry.top[0] == (tok, entry.logprob) and len(entry.top) == 20
    assert token_logprob(row, tok, top=0).top == ()
    assert sum(math.exp(v) for _, v in token_logprob(row, tok, top=1000).top) == pytest.approx(1.0, abs=1e-5)


def test_long_prompts_are_scored_in_blocks_with_the_same_values():
    torch.manual_seed(2)
    logits = torch.randn(ROWS_PER_BLOCK * 2 + 5, 64)
    ids = torch.randint(0, 64, (logits.shape[0],)).tolist()
    blocked = logprobs_of(logits, ids, top=2)
    alone = [token_logprob(logits[i], t, top=2) for i, t in enumerate(ids)]
    assert blocked == alone  # a row's values do not depend on the rows scored with it


def test_bfloat16_rows_are_widened_first():
    logits = (torch.randn(2, 30) * 3).to(torch.bfloat16)
    out = logprobs_of(logits, [1, 2], top=1)
    assert out[0].logprob == torch.log_softmax(logits.float(), dim=-1)[0, 1].item()


def test_mismatched_rows_are_a_bug():
    with pytest.raises(ValueError):
        logprobs_of(torch.zeros(2, 5), [1], top=0)


# ------------------------------------------------------------------ through the engine
@pytest.fixture(scope="module")
def engine(make_module_engine):
    e = make_module_engine(budget_bytes=32 * 2**20, max_new_tokens_cap=32)
    yield e


def run(engine: Engine, **kw) -> tuple[list[GenerationEvent], GenerationEvent]:
    events = list(engine.generate(GenerationRequest(prompt=PROMPT, sampling=SamplingParams(max_new_tokens=8,
                                                                                           ignore_eos=True), **kw)))
    return events[:-1], events[-1]


def teacher_forced(runner, ids: list[int]) -> torch.Tensor:
    """The runner's own forward over ``ids`` at once (a scratch buffer, no cache): log-softmax rows."""
    logits = runner.forward(ids, runner.new_request_kv(len(ids) + 1))
    return torch.log_softmax(logits.float(), dim=-1)


def test_output_logprobs_match_the_runners_own_forward(engine, tiny_runner):
    events, done = run(engine, logprobs=5)
    tokens = [e for e in events if e.token_id is not None]
    assert [e.logprob.token_id for e in tokens] == done.metrics.output_ids
    assert done.metrics.output_logprobs == [e.logprob for e in tokens]
    ids = done.metrics.prompt_ids + done.metrics.output_ids
    ref = teacher_forced(tiny_runner, ids)
    p = len(done.metrics.prompt_ids)
    for i, e in enumerate(tokens):
        row = ref[p - 1 + i]
        assert e.logprob.logprob == pytest.approx(row[e.token_id].item(), abs=1e-4)
        assert e.logprob.top[0][0] == e.token_id  # greedy: the chosen token is the most likely
        assert [t for t, _ in e.logprob.top] == torch.topk(row, 5).indices.tolist()
        assert sum(math.exp(v) for _, v in e.logprob.top) <= 1.0


def test_prompt_logprobs_match_and_reuse_nothing(engine, tiny_runner):
    engine.run(GenerationRequest(prompt=PROMPT, sampling=SamplingParams(max_new_tokens=2)))  # now cached
    events, done = run(engine, logprobs=0, prompt_logprobs=3)
    scored = [e for e in events if e.prompt_logprobs is not None]
    assert len(scored) == 1 and events.index(scored[0]) < min(i for i, e in enumerate(events) if e.token_id)
    prompt = scored[0].prompt_logprobs
    ids = done.metrics.prompt_ids
    assert len(prompt) == len(ids) and prompt[0] is None
    assert [e.token_id for e in prompt[1:]] == ids[1:]
    assert done.metrics.cached_tokens == 0  # every position's logits are its own
    ref = teacher_forced(tiny_runner, ids)
    for pos in range(1, len(ids)):
        assert prompt[pos].logprob == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4)
        assert len(prompt[pos].top) == 3
    # and the answer is the one a request without any of it gets
    assert done.metrics.output_ids == run(engine)[1].metrics.output_ids


def test_prompt_logprobs_over_several_chunks(tiny_runner, make_engine):
    e = make_engine(budget_bytes=16 * 2**20, chunk_tokens=5)
    events, done = run(e, prompt_logprobs=0)
    prompt = next(ev.prompt_logprobs for ev in events if ev.prompt_logprobs is not None)
    assert done.metrics.prefill_chunks > 3
    ref = teacher_forced(tiny_runner, done.metrics.prompt_ids)
    ids = done.metrics.prompt_ids
    assert all(prompt[p].logprob == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)
               for p in range(1, len(ids)))


def test_requests_without_logprobs_carry_none(engine):
    events, done = run(engine)
    assert all(e.logprob is None and e.prompt_logprobs is None for e in events)
    assert done.metrics.output_logprobs is None


@pytest.mark.parametrize("kw", [{"logprobs": 21}, {"logprobs": -1}, {"logprobs": True}, {"prompt_logprobs": 2.5},
                                {"prompt_logprobs": "3"}])
def test_bad_counts_are_refused(engine, kw):
    with pytest.raises(EngineError, match="from 0 to 20"):
        engine.submit(GenerationRequest(prompt=PROMPT, **kw))


def test_token_logprob_is_plain_data():
    entry = TokenLogprob(3, -0.5, ((3, -0.5),))
    assert entry == TokenLogprob(3, -0.5, ((3, -0.5),)) and hash(entry)


# ------------------------------------------------------------------ each token's own text and bytes
def test_byte_level_alphabet_is_a_bijection_onto_the_256_bytes():
    from engine.text.token_bytes import byte_level_alphabet

    table = byte_level_alphabet()
    assert len(table) == 256 and sorted(table.values()) == list(range(256))
    assert table["a"] == ord("a") and table["Ġ"] == ord(" ")  # GPT-2's space


def test_token_bytes_join_to_the_utf8_even_where_a_token_splits_a_character(engine):
    text = "héllo 日本 naïve <|im_end|>"
    ids = engine.encode(text)
    shown = engine.token_texts(ids)
    assert any("\ufffd" in t for t, _ in shown)  # decoded alone, a split character shows U+FFFD
    assert b"".join(b for _, b in shown) == text.encode("utf-8")
    assert [t for t, _ in shown] == [engine.decode([i]) for i in ids]


def test_prompt_logprobs_where_attention_cannot_read_the_pool(tokenizer, tiny_runner, make_engine):
    """A model that runs its own attention on gathered KV (sliding windows, soft-capping) keeps every
    position's logits too (``ModelRunner._forward_gathered``)."""
    from tests.conftest import make_tiny_runner

    gathered = make_tiny_runner(tokenizer)  # the same weights (seed 0) as ``tiny_runner``
    gathered.plan, gathered.stack = dataclasses.replace(gathered.plan, layers="gathered"), None
    e = make_engine(gathered, budget_bytes=16 * 2**20, chunk_tokens=7)
    try:
        events, done = run(e, logprobs=2, prompt_logprobs=2)
        prompt = next(ev.prompt_logprobs for ev in events if ev.prompt_logprobs is not None)
        ids = done.metrics.prompt_ids
        ref = teacher_forced(tiny_runner, ids)
        assert len(prompt) == len(ids) and done.metrics.prefill_chunks > 2
        assert all(prompt[p].logprob == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4) for p in range(1, len(ids)))
    finally:
        e.close()
        gathered.close()
