"""Request validation (engine/validation.py, Engine.prompt_ids/submit): bad input becomes a
human EngineError before anything touches the tokenizer's slow path, the model or the cache."""

from __future__ import annotations

import math
import time

import pytest

from engine import validation
from engine.model.sampling import sample
from engine.types import EngineError, GenerationRequest, SamplingParams
from engine.validation import valid_text


@pytest.fixture()
def engine(tiny_runner, make_engine):
    return make_engine(budget_bytes=64 * tiny_runner.kv_bytes_per_token * 64, max_new_tokens_cap=8)


def test_lone_surrogates_become_replacement_chars(tiny_runner):
    assert valid_text("a\ud800b") == "a\ufffdb"
    assert valid_text("ok 😀") == "ok 😀"
    assert tiny_runner.text.encode("a\udfffb") == tiny_runner.text.encode("a\ufffdb")


def test_max_token_chars_bounds_every_vocab_entry(tiny_runner):
    tok = tiny_runner.text.tokenizer
    assert all(len(tok.convert_tokens_to_string([t])) <= tiny_runner.text.max_token_chars for t in tok.get_vocab())


def test_one_megabyte_prompt_rejected_without_tokenizing(engine, monkeypatch):
    calls = []
    monkeypatch.setattr(engine.runner.text, "encode", lambda text: calls.append(text) or [1])
    t0 = time.perf_counter()
    for req in (GenerationRequest(prompt="a" * 2**20),
                GenerationRequest(messages=({"role": "user", "content": "\u200b" * 2**20},))):
        with pytest.raises(EngineError, match="characters long"):
            engine.submit(req)
    assert calls == []
    assert time.perf_counter() - t0 < 5  # generous: the point is no tokenizing, which the list shows


def test_size_bound_never_rejects_a_prompt_that_fits(engine):
    # The longest vocabulary entries packed to the limit still pass the character bound.
    validation.check_text_size(engine.max_prompt_tokens * engine.runner.text.max_token_chars,
                               engine.max_prompt_tokens, engine.runner.text.max_token_chars)


@pytest.mark.parametrize("messages", [
    "hello", {"role": "user", "content": "hi"}, (1, 2), ({"role": 5, "content": "hi"},),
    ({"role": "", "content": "hi"},), ({"role": "user", "content": object()},), (), ({"role": "user"},),
    ({"role": "user", "content": "hi"}, {"role": "user", "content": "  \n\t"}),
])
def test_malformed_messages_are_engine_errors(engine, messages):
    with pytest.raises(EngineError):
        engine.submit(GenerationRequest(messages=messages))


def test_message_content_parts_are_flattened(engine):
    parts = ({"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "image", "url": "x"}]},)
    assert engine.prompt_ids(GenerationRequest(messages=parts)) == \
        engine.prompt_ids(GenerationRequest(messages=({"role": "user", "content": "Hello"},)))


@pytest.mark.parametrize("ids", [("a",), (1.5,), (-1,), (10**9,), "123", (None,)])
def test_bad_token_ids_are_engine_errors(engine, ids):
    with pytest.raises(EngineError):
        engine.submit(GenerationRequest(prompt_ids=ids))


@pytest.mark.parametrize("prompt", [b"bytes", 12, ["a"]])
def test_non_text_prompt_is_engine_error(engine, prompt):
    with pytest.raises(EngineError):
        engine.submit(GenerationRequest(prompt=prompt))


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=math.nan), SamplingParams(max_new_tokens=math.inf),
    SamplingParams(temperature=math.nan), SamplingParams(top_p=-math.inf), SamplingParams(max_new_tokens="9"),
    SamplingParams(seed=2**64), SamplingParams(seed=-1), SamplingParams(seed=1.5), SamplingParams(seed=math.nan),
    None,
])
def test_non_numeric_sampling_is_engine_error(engine, params):
    with pytest.raises(EngineError):
        engine.submit(GenerationRequest(prompt="hello", sampling=params))


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=-5), SamplingParams(max_new_tokens=10**12), SamplingParams(max_new_tokens=3.7),
    SamplingParams(temperature=-3.0, top_p=0.0), SamplingParams(temperature=1e6, top_p=7.0, seed=2**63 - 1),
    SamplingParams(temperature=0.7, top_p=1e-9, seed=4.0), SamplingParams(temperature=1e-300, seed=1),
    SamplingParams(temperature=5e-324, top_p=1e-300, seed=2), SamplingParams(temperature=1e308, top_p=-1.0),
])
def test_absurd_but_numeric_sampling_runs_within_caps(engine, params):
    m = engine.run(GenerationRequest(prompt="hello there", sampling=params))
    assert 0 <= m.output_tokens <= engine.max_new_tokens_cap
    engine.check_invariants()
    assert engine.cache.locked_tokens() == 0


def test_surrogates_and_zero_width_run_end_to_end(engine):
    for text in ("\ud800", "x\udbff\udfff\ud800y", "\u200b\u200c\u200d\ufeff hi", "\x00\x01\x1b[31m", "👨‍👩‍👧‍👦🏳️‍🌈"):
        m = engine.run(GenerationRequest(prompt=text, sampling=SamplingParams(max_new_tokens=3)))
        assert m.prompt_tokens > 0
    engine.check_invariants()


def test_sampling_at_extreme_temperatures_stays_a_distribution(tiny_runner):
    """logits / 1e-300 overflows to inf and softmax to NaN: the runner shifts by the max
    first (same distribution) and falls back to greedy if anything is still not finite."""
    import torch

    logits = torch.randn(500, generator=torch.Generator().manual_seed(0)) * 5
    g = torch.Generator().manual_seed(1)
    assert sample(logits, SamplingParams(temperature=1e-300, seed=1), g) == int(logits.argmax())
    picks = {sample(logits, SamplingParams(temperature=1e308), g) for _ in range(50)}
    assert len(picks) > 10  # a huge temperature is close to uniform


def test_over_long_text_refused_after_tokenizing_a_bounded_prefix(engine, monkeypatch):
    """The attack: a text just under the character bound (max_token_chars per allowed token,
    about 660,000 characters on the real model) was tokenized in full before being refused."""
    limit, per_token = engine.max_prompt_tokens, engine.runner.text.max_token_chars
    real_encode = engine.runner.text.encode
    tokenized: list[int] = []
    monkeypatch.setattr(engine.runner.text, "encode", lambda text: tokenized.append(len(text)) or real_encode(text))
    text = ("word " * (limit * per_token))[: limit * per_token - 1]  # passes the character bound
    for req in (GenerationRequest(prompt=text), GenerationRequest(messages=({"role": "user", "content": text},))):
        tokenized.clear()
        with pytest.raises(EngineError, match="limit"):
            engine.submit(req)
        assert 0 < sum(tokenized) <= (limit + 20) * validation.PREFIX_CHARS_PER_TOKEN


@pytest.mark.parametrize("unit", ["word ", "        x", " " * 80 + "\n", "漢字 ", "🎉 ", "a" * 30 + "\n\n"])
def test_prefix_bound_never_rejects_a_prompt_that_fits(tiny_runner, unit):
    text = unit * 4_000
    n = len(tiny_runner.text.encode(text))
    validation.check_text_tokens([text], n, tiny_runner.text.max_token_chars, tiny_runner.text.encode)  # exactly at the limit
    halves = [text[: len(text) // 2], text[len(text) // 2:]]
    n2 = len(tiny_runner.text.encode(halves[0])) + len(tiny_runner.text.encode(halves[1]))
    validation.check_text_tokens(halves, n2, tiny_runner.text.max_token_chars, tiny_runner.text.encode)


def test_token_pieces_is_linear_and_exact(tiny_runner, monkeypatch):
    """Colouring a prompt decoded growing prefixes: n^2/2 tokens decoded for n tokens."""
    text = "Hello, world! 漢字テスト 🎉🎉 naïve café  spaced   out.\n\n  code: x = [1, 2]  " * 40
    ids = tiny_runner.text.encode(text)
    real_decode = tiny_runner.text.decode
    decoded: list[int] = []
    monkeypatch.setattr(tiny_runner.text, "decode", lambda i: decoded.append(len(i)) or real_decode(i))
    pieces = tiny_runner.text.token_pieces(ids)
    assert len(pieces) == len(ids) and "".join(pieces) == real_decode(ids)
    assert sum(decoded) <= 20 * len(ids), f"{sum(decoded):,} tokens decoded for {len(ids):,}"
    assert pieces[ids.index(tiny_runner.text.encode(" 🎉")[0])] == ""  # a split character shows on its last token
