"""ZeroGPU mode's engine side, with the calls made in this process (no ``spaces``, no fork): a turn's
call body and the step call are the same computation as the plain engine (``torch.equal``), a
turn goes on in a new call when the scheduler asks another forward than the one it computed, a
request that leaves has its call closed, and what each call asks for. The real ``spaces`` package
and its forked workers, on the Space line: ``tests/app/test_zerogpu_page.py``."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.engine import Engine
from engine.kvcache.kv_pool import KVPool, contiguous_runs
from engine.model.paged_attention import PagedSegment
from engine.types import GenerationRequest, SamplingParams
from engine.zerogpu import step_call, turn_call
from engine.zerogpu.detect import OFF, SPACES, zerogpu_mode
from engine.zerogpu.runner import MAX_S, turn_duration_s
from engine.zerogpu.turns import TurnScheduler, as_visitor_fault
from tests.conftest import make_tiny_runner

QUESTIONS = ["Our shop opens at nine. Question: when does it open?",
             "Our shop opens at nine. Question: when does it close?",
             "Our shop opens at nine. Question: is it open on Sunday?"]


class InProcessTurns:
    """``ZeroGPURunner``'s shape with each call's body run right here, as a plain generator: what
    ``spaces`` adds around it (the schedule, the fork, pickling) is tests/zerogpu's to show."""

    in_process_forwards = False
    scheduler_class = TurnScheduler

    def __init__(self, inner) -> None:
        self.inner = inner
        self.started: list[turn_call.TurnWork] = []
        self.closed = 0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def turn_call(self, work: turn_call.TurnWork):
        self.started.append(work)
        body = turn_call.run(self.inner, work)
        try:
            yield from body
        finally:
            self.closed += 1


class LogitsLog:
    """The logits rows each request's tokens were picked from."""

    def __init__(self, engine: Engine) -> None:
        self.rows: dict[int, list[torch.Tensor]] = {}
        take = engine.scheduler.post._take_token

        def logged(r, logits):
            self.rows.setdefault(r.request_id, []).append(logits.clone())
            return take(r, logits)

        engine.scheduler.post._take_token = logged

    def of(self, request_id: int) -> torch.Tensor:
        return torch.stack(self.rows[request_id])


def _requests(engine: Engine) -> list[GenerationRequest]:
    guard = dict(no_repeat_ngram_size=4, repetition_penalty=1.1)
    return [GenerationRequest(prompt_ids=tuple(engine.text.encode(q * 3)),
                              sampling=SamplingParams(max_new_tokens=10, temperature=0.8 if i == 1 else 0.0, seed=7,
                                                      **guard))
            for i, q in enumerate(QUESTIONS)]


def _run(engine: Engine, together: bool) -> list[int]:
    """The three requests, one after another or all at once; their request ids."""
    reqs = _requests(engine)
    if together:
        handles = [engine.submit(r) for r in reqs]
        return [list(h)[-1].metrics.request_id for h in handles]
    return [list(engine.submit(r))[-1].metrics.request_id for r in reqs]


def test_mode_is_read_from_the_environment():
    assert zerogpu_mode({}) == OFF
    assert zerogpu_mode({"SPACES_ZERO_GPU": "true"}) == SPACES
    assert zerogpu_mode({"SPACES_ZERO_GPU": "true", "RADIX_ZEROGPU": "0"}) == OFF


def test_each_turn_is_one_call_and_the_same_computation_as_the_plain_engine(tokenizer, make_engine):
    """One after another: one call per turn, no restart; the second and third turns are served
    from the first's KV, which came back from its call; every logits row equal, bit for bit."""
    turns = InProcessTurns(make_tiny_runner(tokenizer))
    zero, plain = make_engine(turns, chunk_tokens=8), make_engine(make_tiny_runner(tokenizer), chunk_tokens=8)
    zlog, plog = LogitsLog(zero), LogitsLog(plain)
    zids, pids = _run(zero, together=False), _run(plain, together=False)
    assert len(turns.started) == 3 and zero.scheduler.restarts == 0
    assert turns.closed == 3 and not zero.scheduler.turns  # each call closed when its request left
    records = {m.request_id: m for m in zero.recent()}
    assert records[zids[1]].cached_tokens > 0 and records[zids[2]].cached_tokens > 0
    for z, p in zip(zids, pids, strict=True):
        assert torch.equal(zlog.of(z), plog.of(p))


def test_batched_turns_that_go_another_way_go_on_in_new_calls_with_the_same_answer(tokenizer, make_engine):
    """All three at once, with a small chunk: the scheduler splits the prompts among the rows in
    ways a lone call cannot guess; each wrong guess is dropped and the turn goes on in a new call
    from the pool's KV; every logits row still equals the plain engine's."""
    turns = InProcessTurns(make_tiny_runner(tokenizer))
    zero = make_engine(turns, chunk_tokens=16, max_batch=3)
    plain = make_engine(make_tiny_runner(tokenizer), chunk_tokens=16, max_batch=3)
    zlog, plog = LogitsLog(zero), LogitsLog(plain)
    zids, pids = _run(zero, together=True), _run(plain, together=True)
    for z, p in zip(zids, pids, strict=True):
        assert torch.equal(zlog.of(z), plog.of(p))
    assert len(turns.started) == 3 + zero.scheduler.restarts
    assert turns.closed == len(turns.started) and not zero.scheduler.turns


def test_a_stopped_request_has_its_call_closed(tokenizer, make_engine):
    turns = InProcessTurns(make_tiny_runner(tokenizer))
    zero = make_engine(turns)
    handle = zero.submit(GenerationRequest(prompt_ids=tuple(range(5, 40)),
                                           sampling=SamplingParams(max_new_tokens=500, ignore_eos=True)))
    for event in handle:
        if event.phase == "decode":
            handle.cancel()
    assert turns.closed == len(turns.started) == 1 and not zero.scheduler.turns


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 60), min_size=1, max_size=12), min_size=1, max_size=4))
def test_the_local_numbering_keeps_every_run_and_every_shared_slot(rows):
    segments = [PagedSegment([1], len(r) - 1, r) for r in rows]
    local = step_call.local_numbering(segments)
    assert sorted(local.values()) == sorted(set(local.values()))  # one local slot per pool slot
    for r in rows:
        mapped = [local[s] for s in r]
        assert [n for _, _, n in contiguous_runs(r)] == [n for _, _, n in contiguous_runs(mapped)]


def test_a_forward_outside_any_turn_is_the_same_computation(tokenizer):
    """``step_call``: a prompt, then two rows behind a shared prefix, packed, run on a pool of
    their own, applied back: the same logits and KV as ``forward_paged`` on the pool itself."""
    runner = make_tiny_runner(tokenizer)
    pools = [KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype, runner.device,
                    256 * runner.kv_bytes_per_token) for _ in range(2)]
    slots = [p.alloc(40) for p in pools]
    ids = list(range(5, 37))
    for pool, s in zip(pools, slots, strict=True):
        pool.alloc(3)  # a gap: the second row's slots are not next to the first's
        s += pool.alloc(8)
    seg = [PagedSegment(ids, 0, slots[i], contiguous_runs(slots[i])) for i in range(2)]
    direct = runner.forward_paged(pools[0], [seg[0]])
    work, local = step_call.pack(pools[1], [seg[1]])
    called = step_call.apply(pools[1], {v: k for k, v in local.items()}, step_call.run(runner, work))
    assert torch.equal(direct, called)
    rows = [PagedSegment([40, 41], 32, slots[i], contiguous_runs(slots[i])) for i in range(2)]
    direct = runner.forward_paged(pools[0], [rows[0]])
    work, local = step_call.pack(pools[1], [rows[1]])
    called = step_call.apply(pools[1], {v: k for k, v in local.items()}, step_call.run(runner, work))
    assert torch.equal(direct, called)
    k0, v0, k1, v1 = (torch.empty(runner.num_layers, runner.num_kv_heads, 34, runner.head_dim) for _ in range(4))
    pools[0].read_into(slots[0][:34], k0, v0)
    pools[1].read_into(slots[1][:34], k1, v1)
    assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_a_starter_question_asks_for_a_few_seconds():
    """A starter question behind the cached handbook on the Space's model (SmolLM2-1.7B: 24 layers,
    32 KV heads of 64, bf16): 17 prompt tokens computed, 96 new, the handbook's KV in."""
    per_token = 2 * 24 * 32 * 64 * 2
    kv = torch.empty((24, 32, 2303, 64), dtype=torch.bfloat16)
    work = turn_call.TurnWork(ids=tuple(range(17)), first=17, past=2303, slots=tuple(range(2320 + 96)),
                              num_slots=2320 + 96,
                              k=kv, v=kv, chunk_tokens=2048, sampling=SamplingParams(), history=(),
                              generator_state=None, max_new_tokens=96, eos_ids=frozenset({2}),
                              kv_bytes_per_token=per_token)
    assert work.nbytes == 2303 * per_token
    asked = turn_duration_s(work)
    assert asked <= 6 and 120 // asked >= 20, asked  # an unauthenticated visitor's 2 minutes: 20 turns and more
    assert turn_duration_s(work.__class__(**{**work.__dict__, "max_new_tokens": 10_000})) == MAX_S


def test_a_failed_call_is_one_sentence():
    quota = RuntimeError("You have exceeded your ZeroGPU quota (6s requested vs. 2s left). Try again in 1:00:00. "
                         "Authenticate with a Hugging Face token for more quota - https://hf.co/settings/tokens")
    text = str(as_visitor_fault(quota))
    assert "asks for 6 s" in text and "2 s left" in text and ". " not in text
    aborted = RuntimeError("GPU task aborted")
    assert str(as_visitor_fault(aborted)) == "The GPU worker stopped in the middle of this answer; please ask again."
