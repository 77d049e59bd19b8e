"""The replay simulation's second tier (``--disk-cache-mb``): an evicted shared prefix comes back
from the tier instead of being recomputed, the tier's own budget bounds it, the numbers agree
with the real engine's tier on a tiny random Llama, and the summary, per-request lines and
report show the tier only when it is on."""

from __future__ import annotations

import json

import pytest

from analysis.replay.sim_cache import SimCache
from analysis.replay.simulate import ModelGeometry, model_geometry, simulate_lines
from engine.kvcache.kv_tier import CHUNK_TOKENS
from engine.types import GenerationRequest, SamplingParams
from tests.engines import rand_ids
from tests.helpers_app import assert_clean
from tools.replay import main

C = CHUNK_TOKENS
VOCAB = 40_000


def evicting_log() -> list[list[int]]:
    """doc1 + question, doc2 + question (evicts doc1 from a 300-token budget), doc1 + another
    question: its 3 whole chunks of doc1 are in the tier."""
    doc1, doc2 = rand_ids(1, 3 * C + 8, VOCAB), rand_ids(2, 3 * C + 8, VOCAB)
    return [doc1 + rand_ids(3, 5, VOCAB), doc2 + rand_ids(4, 5, VOCAB), doc1 + rand_ids(5, 5, VOCAB),
            doc2 + rand_ids(6, 5, VOCAB)]


def serve_all(cache: SimCache, prompts) -> list[tuple[int, int]]:
    return [(s.cached_tokens, s.tier_tokens) for s in (cache.serve(p) for p in prompts)]


def test_an_evicted_prefix_is_served_from_the_tier_and_recomputed_without():
    prompts = evicting_log()
    without = serve_all(SimCache(300), prompts)
    with_tier = serve_all(SimCache(300, tier_chunks=100), prompts)
    assert without == [(0, 0)] * 4
    assert with_tier == [(0, 0), (0, 0), (3 * C, 3 * C), (3 * C, 3 * C)]


def test_the_tier_budget_bounds_it():
    prompts = evicting_log()
    # 0 chunks (budget under one chunk): nothing kept. 2 chunks: doc1's last two chunks push out its
    # first, and a chunk is only usable after the ones before it, so nothing comes back either.
    assert serve_all(SimCache(300, tier_chunks=0), prompts) == [(0, 0)] * 4
    assert serve_all(SimCache(300, tier_chunks=2), prompts) == [(0, 0)] * 4
    # 3 chunks hold doc1, but the third request's own eviction (doc2 to the tier) comes first and
    # pushes them out: the engine, too, makes room before it reads the chunks.
    assert serve_all(SimCache(300, tier_chunks=3), prompts) == [(0, 0)] * 4
    cache = SimCache(300, tier_chunks=6)
    assert serve_all(cache, prompts)[2:] == [(3 * C, 3 * C)] * 2 and cache.tier.num_chunks == 6


def test_memory_first_then_the_tier_and_one_token_always_computed():
    doc = rand_ids(7, 2 * C, VOCAB)
    cache = SimCache(2 * C + 10, tier_chunks=10)
    cache.serve(doc + [11])
    cache.serve(rand_ids(8, 2 * C + 10, VOCAB))  # doc goes to the tier
    served = cache.serve(doc)  # all of doc is in the tier, but its last token must be computed
    assert (served.cached_tokens, served.tier_tokens) == (C, C)
    served = cache.serve(doc[:C + 20] + rand_ids(9, 3, VOCAB))  # memory holds doc now
    assert (served.cached_tokens, served.tier_tokens) == (C + 20, 0)


def test_the_partly_held_chunk_loads_only_its_missing_tail():
    doc = rand_ids(10, 3 * C, VOCAB)
    cache = SimCache(10_000, tier_chunks=10)
    cache.serve(doc + [1])
    for node in list(cache.tree.nodes()):  # spill everything, then keep the first 100 tokens in memory
        cache.tier.spill(node, cache.tree.root)
    cache.tree.clear()
    cache.serve(doc[:100])
    served = cache.serve(doc + [2])
    assert (served.cached_tokens, served.tier_tokens) == (3 * C, 3 * C - 100)


@pytest.mark.parametrize("tier_chunks", [100, 6, 3, 2, 0])
def test_the_simulation_agrees_with_the_engine(tiny_runner, tmp_path, tier_chunks, make_engine):
    """The same prompts through the engine with its second tier and through the simulation with
    the same budgets (the engine's cached part is what its tree keeps: prompt + answer but the
    last token)."""
    bpt, budget = tiny_runner.kv_bytes_per_token, 300
    tier_bytes = tier_chunks * C * bpt if tier_chunks else C * bpt // 2
    engine = make_engine(budget_bytes=budget * bpt, tier_bytes=tier_bytes, tier_dir=str(tmp_path))
    sim = SimCache(budget, tier_chunks=tier_bytes // (C * bpt))
    for ids in evicting_log():
        ids = [t % len(tiny_runner.text.tokenizer) for t in ids]
        m = engine.run(GenerationRequest(prompt_ids=tuple(ids), sampling=SamplingParams(max_new_tokens=4)))
        served = sim.serve(ids, list(m.prompt_ids) + list(m.output_ids[:-1]))
        assert (served.cached_tokens, served.tier_tokens) == (m.cached_tokens, m.tier_tokens)
    assert sim.tree.num_tokens == engine.cache.tree.num_tokens
    assert sim.tier.num_chunks == engine.tier.num_chunks
    assert_clean(engine)


GEOMETRY = ModelGeometry("test", kv_bytes_per_token=1000, max_context=8192, dtype="float32")


def test_simulate_lines_counts_both_tiers(tokenizer):
    words = [" ".join(f"w{i}x{j}" for j in range(120)) for i in range(2)]
    lines = [json.dumps({"prompt": words[i % 2] + f" question {i}"}) for i in range(4)]
    budget = len(tokenizer(words[0] + " question 0", add_special_tokens=False)["input_ids"]) + 20
    off = simulate_lines(lines, tokenizer, GEOMETRY, budget)
    on = simulate_lines(lines, tokenizer, GEOMETRY, budget, tier_bytes=100 * C * 1000)
    tiny = simulate_lines(lines, tokenizer, GEOMETRY, budget, tier_bytes=C * 1000 - 1)
    assert not off.has_tier and off.tier_tokens == 0 and "second tier" not in off.notes[-1]
    assert on.has_tier and on.tier_tokens > 0 and on.cached_tokens == off.cached_tokens + on.tier_tokens
    assert on.hit_rate > off.hit_rate and any("Second tier" in n for n in on.notes)
    assert tiny.has_tier and tiny.tier_tokens == 0 and tiny.cached_tokens == off.cached_tokens


def test_the_cli_shows_the_tier_only_when_on(tmp_path, capsys, tokenizer):
    geometry = model_geometry()
    words = [" ".join(f"w{i}x{j}" for j in range(150)) for i in range(2)]
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"prompt": words[i % 2] + f" question {i}"}) + "\n" for i in range(4)))
    prompt_tokens = len(tokenizer(words[0] + " question 0", add_special_tokens=False)["input_ids"])
    budget_mb = (prompt_tokens + 30) * geometry.kv_bytes_per_token / 2**20
    runs = {}
    for label, extra in (("off", []), ("on", ["--disk-cache-mb", "128"])):
        report = tmp_path / f"{label}.html"
        capsys.readouterr()
        rc = main([str(log), "--simulate", "--no-progress", "--per-request", "--budget-mb", str(budget_mb),
                   "--report", str(report), *extra])
        out = capsys.readouterr()
        assert rc == 0, out.err[-2000:]
        rows = [json.loads(x) for x in out.out.strip().splitlines()]
        runs[label] = rows[:-1], rows[-1]["summary"], report.read_text()
    off_rows, off, off_page = runs["off"]
    on_rows, on, on_page = runs["on"]
    assert "tier_tokens" not in off and all("tier_tokens" not in r for r in off_rows)
    assert "second tier" not in off["text"] and "second tier" not in off_page
    assert on["tier_tokens"] == sum(r["tier_tokens"] for r in on_rows) > 0
    assert on["tier_budget_bytes"] == 128 * 2**20
    assert on["cached_tokens"] == off["cached_tokens"] + on["tier_tokens"]
    assert f"Of those, {on['tier_tokens']:,}" in on["text"] and "MiB second tier" in on_page
    assert main([str(log), "--simulate", "--disk-cache-mb", "-1"]) == 2


def test_the_real_engine_path_reports_tier_tokens_only_with_a_tier(tiny_runner, tmp_path, make_engine):
    """Real-model mode hands the tier to the engine; each request's line says its tier tokens."""
    import io

    from analysis.replay.log_formats import LogRecord
    from analysis.replay.replay_stats import ReplayStats
    from tools.replay import replay_on_engine

    bpt = tiny_runner.kv_bytes_per_token
    for tier_bytes in (0, 64 * 2**20):
        engine = make_engine(budget_bytes=300 * bpt, tier_bytes=tier_bytes, tier_dir=str(tmp_path))
        stats = ReplayStats(300, tiny_runner.text.decode, lambda t: 1)
        out = io.StringIO()
        replay_on_engine(engine, [LogRecord(line=1, messages=None, prompt="hello there")], stats, 2, False, out=out)
        line = json.loads(out.getvalue())
        assert ("tier_tokens" in line) == (tier_bytes > 0) and stats.tier_tokens == 0
