"""Paired prefill timings on a tiny random Llama: both sides run the same forwards block by
block on the compute thread, the cache is left as it was, the cost is bounded, the no-reuse
memo serves only the same shipped prefix and prompt length, the warm start makes the first
request a hit, and the growth curve cleans up after itself."""

from __future__ import annotations

import threading

import pytest
import torch

from analysis.prefill_timing import (
    GROWTH_NAMESPACE,
    PrefillPair,
    PrefillTimer,
    TimingPolicy,
    _median_pair,
    default_policy,
    timer_for,
)
from engine.engine import Engine
from engine.types import PUBLIC, CacheKey, EngineFault, GenerationRequest, SamplingParams
from tests.engines import rand_ids


def shape(engine: Engine) -> list:
    """The cache's content and counters (no access clock: copy_prefix must not touch it either)."""
    snap = engine.snapshot()
    return [(n.node_id, n.parent_id, n.token_ids, n.lock_ref, n.hits, n.last_access_s_ago // 60) for n in snap.nodes]


@pytest.fixture
def engine(tiny_runner, make_engine):
    e = make_engine(budget_bytes=4000 * tiny_runner.kv_bytes_per_token)
    yield e


def run(engine: Engine, ids: list[int], public_len: int = 0) -> tuple[CacheKey, int]:
    req = GenerationRequest(prompt_ids=tuple(ids), sampling=SamplingParams(max_new_tokens=2), public_len=public_len)
    m = engine.run(req)
    return engine.cache_key(ids, req), m.cached_tokens


class Spy:
    """Records every ``forward_paged`` the runner is asked for on a scratch pool (the engine's
    ``scratch_prefill``): (tokens, tokens in the pool when its first call came, thread), so each
    call is tied to its side (0: the no-reuse side)."""

    def __init__(self, runner, monkeypatch) -> None:
        self.calls: list[tuple[int, int, str]] = []
        # Keyed by id() but holding the pool too: a freed pool's id may be reused by the next
        # one, which would then inherit its start (seen once in CI: a no-reuse side read as reuse).
        self._started: dict[int, tuple[object, int]] = {}
        real = runner.forward_paged

        def forward_paged(pool, segments, *args, **kwargs):
            (seg,) = segments
            start = self._started.setdefault(id(pool), (pool, seg.past))[1]
            self.calls.append((len(seg.ids), start, threading.current_thread().name))
            return real(pool, segments, *args, **kwargs)

        monkeypatch.setattr(runner, "forward_paged", forward_paged)


def test_pairs_time_both_sides_on_the_same_prompt_and_leave_the_cache_alone(engine, tiny_runner, monkeypatch):
    vocab = len(tiny_runner.text.tokenizer)
    shared = rand_ids(1, 120, vocab)
    run(engine, shared + rand_ids(2, 10, vocab))
    key, cached = run(engine, shared + rand_ids(3, 12, vocab))
    assert cached >= 120
    before = shape(engine)
    spy = Spy(tiny_runner, monkeypatch)
    timer = PrefillTimer(engine, TimingPolicy(pairs=3, reuse_runs=1, block_tokens=64))
    t = timer.time_pairs(key, cached)
    assert t.skipped is None and len(t.pairs) == 3 and t.full_runs == 3
    assert t.prompt_tokens == len(key.ids) and t.cached_tokens == cached
    assert all(p.reuse_ms > 0 and p.full_ms > 0 for p in t.pairs)
    assert (t.reuse_ms, t.full_ms) in [(p.reuse_ms, p.full_ms) for p in t.pairs]  # the median pair, as measured
    assert not t.full_from_memo
    # Reuse side: the suffix after the copied prefix; no-reuse side: every token from an empty
    # buffer, at most 64 tokens per call. All on the compute thread, none on this one.
    n = len(key.ids)
    reuse_calls = [c for c in spy.calls if c[1] == cached]
    assert sum(c[0] for c in reuse_calls) == 3 * (n - cached)
    assert sum(c[0] for c in spy.calls) == 3 * (n - cached) + 3 * n
    assert max(c[0] for c in spy.calls) <= 64
    assert {c[2] for c in spy.calls} == {"model-compute"}
    assert shape(engine) == before  # no hit, no insert, no lock, no access time
    engine.check_invariants()
    assert engine.cache.locked_tokens() == 0


def test_sides_alternate_which_goes_first(engine, tiny_runner, monkeypatch):
    vocab = len(tiny_runner.text.tokenizer)
    key, cached = run(engine, rand_ids(4, 80, vocab))
    key, cached = run(engine, list(key.ids) + rand_ids(5, 8, vocab))
    spy = Spy(tiny_runner, monkeypatch)
    PrefillTimer(engine, TimingPolicy(pairs=4, reuse_runs=1, block_tokens=1024)).time_pairs(key, cached)
    sides = ["reuse" if c[1] > 0 else "full" for c in spy.calls]
    assert sides == ["full", "reuse", "reuse", "full", "full", "reuse", "reuse", "full"]


def test_the_reuse_side_of_a_pair_is_the_median_of_several_runs(engine, tiny_runner, monkeypatch):
    vocab = len(tiny_runner.text.tokenizer)
    key, cached = run(engine, rand_ids(21, 80, vocab))
    key, cached = run(engine, list(key.ids) + rand_ids(22, 8, vocab))
    spy = Spy(tiny_runner, monkeypatch)
    t = PrefillTimer(engine, TimingPolicy(pairs=2, reuse_runs=3, block_tokens=1024)).time_pairs(key, cached)
    sides = ["reuse" if c[1] > 0 else "full" for c in spy.calls]
    assert sides == ["full"] + ["reuse"] * 3 + ["reuse"] * 3 + ["full"]
    assert t.reuse_runs == 3 and len(t.pairs) == 2


def test_the_median_pair_is_a_measured_pair():
    pairs = [PrefillPair(10, 100), PrefillPair(10, 300), PrefillPair(10, 200)]
    assert _median_pair(pairs) == PrefillPair(10, 200)
    assert _median_pair(pairs[:2]) == PrefillPair(10, 100)  # even count: the lower ratio


def test_cost_is_bounded(engine, tiny_runner):
    vocab = len(tiny_runner.text.tokenizer)
    key, _ = run(engine, rand_ids(6, 200, vocab))
    key, cached = run(engine, list(key.ids) + rand_ids(7, 10, vocab))
    n = len(key.ids)
    per_pair = n + (n - cached)
    two = PrefillTimer(engine, TimingPolicy(pairs=3, reuse_runs=1, max_tokens=2 * per_pair + 1)).time_pairs(key, cached)
    assert len(two.pairs) == 2
    none = PrefillTimer(engine, TimingPolicy(pairs=3, reuse_runs=1, max_tokens=per_pair - 1)).time_pairs(key, cached)
    assert none.pairs == () and none.full_ms is None and "over the" in none.skipped


def test_nothing_cached_is_not_timed(engine, tiny_runner):
    vocab = len(tiny_runner.text.tokenizer)
    key = CacheKey(tuple(rand_ids(8, 40, vocab)), PUBLIC, 0)
    t = PrefillTimer(engine).time_pairs(key, 30)
    assert t.cached_tokens == 0 and t.full_ms is None and "nothing" in t.skipped


def test_memo_serves_the_same_shipped_prefix_and_length_only(engine, tiny_runner, monkeypatch):
    vocab = len(tiny_runner.text.tokenizer)
    shipped = rand_ids(9, 100, vocab)
    policy = TimingPolicy(pairs=3, memo_min_tokens=64, block_tokens=1024)
    timer = PrefillTimer(engine, policy)
    run(engine, shipped + rand_ids(20, 5, vocab), public_len=100)  # the shipped prefix is cached
    key_a, cached_a = run(engine, shipped + rand_ids(10, 12, vocab), public_len=100)
    first = timer.time_pairs(key_a, cached_a)
    assert not first.full_from_memo and first.full_runs == 3
    spy = Spy(tiny_runner, monkeypatch)
    key_b, cached_b = run(engine, shipped + rand_ids(11, 12, vocab), public_len=100)  # same length, other question
    spy.calls.clear()
    again = timer.time_pairs(key_b, cached_b)
    assert again.full_from_memo and again.full_ms == pytest.approx(sorted(p.full_ms for p in first.pairs)[1])
    assert again.full_measured_at == first.full_measured_at and again.full_runs == 3
    assert all(c[1] > 0 for c in spy.calls)  # only the reuse side ran
    key_c, cached_c = run(engine, shipped + rand_ids(12, 20, vocab), public_len=100)  # another length
    assert not timer.time_pairs(key_c, cached_c).full_from_memo
    key_d, cached_d = run(engine, rand_ids(13, 100, vocab) + rand_ids(10, 12, vocab))  # not shipped
    assert not timer.time_pairs(key_d, cached_d).full_from_memo


def test_a_busy_timer_skips_instead_of_queueing_forever(engine, tiny_runner):
    vocab = len(tiny_runner.text.tokenizer)
    key, _ = run(engine, rand_ids(14, 60, vocab))
    key, cached = run(engine, list(key.ids) + rand_ids(15, 6, vocab))
    timer = PrefillTimer(engine, TimingPolicy(wait_s=0.05))
    with timer._busy:
        t = timer.time_pairs(key, cached)
    assert t.full_ms is None and "other timings" in t.skipped


def test_warm_start_makes_the_first_request_a_hit(engine, tiny_runner):
    vocab = len(tiny_runner.text.tokenizer)
    shipped = rand_ids(16, 150, vocab)
    too_long = rand_ids(17, tiny_runner.max_context + 5, vocab)
    timer = PrefillTimer(engine)
    warmed = timer.warm([("shipped", CacheKey(tuple(shipped), PUBLIC, 150)),
                         ("too long", CacheKey(tuple(too_long), PUBLIC, len(too_long)))])
    assert warmed[0].num_tokens == warmed[0].computed_tokens == 150 and warmed[0].prefill_ms > 0
    assert warmed[1].skipped and "cap" in warmed[1].skipped
    assert timer.warm([("shipped", CacheKey(tuple(shipped), PUBLIC, 150))])[0].computed_tokens == 0  # already there
    _, cached = run(engine, shipped + rand_ids(18, 9, vocab), public_len=150)
    assert cached == 150
    engine.check_invariants()


def test_growth_curve_measures_each_length_and_clears_its_filler(engine, tiny_runner):
    vocab = len(tiny_runner.text.tokenizer)
    filler = rand_ids(19, 700, vocab)
    seen = []
    curve = PrefillTimer(engine, TimingPolicy(block_tokens=128)).growth_curve(
        filler, lengths=(64, 256, 512, 4096), suffix_tokens=16, pairs=2, on_point=seen.append)
    assert curve.state == "done", curve.error
    assert [p.cached_tokens for p in curve.points] == [64, 256, 512]  # 4,096 does not fit the filler
    assert all(p.reuse_ms > 0 and p.full_ms > 0 and p.pairs == 2 and p.suffix_tokens == 16 for p in curve.points)
    assert len(seen) == 3 and seen[-1].state == "running"
    assert not [n for n in engine.cache.tree.nodes() if n.namespace == GROWTH_NAMESPACE]
    engine.check_invariants()
    assert engine.cache.locked_tokens() == 0


def test_timer_for_keeps_one_timer_per_engine_with_the_deployment_policy(make_engine):
    public = make_engine(isolation=True)
    local = make_engine()
    assert timer_for(public) is timer_for(public) is not timer_for(local)
    assert timer_for(public).policy == default_policy("cpu", True)
    assert timer_for(public).policy.memo_min_tokens and not timer_for(local).policy.memo_min_tokens
    assert default_policy("cpu", True).max_tokens < default_policy("cpu", False).max_tokens


def test_the_timer_is_kept_by_the_analysis_and_dies_with_its_engine(tiny_runner, tokenizer):
    """The engine holds no timer (no ``prefill_timer``, no attachments): ``analysis.per_engine``
    keeps it, weakly keyed, so a closed and dropped engine takes its timer with it."""
    import gc
    import weakref

    from analysis.per_engine import _ANALYSIS
    from engine.engine import Engine
    from server.remote.engine import RemoteEngine

    engine = Engine(tiny_runner)  # by hand: the test drops it
    timer = timer_for(engine)
    assert not hasattr(engine, "prefill_timer") and not hasattr(engine, "attachment")
    assert timer.engine is engine and engine in _ANALYSIS
    gone = weakref.ref(engine)
    engine.close()
    del engine
    gc.collect()
    assert gone() is None  # the timer held it only weakly
    with pytest.raises(EngineFault):
        timer.engine  # noqa: B018
    remote = RemoteEngine("http://127.0.0.1:9", "m", tokenizer)  # never contacted
    try:
        assert timer_for(remote) is None  # a remote engine's prefill cannot be timed from here
    finally:
        remote.close()


def test_growth_curve_keeps_what_each_point_reused(engine, tiny_runner):
    vocab = len(tiny_runner.text.tokenizer)
    curve = PrefillTimer(engine, TimingPolicy(block_tokens=128)).growth_curve(
        rand_ids(21, 600, vocab), lengths=(64, 256), suffix_tokens=16)
    assert curve.state == "done", curve.error
    assert [(p.cached_tokens, p.reused_tokens) for p in curve.points] == [(64, 64), (256, 256)]
    assert not any(p.reused_less for p in curve.points)


def test_growth_curve_waits_while_a_visitor_request_waits_or_runs(engine, tiny_runner):
    """Background work yields: while a visitor's request is in the engine, the curve computes
    nothing (not even its filler); once the engine is idle it runs to the end."""
    import time

    vocab = len(tiny_runner.text.tokenizer)
    filler = rand_ids(22, 400, vocab)
    timer = PrefillTimer(engine, TimingPolicy(block_tokens=128))
    result = []
    with tiny_runner.lock:  # a step is under way: the visitor's request waits for the model
        handle = engine.submit(GenerationRequest(prompt_ids=tuple(rand_ids(23, 20, vocab)),
                                                 sampling=SamplingParams(max_new_tokens=2)))
        curve = threading.Thread(target=lambda: result.append(timer.growth_curve(filler, lengths=(64, 256),
                                                                                  suffix_tokens=16)))
        curve.start()
        time.sleep(1.0)
        assert engine.cache.match_len(CacheKey(tuple(filler), GROWTH_NAMESPACE, 0)) == 0, "the curve did not wait"
        assert not timer.curve.points
    assert list(handle)[-1].metrics.output_tokens == 2
    curve.join(120)
    assert result and result[0].state == "done", result
    engine.check_invariants()


def test_scratch_buffers_are_counted_and_bounded(engine, tiny_runner):
    vocab = len(tiny_runner.text.tokenizer)
    ids = rand_ids(24, 300, vocab)
    run(engine, ids[:200])
    timer = PrefillTimer(engine, TimingPolicy(block_tokens=128, pairs=1, reuse_runs=1))
    assert timer.scratch_bytes == 0
    timing = timer.time_pairs(CacheKey(tuple(ids)), 200)
    assert timing.full_ms is not None
    assert timer.scratch_bytes == 0  # dropped after the timing
    assert timer.peak_scratch_bytes == 300 * tiny_runner.kv_bytes_per_token  # one prompt's buffer at a time
    assert timer.peak_scratch_bytes <= timer.scratch_bound_bytes


def test_on_a_shared_deployment_shipped_content_leaves_half_the_cache_to_visitors(tiny_runner, make_engine):
    """A visitor never evicts shipped content, so a warm start that filled a small pool with it
    would lock every visitor out (issue #27: RADIX_ISOLATE=1 RADIX_CACHE_BUDGET_MB=64 answered 400)."""
    from engine.types import PUBLIC, CacheKey, GenerationRequest, SamplingParams

    engine = make_engine(budget_bytes=400 * tiny_runner.kv_bytes_per_token, isolation=True)
    blocks = [tuple(range(100 + 150 * i, 250 + 150 * i)) for i in range(4)]  # 600 shipped tokens, pool of 400
    warmed = timer_for(engine).warm([(f"block {i}", CacheKey(b, PUBLIC, len(b))) for i, b in enumerate(blocks)])
    assert engine.stats().cached_tokens_now <= 200 and warmed[0].skipped is None and warmed[-1].skipped
    visitor = GenerationRequest(prompt_ids=tuple(range(2000, 2180)), namespace="v-alice",
                                sampling=SamplingParams(max_new_tokens=4))
    assert len(engine.run(visitor).output_ids) == 4  # answered, not refused for room


def _logits_of(runner, cache, key: CacheKey, cached: int, block: int) -> torch.Tensor:
    """The prompt's last-token logits, computed here independently of the timer: the cached prefix's
    KV copied (``cached`` > 0), then the rest ``block`` tokens per forward, as a timing's side runs."""
    ids = list(key.ids)
    kv = runner.new_request_kv(len(ids))

    def go() -> torch.Tensor:
        pos = cache.copy_prefix(key, cached, kv) if cached else 0
        out = None
        while pos < len(ids):
            out = runner.forward_last(ids[pos:pos + block], kv)
            pos += block
        return out

    return runner.compute.call(go)


def test_a_timing_compares_both_sides_logits_bit_for_bit(engine, tiny_runner):
    """The paired timing says whether reuse changed what the model computed: the last prompt token's
    logits of both sides, ``torch.equal`` and digests, equal to the same forwards run here."""
    import hashlib

    from analysis.prefill_timing import compare_logits

    vocab = len(tiny_runner.text.tokenizer)
    shared = rand_ids(7, 60, vocab)
    run(engine, shared)
    key, cached = run(engine, shared + rand_ids(8, 9, vocab))
    timer = PrefillTimer(engine, TimingPolicy(pairs=2, reuse_runs=1, block_tokens=32))
    t = timer.time_pairs(key, cached)
    check = t.logits
    assert check is not None and t.full_ms is not None
    reuse = _logits_of(tiny_runner, engine.cache, key, t.cached_tokens, 32)
    full = _logits_of(tiny_runner, engine.cache, key, 0, 32)
    digest = lambda x: hashlib.sha256(x.float().contiguous().numpy().tobytes()).hexdigest()[:16]  # noqa: E731
    assert (check.reuse_digest, check.full_digest) == (digest(reuse), digest(full))
    assert check.identical == torch.equal(reuse, full) == (check.max_abs_diff == 0.0)
    assert check.max_abs_diff == float((reuse - full).abs().max())
    assert check.same_next_token == (int(reuse.argmax()) == int(full.argmax()))
    same = compare_logits(full, full.clone())
    assert same.identical and same.max_abs_diff == 0.0 and same.reuse_digest == same.full_digest
    other = full.clone()
    other[3] = torch.nextafter(other[3], torch.tensor(float("inf")))  # one bit of one logit
    flipped = compare_logits(other, full)
    assert not flipped.identical and flipped.reuse_digest != flipped.full_digest and flipped.max_abs_diff > 0


def test_a_memo_timing_makes_no_claim_about_the_logits(engine, tiny_runner):
    vocab = len(tiny_runner.text.tokenizer)
    shared = rand_ids(9, 40, vocab)
    run(engine, shared, public_len=40)
    key, cached = run(engine, shared + rand_ids(10, 8, vocab), public_len=40)
    timer = PrefillTimer(engine, TimingPolicy(pairs=1, reuse_runs=1, block_tokens=64, memo_min_tokens=16))
    assert timer.time_pairs(key, cached).logits is not None  # measured afresh: compared
    memo = timer.time_pairs(key, cached)
    assert memo.full_from_memo and memo.logits is None  # the no-reuse side was not run this time


def test_a_scratch_buffer_is_freed_with_its_last_reference_not_by_the_garbage_collector(engine, tiny_runner):
    """A request buffer and its layers must not form a reference cycle: a timing's scratch buffers
    (100 MB each at 2,300 tokens on the embedded model) then piled up between the cyclic collector's
    runs; eight tabs timing at once held 2.3 GB over the memory the page promises."""
    import gc
    import weakref

    import engine.prefill_ops as engine_module  # where scratch_prefill makes its pool

    gc.disable()
    try:
        kv = tiny_runner.new_request_kv(64)
        tiny_runner.forward_last(rand_ids(11, 40, 500), kv)  # the layers were initialised and hold views
        storage, buffer = weakref.ref(kv.k), weakref.ref(kv)
        del kv
        assert buffer() is None and storage() is None  # freed at once, no collection needed
        vocab = len(tiny_runner.text.tokenizer)
        shared = rand_ids(12, 50, vocab)
        run(engine, shared)
        key, cached = run(engine, shared + rand_ids(13, 6, vocab))
        timer = PrefillTimer(engine, TimingPolicy(pairs=1, reuse_runs=1, block_tokens=16))
        made: list = []
        pools: list = []
        real, real_pool = tiny_runner.new_request_kv, engine_module.KVPool
        tiny_runner.new_request_kv = lambda n: made.append(weakref.ref(b := real(n))) or b
        engine_module.KVPool = lambda *a: pools.append(weakref.ref(p := real_pool(*a))) or p
        try:
            assert timer.time_pairs(key, cached).full_ms is not None
        finally:
            del tiny_runner.new_request_kv
            engine_module.KVPool = real_pool
        # both sides' scratch pools gone, and the buffer the reuse side's prefix was copied through
        assert len(pools) == 2 and all(ref() is None for ref in pools)
        assert len(made) == 1 and all(ref() is None for ref in made)
    finally:
        gc.enable()
