"""Issue 44: a row's logits and the KV it writes are the same bits whatever its batch, its chunking
and the cache (``torch.equal``, never a tolerance), in float32 and bfloat16, on this machine's
native kernels (``engine.model.attention.exact``).

The model-based test runs random schedules on the tiny model: requests of random lengths (some past
the attention's 256-key blocks), some reusing another's cached prefix in place, prefill chunks of
random sizes, decode rows joining and leaving, slots scattered over the pool, a request's KV moved
to other slots mid-way (what a second-tier load does to the pool); then checks every
logit row it got and every KV slot it wrote against the same request run alone, from nothing, in
one forward over contiguous slots."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.kvcache.kv_pool import KVPool
from engine.model.paged_attention import PagedSegment

POOL_TOKENS = 3000


@pytest.fixture(params=["float32", "bfloat16"])
def runner(request):
    r = request.getfixturevalue("tiny_runner" if request.param == "float32" else "tiny_runner_bf16")
    if not r.runs_exact:
        pytest.skip("the exact forward does not run here (no C compiler, or a CPU without AVX2)")
    return r


def new_pool(runner, tokens: int = POOL_TOKENS) -> KVPool:
    return KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype, runner.device,
                  tokens * runner.kv_bytes_per_token)


def alone(runner, ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Every position's logits of ``ids`` run alone, from nothing, in one forward; and its KV per layer."""
    pool = new_pool(runner, len(ids) + 1)
    slots = pool.alloc(len(ids))
    logits = runner.forward_paged(pool, [PagedSegment(ids, 0, slots)], every_position=True)
    index = torch.tensor(slots)
    return logits, [k[:, index] for k in pool.k], [v[:, index] for v in pool.v]


def scattered(pool: KVPool, n: int, gen: torch.Generator) -> list[int]:
    """``n`` free slots in a random order (the pool after many evictions)."""
    got = pool.alloc(n)
    order = torch.randperm(n, generator=gen).tolist()
    return [got[i] for i in order]


@st.composite
def schedules(draw):
    n_req = draw(st.integers(1, 4))
    lengths = [draw(st.integers(1, 560)) for _ in range(n_req)]
    # request i may reuse a prefix of request j < i (the tree's slots, read in place)
    reuse = [None] + [draw(st.one_of(st.none(), st.integers(0, i - 1))) for i in range(1, n_req)]
    seed = draw(st.integers(0, 2**16))
    chunk_sizes = draw(st.lists(st.integers(1, 300), min_size=1, max_size=6))
    picks = draw(st.lists(st.integers(0, 2**10), min_size=1, max_size=40))
    moves = draw(st.frozensets(st.integers(1, 40), max_size=4))
    return lengths, reuse, seed, chunk_sizes, picks, moves


def move_kv(pool: KVPool, table: list[int], done: int, gen: torch.Generator) -> list[int]:
    """A second-tier load, as the pool sees it: the first ``done`` positions' KV, byte for byte, in other
    slots (the old ones stay as they were: another request may read them in place); the new table."""
    fresh = scattered(pool, len(table), gen)
    src, dst = torch.tensor(table[:done]), torch.tensor(fresh[:done])
    for k, v in zip(pool.k, pool.v, strict=True):
        k[:, dst] = k[:, src]
        v[:, dst] = v[:, src]
    return fresh


def run_schedule(runner, lengths, reuse, seed, chunk_sizes, picks, moves=frozenset()):
    """Run the schedule; returns per request its ids, its slot table, and the logits it got by position.
    At the steps in ``moves``, the first request under way has its KV so far moved to other slots (a
    second-tier load) and goes on from there."""
    gen = torch.Generator().manual_seed(seed)
    vocab = len(runner.text.tokenizer)
    ids = [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in lengths]
    pool = new_pool(runner)
    tables, done, got = [], [], []
    for i, n in enumerate(lengths):
        shared = 0
        j = reuse[i]
        if j is not None:  # the same first tokens as request j: its slots, once it has computed them
            shared = min(n - 1, lengths[j], int(torch.randint(0, max(1, lengths[j]), (1,), generator=gen)))
            ids[i][:shared] = ids[j][:shared]
        tables.append(None if shared == 0 else ("reuse", j, shared))
        done.append(0)
        got.append({})
    for i, n in enumerate(lengths):  # resolve slot tables: a reusing request reads the other's slots
        if tables[i] is None:
            tables[i] = scattered(pool, n, gen)
    lenders = set()  # requests whose slots another reads in place: their KV stays where it is (the tree's)
    for i, n in enumerate(lengths):
        if isinstance(tables[i], tuple):
            _, j, shared = tables[i]
            base = tables[j] if not isinstance(tables[j], tuple) else None
            if base is None:
                tables[i] = scattered(pool, n, gen)
                continue
            tables[i] = base[:shared] + scattered(pool, n - shared, gen)
            done[i] = -shared  # may start only once request j has computed those tokens
            lenders.add(j)
    step = 0
    while any(d < len(ids[i]) for i, d in enumerate(done)):
        step += 1
        ready = []
        for i, d in enumerate(done):
            if d >= len(ids[i]):
                continue
            if d < 0:  # waiting for its reused prefix: it starts after it, with the prefix as its past
                j = reuse[i]
                if done[j] >= -d:
                    done[i] = d = -d
                else:
                    continue
            ready.append(i)
        if not ready:  # a request waits on a prefix that is never computed here: give up on reuse
            for i, d in enumerate(done):
                if d < 0:
                    done[i] = 0
            continue
        if step in moves:
            going = [i for i in ready if done[i] > 0 and i not in lenders]
            if going:
                tables[going[0]] = move_kv(pool, tables[going[0]], done[going[0]], gen)
        pick = picks[step % len(picks)]
        members = [i for k, i in enumerate(ready) if (pick >> k) & 1] or ready[:1]
        segments, spans = [], []
        for k, i in enumerate(members):
            d = done[i]
            size = min(len(ids[i]) - d, chunk_sizes[(step + k) % len(chunk_sizes)])
            segments.append(PagedSegment(ids[i][d:d + size], d, tables[i]))
            spans.append((i, d, size))
        every = len(segments) == 1
        logits = runner.forward_paged(pool, segments, every_position=every)
        for row, (i, d, size) in enumerate(spans):
            if every:
                for p in range(size):
                    got[i][d + p] = logits[p]
            else:
                got[i][d + size - 1] = logits[row]
            done[i] = d + size
    return ids, tables, got, pool


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=schedules())
def test_any_schedule_gives_every_row_its_bits_alone(runner, case):
    assert_every_row_alone(runner, *run_schedule(runner, *case))


def assert_every_row_alone(runner, ids, tables, got, pool) -> None:
    """Every logit row a schedule got and every KV slot it wrote, ``torch.equal`` to the request alone."""
    for i, seq in enumerate(ids):
        ref, ref_k, ref_v = alone(runner, seq)
        for p, row in got[i].items():
            assert torch.equal(row, ref[p]), f"request {i} position {p}: {(row - ref[p]).abs().max()}"
        index = torch.tensor(tables[i])
        for layer in range(runner.num_layers):
            assert torch.equal(pool.k[layer][:, index], ref_k[layer]), f"request {i} keys, layer {layer}"
            assert torch.equal(pool.v[layer][:, index], ref_v[layer]), f"request {i} values, layer {layer}"


def test_a_decode_row_alone_among_sixteen_and_beside_a_long_chunk(runner):
    """The issue's three cases, spelled out: one decode row alone; the same row among sixteen decode
    rows behind the same 600-token prefix; the same row beside a 300-token prefill chunk."""
    gen = torch.Generator().manual_seed(3)
    vocab = len(runner.text.tokenizer)
    prefix = torch.randint(10, vocab, (600,), generator=gen).tolist()
    pool = new_pool(runner)
    shared = pool.alloc(600)
    runner.forward_paged(pool, [PagedSegment(prefix, 0, shared)])
    tails = [torch.randint(10, vocab, (1 + i,), generator=gen).tolist() for i in range(16)]
    tables = [shared + pool.alloc(len(t) + 1) for t in tails]
    runner.forward_paged(pool, [PagedSegment(t[:-1] or t, 600, tb) for t, tb in zip(tails, tables, strict=True)
                                if len(t) > 1])
    rows = [PagedSegment([t[-1]], 600 + len(t) - 1, tb) for t, tb in zip(tails, tables, strict=True)]
    batch = runner.forward_paged(pool, rows)
    lone = torch.stack([runner.forward_paged(pool, [r]) [0] for r in rows])
    other = torch.randint(10, vocab, (300,), generator=gen).tolist()
    beside = runner.forward_paged(pool, [rows[5], PagedSegment(other, 0, pool.alloc(300))])[0]
    assert torch.equal(batch, lone)
    assert torch.equal(beside, lone[5])
    seq = prefix + tails[5]
    assert torch.equal(alone(runner, seq)[0][-1], lone[5])  # and from nothing, in one prefill


def test_scratch_buffer_paths_and_the_no_reuse_baseline_give_the_pools_bits(runner):
    """``forward``/``forward_last`` (a scratch buffer: the prefill timer's both sides) and
    ``baseline_prefill`` (no reuse) compute with the same kernels as the pool's forwards."""
    gen = torch.Generator().manual_seed(5)
    seq = torch.randint(10, len(runner.text.tokenizer), (300,), generator=gen).tolist()
    ref = alone(runner, seq)[0]
    kv = runner.new_request_kv(len(seq))
    first = runner.forward(seq[:170], kv)
    last = runner.forward_last(seq[170:], kv)
    assert torch.equal(first, ref[:170]) and torch.equal(last, ref[-1])
    base, _ms = runner.reference_prefill(seq)
    assert torch.equal(base, ref[-1])


def test_kv_moved_to_other_slots_gives_the_same_bits(runner):
    """KV copied byte for byte to other slots (a budget change renumbering slots, a second-tier load)
    serves the next token exactly as where it was computed."""
    gen = torch.Generator().manual_seed(8)
    seq = torch.randint(10, len(runner.text.tokenizer), (400,), generator=gen).tolist()
    pool = new_pool(runner)
    first = pool.alloc(len(seq) + 1)
    runner.forward_paged(pool, [PagedSegment(seq, 0, first)])
    moved = scattered(pool, len(seq) + 1, gen)
    src, dst = torch.tensor(first[:-1]), torch.tensor(moved[:-1])
    for k, v in zip(pool.k, pool.v, strict=True):
        k[:, dst] = k[:, src]
        v[:, dst] = v[:, src]
    a = runner.forward_paged(pool, [PagedSegment([42], len(seq), first)])
    b = runner.forward_paged(pool, [PagedSegment([42], len(seq), moved)])
    assert torch.equal(a, b)
    assert torch.equal(a[0], alone(runner, seq + [42])[0][-1])


def test_kv_loaded_from_the_second_tier_serves_the_same_bits(runner, tmp_path, make_engine):
    """A document's KV evicted to disk and loaded back (the second tier) answers the next question
    with the same logprobs, bit for bit, as when it was computed, and as with no cache at all."""
    from engine.engine import Engine
    from engine.kvcache.kv_tier import CHUNK_TOKENS as C
    from engine.types import GenerationRequest, SamplingParams

    gen = torch.Generator().manual_seed(12)
    vocab = len(runner.text.tokenizer)

    def ask(engine: Engine, ids: list[int]):
        sampling = SamplingParams(max_new_tokens=6, ignore_eos=True)
        events = list(engine.generate(GenerationRequest(prompt_ids=tuple(ids), sampling=sampling, logprobs=5)))
        return events[-1].metrics

    engine = make_engine(runner, budget_bytes=300 * runner.kv_bytes_per_token, tier_bytes=64 * 2**20,
                         tier_dir=str(tmp_path))
    plain = make_engine(runner, enable_cache=False)
    doc = torch.randint(10, vocab, (3 * C + 10,), generator=gen).tolist()
    question = doc + torch.randint(10, vocab, (5,), generator=gen).tolist()
    first = ask(engine, question)
    for _ in range(3):  # other prompts push the document out of the pool, to the tier
        ask(engine, torch.randint(10, vocab, (200,), generator=gen).tolist())
    again = ask(engine, question)
    assert again.tier_tokens > 0 and again.cached_tokens >= 3 * C
    nothing = ask(plain, question)
    assert again.output_ids == first.output_ids == nothing.output_ids
    assert again.output_logprobs == first.output_logprobs == nothing.output_logprobs


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    ([700, 300, 40], [None, 0, 0], 7, [256, 1, 33, 120], [5, 3, 7, 1]),
    ([300, 900], [None, 0], 11, [512, 64, 1], [3, 1, 2]),
])
def test_schedules_on_the_embedded_model(real_runner, case):
    """A few schedules on SmolLM2 (float32): every row and KV slot as the request alone."""
    if not real_runner.runs_exact:
        pytest.skip("the exact forward does not run here")
    assert_every_row_alone(real_runner, *run_schedule(real_runner, *case))
