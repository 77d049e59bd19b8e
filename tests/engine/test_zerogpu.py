"""ZeroGPU mode on its emulation (engine.zerogpu): each forward runs in a forked worker with its
input and output pickled, the tree and the pool stay in this process. Reuse across calls, the same
computation as the normal engine (torch.equal), a worker that dies or overruns, a spent quota."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.engine import Engine
from engine.kvcache.kv_pool import KVPool, contiguous_runs
from engine.model import sampling
from engine.model.paged_attention import PagedSegment
from engine.model.runner import RowFuture
from engine.types import EngineError, GenerationRequest, SamplingParams
from engine.zerogpu import emulation, step_call
from engine.zerogpu.detect import EMULATE, OFF, SPACES, zerogpu_mode
from engine.zerogpu.emulation import Quota, ZeroGPUError, gpu
from engine.zerogpu.runner import ZeroGPURunner
from tests.conftest import make_tiny_runner

# Each emulated call forks this process. A test process that has run many other tests holds gigabytes
# of allocations it never touched, and with no swap the kernel may refuse to fork it (ENOMEM, seen in
# CI): the tests that fork run in a fresh interpreter (test_forking_tests_in_a_fresh_process).
FRESH = os.environ.get("RADIX_ZEROGPU_FRESH_PROCESS") == "1"
forks = pytest.mark.skipif(not FRESH, reason="forks: run by test_forking_tests_in_a_fresh_process")

QUESTIONS = ["Our shop opens at nine. Question: when does it open?",
             "Our shop opens at nine. Question: when does it close?",
             "Our shop opens at nine. Question: is it open on Sunday?"]


@pytest.fixture(scope="module")
def runners(tokenizer):
    plain = make_tiny_runner(tokenizer)
    return plain, ZeroGPURunner(plain, EMULATE)


@pytest.mark.skipif(FRESH, reason="this is the fresh process")
def test_forking_tests_in_a_fresh_process():
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                         cwd=Path(__file__).resolve().parents[2], env={**os.environ, "RADIX_ZEROGPU_FRESH_PROCESS": "1"},
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert " passed" in last and "1 skipped" in last, out.stdout[-2000:]  # only this test is skipped there


def ask(engine: Engine, text: str, n: int = 8, logprobs: int | None = 2):
    ids = tuple(engine.text.encode(text))
    events = list(engine.submit(GenerationRequest(prompt_ids=ids, sampling=SamplingParams(max_new_tokens=n),
                                                  logprobs=logprobs)))
    return events[-1]


# ----------------------------------------------------------------------------- the emulation

def test_mode_is_read_from_the_environment():
    assert zerogpu_mode({}) == OFF
    assert zerogpu_mode({"SPACES_ZERO_GPU": "true"}) == SPACES
    assert zerogpu_mode({"SPACES_ZERO_GPU": "true", "RADIX_ZEROGPU": "0"}) == OFF
    assert zerogpu_mode({"RADIX_ZEROGPU": "emulate"}) == EMULATE


def _mutate_and_report(box: dict) -> tuple[int, int]:
    box["seen"] = True  # a change in the worker never reaches the caller
    return os.getpid(), len(box)


@forks
def test_a_call_runs_in_another_process_with_copies_in_and_out():
    box = {"a": 1}
    pid, n = gpu(_mutate_and_report, duration=5)(box)
    assert pid != os.getpid() and n == 2
    assert box == {"a": 1}
    assert emulation.CALLS[-1].duration_s == 5 and emulation.CALLS[-1].ok


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _sleep(seconds: float) -> None:
    import time

    time.sleep(seconds)


def _fail() -> None:
    raise ValueError("bad shapes")


@forks
def test_a_dead_worker_an_overrun_and_an_error_come_back_as_one_sentence():
    with pytest.raises(ZeroGPUError, match="died before it answered .*signal 9"):
        gpu(_die)()
    with pytest.raises(ZeroGPUError, match="GPU task aborted: the call ran past its 1 s duration"):
        gpu(_sleep, duration=lambda s: 1)(30)
    with pytest.raises(ZeroGPUError, match="ValueError: bad shapes"):
        gpu(_fail)()


@forks
def test_a_spent_quota_refuses_the_call_before_it_starts(monkeypatch):
    monkeypatch.setattr(emulation, "QUOTA", Quota(3.0))
    with pytest.raises(ZeroGPUError, match=r"exceeded your GPU quota \(60s requested vs. 3s left\)"):
        gpu(_mutate_and_report)({})
    gpu(_mutate_and_report, duration=2)({})  # a shorter ask still fits


# ---------------------------------------------------------------------- one forward as data

@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 60), min_size=1, max_size=12), min_size=1, max_size=4))
def test_the_local_numbering_keeps_every_run_and_every_shared_slot(rows):
    segments = [PagedSegment([1], len(r) - 1, r) for r in rows]
    local = step_call.local_numbering(segments)
    assert sorted(local.values()) == sorted(set(local.values()))  # one local slot per pool slot
    for r in rows:
        mapped = [local[s] for s in r]
        assert [n for _, _, n in contiguous_runs(r)] == [n for _, _, n in contiguous_runs(mapped)]


def _pool(runner, tokens: int = 2048) -> KVPool:
    return KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype, runner.device,
                  tokens * runner.kv_bytes_per_token)


@forks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_forward_in_a_call_is_the_same_computation_bit_for_bit(tokenizer, dtype):
    """A prompt, then two rows behind a shared prefix (one a chunk, one a decode row), then two
    decode rows: the logits and every KV byte written equal the plain runner's (torch.equal)."""
    plain = make_tiny_runner(tokenizer, dtype=dtype)
    zero = ZeroGPURunner(plain, EMULATE)
    ids = torch.randint(0, 1000, (700,), generator=torch.Generator().manual_seed(3)).tolist()
    outs = []
    for runner in (plain, zero):
        pool = _pool(runner)
        a, b, c = pool.alloc(600), pool.alloc(300), pool.alloc(50)
        got = [runner.forward_paged(pool, [PagedSegment(ids[:500], 0, a)]),
               runner.forward_paged(pool, [PagedSegment(ids[500:600], 500, a[:500] + b[:100]),
                                           PagedSegment(ids[600:603], 500, a[:500] + c[:3])]),
               runner.forward_paged(pool, [PagedSegment([5], 600, a[:500] + b[:101]),
                                           PagedSegment([7], 503, a[:500] + c[:4])]),
               runner.forward_paged(pool, [PagedSegment(ids[:40], 0, c[4:44])], every_position=True)]
        written = torch.tensor(a[:500] + b[:101] + c[:44])
        got += [torch.stack(pool.k)[:, :, written], torch.stack(pool.v)[:, :, written]]
        outs.append(got)
    assert zero.calls == 4
    for mine, theirs in zip(outs[1], outs[0], strict=True):
        assert torch.equal(mine, theirs)


@forks
def test_forwards_run_ahead_are_used_only_when_asked_for_exactly(tokenizer):
    """A decode call runs the next forwards ahead on its greedy guesses; the runner serves the
    next forward from them only when it is exactly that forward, else it calls again. Every
    logit and KV byte equals the plain runner's either way."""
    plain = make_tiny_runner(tokenizer)
    zero = ZeroGPURunner(plain, EMULATE)
    ids = torch.randint(0, 1000, (64,), generator=torch.Generator().manual_seed(5)).tolist()
    futures = (RowFuture(SamplingParams(max_new_tokens=20), (), 20),
               RowFuture(SamplingParams(max_new_tokens=20, repetition_penalty=1.3), (), 20))
    pools, rows = [], []
    for runner in (plain, zero):
        pool = _pool(runner, 256)
        a, b = pool.alloc(64 + 20), pool.alloc(20)
        runner.forward_paged(pool, [PagedSegment(ids, 0, a)])
        pools.append(pool)
        rows.append((a, a[:64] + b))

    def step(toks, past, ahead=None):
        out = []
        for runner, pool, (r1, r2) in zip((plain, zero), pools, rows, strict=True):
            out.append(runner.forward_paged(pool, [PagedSegment([toks[0]], past, r1), PagedSegment([toks[1]], past, r2)],
                                            ahead=ahead))
        assert torch.equal(out[0], out[1])
        return out[0]

    calls = zero.calls
    logits = step([11, 12], 64, futures)  # one call, which also runs ahead
    assert zero.calls == calls + 1 and len(zero._ahead) > 3
    guess = [int(logits[0].argmax()), sampling.sample(logits[1], futures[1].sampling, None, ())]
    logits = step(guess, 65)  # exactly the forward it guessed: no call
    assert zero.calls == calls + 1 and zero.reused_steps >= 1
    other = [int(logits[0].argmax()), (int(logits[1].argmax()) + 1) % 1000]  # the second row's token differs
    step(other, 66)  # not what it guessed: a new call, the rest dropped
    assert zero.calls == calls + 2 and not zero._ahead
    for p0, p1, (r1, r2) in zip(pools[:1], pools[1:], rows[:1], strict=True):
        written = torch.tensor(r1[:67] + r2[64:67])
        assert torch.equal(torch.stack(p0.k)[:, :, written], torch.stack(p1.k)[:, :, written])
        assert torch.equal(torch.stack(p0.v)[:, :, written], torch.stack(p1.v)[:, :, written])


@forks
def test_forwards_run_ahead_over_one_pool_never_serve_another(tokenizer):
    """Two engines on one runner (the lab's private engines) have pools of their own: the same ids at
    the same slot numbers in another pool are another computation, so they get a call of their own."""
    zero = ZeroGPURunner(make_tiny_runner(tokenizer), EMULATE)
    ids = list(range(10, 42))
    future = (RowFuture(SamplingParams(max_new_tokens=8), (), 8),)
    pools = [_pool(zero, 64), _pool(zero, 64)]
    slots = [pool.alloc(40) for pool in pools]
    logits = [zero.forward_paged(pool, [PagedSegment(ids, 0, s)]) for pool, s in zip(pools, slots, strict=True)]
    zero.forward_paged(pools[0], [PagedSegment([int(logits[0][0].argmax())], 32, slots[0])], ahead=future)
    calls = zero.calls
    guess = int(zero._ahead[0].segments[0].ids[0])
    zero.forward_paged(pools[1], [PagedSegment([guess], 33, slots[1])])
    assert zero.calls == calls + 1 and zero.reused_steps == 0


# --------------------------------------------------------------------------------- the engine

@forks
def test_the_second_call_reuses_the_first_calls_kv_and_answers_as_the_normal_engine(runners):
    plain, zero = runners
    normal, zerogpu = Engine(plain, budget_bytes=8 << 20), Engine(zero, budget_bytes=8 << 20)
    try:
        assert zerogpu.capabilities.prefill_timing is False and normal.capabilities.prefill_timing
        before = zero.calls
        for q in QUESTIONS:
            a, b = ask(normal, q), ask(zerogpu, q)
            assert b.metrics.output_ids == a.metrics.output_ids and b.text == a.text
            assert b.metrics.cached_tokens == a.metrics.cached_tokens
            assert [(t.token_id, t.logprob, t.top) for t in b.metrics.output_logprobs] == \
                   [(t.token_id, t.logprob, t.top) for t in a.metrics.output_logprobs]
        assert b.metrics.cached_tokens > 0  # served from KV that an earlier call computed
        assert zero.calls > before
        zerogpu.check_invariants()
        assert "GPU call" in zerogpu.info().forward and "ZeroGPU calls (emulated" in zerogpu.info().device
    finally:
        normal.close()
        zerogpu.close()


@forks
def test_concurrent_answers_with_loop_guards_equal_the_normal_engines_with_fewer_calls(runners):
    """Three requests decoding together (loop guards on, as the page asks; different lengths, so
    rows leave the batch mid-way): the same answers and log-probabilities as the normal engine,
    and most decode forwards served from calls that ran ahead."""
    plain, zero = runners
    guard = dict(no_repeat_ngram_size=3, repetition_penalty=1.3)

    def three(engine):
        with engine.runner.lock:  # all three are in the first step: the same batches on both engines
            handles = [engine.submit(GenerationRequest(
                prompt_ids=tuple(engine.text.encode(q)), logprobs=1,
                sampling=SamplingParams(max_new_tokens=n, **guard))) for q, n in zip(QUESTIONS, (5, 12, 24), strict=True)]
        return [list(h)[-1].metrics for h in handles]

    normal, zerogpu = Engine(plain, budget_bytes=8 << 20), Engine(zero, budget_bytes=8 << 20)
    try:
        expected = three(normal)
        calls, reused = zero.calls, zero.reused_steps
        got = three(zerogpu)
        for m, e in zip(got, expected, strict=True):
            assert m.output_ids == e.output_ids and m.cached_tokens == e.cached_tokens
            assert [(t.token_id, t.logprob) for t in m.output_logprobs] == \
                   [(t.token_id, t.logprob) for t in e.output_logprobs]
        assert zero.reused_steps - reused > zero.calls - calls  # more forwards came from ahead than from calls
        zerogpu.check_invariants()
    finally:
        normal.close()
        zerogpu.close()


@forks
def test_a_worker_that_dies_mid_call_fails_its_request_clearly_and_loses_nothing(runners, monkeypatch):
    plain, zero = runners
    engine = Engine(zero, budget_bytes=8 << 20)
    try:
        first = ask(engine, QUESTIONS[0])
        cached_before = engine.cache.num_tokens
        monkeypatch.setattr(step_call, "run", lambda runner, work: _die())  # the worker inherits the patch
        with pytest.raises(EngineError, match="GPU call did not finish: The GPU worker died"):
            ask(engine, QUESTIONS[1])
        engine.check_invariants()
        monkeypatch.undo()
        again = ask(engine, QUESTIONS[0])  # the tree still serves the first answer's prompt
        assert again.metrics.output_ids == first.metrics.output_ids and again.metrics.cached_tokens > 0
        assert engine.cache.num_tokens >= cached_before
        engine.check_invariants()
    finally:
        engine.close()


def test_a_spent_quota_reaches_the_visitor_as_a_sentence(runners, monkeypatch):
    _, zero = runners
    engine = Engine(zero, budget_bytes=8 << 20)
    try:
        monkeypatch.setattr(emulation, "QUOTA", Quota(0.5))
        with pytest.raises(EngineError, match="free GPU quota is used up"):
            ask(engine, QUESTIONS[2])
        engine.check_invariants()
    finally:
        engine.close()


@forks
def test_memory_stays_flat_over_many_calls(runners):
    """Each call's transfers are freed with it: after a warm-up, 12 more requests through the
    calls add no more than a few MiB to this process (the pool's budget is allocated at start)."""
    from tools.measure import rss_bytes

    _, zero = runners
    engine = Engine(zero, budget_bytes=8 << 20)
    try:
        for i in range(4):
            ask(engine, f"{QUESTIONS[i % 3]} Number {i}.", logprobs=None)
        start = rss_bytes()
        for i in range(12):
            ask(engine, f"{QUESTIONS[i % 3]} Visitor {i}.", logprobs=None)
        assert rss_bytes() - start < 16 * 2**20
        assert engine.cache.pool.bytes_in_use <= engine.cache.budget_bytes
        engine.check_invariants()
    finally:
        engine.close()


@forks
def test_the_chat_tells_the_visitor_why_an_answer_may_pause(runners):
    from components.panels.chat_panel import respond

    plain, zero = runners
    for runner, says in ((zero, True), (plain, False)):
        engine = Engine(runner, budget_bytes=8 << 20)
        try:
            assert engine.capabilities.gpu_calls is says
            first, *_, last = respond(engine, "Hello?", [], "Pirate", "", 4, True)
            assert ("waiting in ZeroGPU's queue" in first[3]) is says
            assert last[0][-1]["role"] == "assistant"
        finally:
            engine.close()


@forks
def test_the_app_builds_a_zerogpu_engine_when_asked(runners, monkeypatch):
    import app

    plain, _ = runners
    monkeypatch.setenv("RADIX_ZEROGPU", "emulate")
    engine = app.build_engine(app.parse_args([]), runner=plain)
    try:
        assert isinstance(engine.runner, ZeroGPURunner) and not engine.capabilities.prefill_timing
        assert ask(engine, QUESTIONS[0]).metrics.output_ids
    finally:
        engine.close()
