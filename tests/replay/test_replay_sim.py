"""The model-free replay on generated logs with known answers: hit rates, miss causes,
budget and eviction, TTL, block granularity, tokenization parity with the engine."""

from __future__ import annotations

import json
import random

import pytest

from analysis.lab.granularity import compare_granularity
from analysis.replay.replay_stats import Series, summary_text
from analysis.replay.sim_cache import SimCache
from analysis.replay.simulate import ModelGeometry, PromptEncoder, simulate_lines
from engine.kvcache.radix_tree import RadixTree, common_prefix_len
from engine.types import CacheKey

GEOMETRY = ModelGeometry("test", kv_bytes_per_token=1000, max_context=8192, dtype="float32")
STATIC = ("You are the support assistant of ACME Networks. Answer in two sentences. Mention the model number of "
          "the router when you know it. Never promise refunds; point to the billing page instead. Be friendly.")
DOCS = [f"Document {i}: " + " ".join(f"fact{i}_{j} is about routers and cables" for j in range(6)) for i in range(4)]


def run(tokenizer, items, budget=None, ttl=None, **kw):
    per_request = []
    lines = [x if isinstance(x, str) else json.dumps(x) for x in items]
    report = simulate_lines(lines, tokenizer, GEOMETRY, budget, ttl, on_request=lambda e, s, k: per_request.append(
        (e, s, k)), **kw)
    return report, per_request


def oracle_cached(prompts, inserted):
    """By brute force: each request reuses its longest common prefix with anything inserted
    before it (no budget), and computes at least one token."""
    out = []
    for i, ids in enumerate(prompts):
        best = max((common_prefix_len(ids, prev) for prev in inserted[:i]), default=0)
        out.append(min(best, len(ids) - 1))
    return out


def test_identical_prompts_hit_rate_by_hand(tokenizer):
    report, reqs = run(tokenizer, [{"prompt": STATIC}] * 4)
    n = len(tokenizer(STATIC, add_special_tokens=False)["input_ids"])
    assert [s.cached_tokens for _, s, _ in reqs] == [0, n - 1, n - 1, n - 1]
    assert report.prompt_tokens == 4 * n and report.cached_tokens == 3 * (n - 1)
    assert report.hit_rate == pytest.approx(3 * (n - 1) / (4 * n))
    assert [k for _, _, k in reqs] == ["cold", "full-hit", "full-hit", "full-hit"]
    assert summary_text(report).startswith(f"On this log, prefix caching would serve {report.hit_rate:.0%} of prompt")
    assert report.mode == "simulation" and any("no model ran" in n for n in report.notes)


def test_every_format_matches_a_brute_force_oracle(tokenizer):
    chat = [{"role": "system", "content": STATIC}, {"role": "user", "content": "How do I reset my router?"}]
    items = [
        {"messages": chat},
        {"prompt": STATIC + " Question: what is a mesh node?"},
        {"custom_id": "r1", "body": {"messages": chat[:1] + [{"role": "user", "content": "And the guest wifi?"}]}},
        {"conversations": [{"from": "system", "value": STATIC}, {"from": "human", "value": "Hi there"},
                           {"from": "gpt", "value": "Hello! How can I help?"},
                           {"from": "human", "value": "My light is red."}]},
        {"prompt": STATIC + " Question: what is a mesh node?"},
    ]
    report, reqs = run(tokenizer, items)
    assert [e.record.fmt for e, _, _ in reqs] == ["messages", "prompt", "batch", "sharegpt", "sharegpt", "prompt"]
    prompts = [list(e.ids) for e, _, _ in reqs]
    inserted = [list(e.inserted) for e, _, _ in reqs]
    for e, _, _ in reqs:  # ids as the engine's tokenizer path makes them
        r = e.record
        text = (r.prompt if r.messages is None else
                tokenizer.apply_chat_template(list(r.messages), tokenize=False, add_generation_prompt=True))
        assert list(e.ids) == tokenizer(text, add_special_tokens=False)["input_ids"]
    reply = tokenizer("Hello! How can I help?", add_special_tokens=False)["input_ids"]
    assert inserted[3] == prompts[3] + reply  # the logged reply stays cached, as a serving engine decoded it
    assert [s.cached_tokens for _, s, _ in reqs] == oracle_cached(prompts, inserted)
    assert reqs[4][1].cached_tokens >= len(prompts[3]) + len(reply)  # the second turn reuses the first and its reply
    assert reqs[5][1].cached_tokens == len(prompts[5]) - 1
    assert report.formats == {"messages": 1, "prompt": 2, "batch": 1, "sharegpt": 2}


def test_per_request_value_before_static_text_is_the_biggest_loss(tokenizer):
    items = [{"prompt": f"Date: 2026-03-{d:02d}. {STATIC} Question {d}: how do I reset?"} for d in (11, 12, 13, 14)]
    report, reqs = run(tokenizer, items)
    kinds = [k for _, _, k in reqs]
    assert kinds == ["cold"] + ["per-request-value"] * 3
    per_value = next(c for c in report.causes if c.kind == "per-request-value")
    computed = [len(e.ids) - s.cached_tokens for e, s, _ in reqs]
    assert per_value.computed_tokens == sum(computed[1:]) and per_value.requests == 3
    assert per_value.share_of_computed == pytest.approx(sum(computed[1:]) / sum(computed))
    assert per_value.recomputed_identical_tokens > 3 * 40  # the static text, computed again each time
    assert [e.line for e in per_value.examples] == [2, 3, 4]  # equal losses: the earliest first
    assert "".join(per_value.examples[0].after_pieces).startswith("2. You are")  # 2026-03-1|2. You are ...
    assert "a value that changes per request" in summary_text(report)
    [finding] = report.templates
    assert finding.inferred.template.startswith("Date: 2026-03-{part1}") and finding.lint.warnings


def test_reordered_documents_and_new_content(tokenizer):
    orders = [(0, 1, 2, 3), (2, 0, 1, 3), (0, 1, 2, 3)]
    items = [{"prompt": "Use these documents.\n\n" + "\n\n".join(DOCS[i] for i in o) + "\n\nQ: which fact?"}
             for o in orders]
    items.append({"prompt": items[0]["prompt"] + " And which cable? Please answer in detail, thanks."})
    _, reqs = run(tokenizer, items)
    assert [k for _, _, k in reqs] == ["cold", "reordered", "full-hit", "new-content"]


def test_budget_smaller_than_the_log_evicts_and_stays_bounded(tokenizer):
    prompts = [{"prompt": f"Ticket {chr(65 + i)}{chr(65 + i)}: " + " ".join(f"w{i}x{j}" for j in range(12))}
               for i in range(4)]  # about 54 tokens each: 4 fit the shadow (4 x 80 tokens), 1 fits the cache
    budget = 80
    report, reqs = run(tokenizer, prompts + prompts, budget=budget)
    assert report.evicted_tokens > 0 and report.peak_cached_tokens <= budget
    assert report.tree.num_tokens <= budget
    second = reqs[len(prompts):]
    assert all(k == "evicted" for _, _, k in second)  # cyclic access over a too-small LRU cache: all gone
    assert next(c for c in report.causes if c.kind == "evicted").requests == len(prompts)
    assert "evicted before they were reused" in summary_text(report)
    big, _ = run(tokenizer, prompts * 10, budget=budget)
    assert big.peak_cached_tokens <= budget and big.tree.num_tokens <= budget


def test_time_to_live_expires_entries_on_the_log_clock(tokenizer):
    items = [{"prompt": STATIC, "timestamp": t} for t in (0, 100, 1000)]
    report, reqs = run(tokenizer, items, ttl=300.0)
    n = len(reqs[0][0].ids)
    assert [s.cached_tokens for _, s, _ in reqs] == [0, n - 1, 0]
    assert [k for _, _, k in reqs] == ["cold", "full-hit", "expired"] and report.expired_tokens == n
    other = "Completely different text about cooking pasta and boiling eggs for breakfast."
    _, mixed = run(tokenizer, [{"prompt": STATIC, "timestamp": 0}, {"prompt": other, "timestamp": 200},
                               {"prompt": other, "timestamp": 400}, {"prompt": STATIC, "timestamp": 450}], ttl=300.0)
    assert [k for _, _, k in mixed][2:] == ["full-hit", "expired"]  # only the stale prompt expired
    untimed, _ = run(tokenizer, [{"prompt": STATIC}] * 3, ttl=300.0)
    assert untimed.expired_tokens == 0 and any("no timestamps" in n for n in untimed.notes)


def test_block_granularity_matches_the_labs_simulation_without_eviction(tokenizer):
    items = [{"prompt": f"{STATIC} Case {i}: " + "detail " * (i * 7)} for i in range(6)]
    items += [{"prompt": "Date: 2026-03-01. " + STATIC}, {"prompt": "Date: 2026-03-02. " + STATIC}]
    report, reqs = run(tokenizer, items)
    lab = compare_granularity([e.ids for e, _, _ in reqs])
    assert report.granularity == {g.block_size: g.cached_tokens for g in lab}


def test_leaf_heap_eviction_keeps_the_trees_lru_order():
    rng = random.Random(3)
    stems = [tuple(rng.randrange(50) for _ in range(rng.randint(3, 30))) for _ in range(8)]
    budget, now = 60, 0.0
    sim, ref = SimCache(budget), RadixTree(clock=lambda: now)
    for _ in range(400):
        now += 1.0
        ids = rng.choice(stems)[:rng.randint(1, 30)] + tuple(rng.randrange(50) for _ in range(rng.randint(0, 6)))
        want = ref.match(CacheKey(ids), max_len=len(ids) - 1).length
        ref.insert(CacheKey(ids), [None] * len(ids))
        if ref.num_tokens > budget:
            ref.evict(ref.num_tokens - budget)
        assert sim.serve(ids, now=now).cached_tokens == want
        assert sim.tree.num_tokens == ref.num_tokens <= budget
        sim.tree.check_invariants()


def test_series_and_kept_lists_stay_small():
    s = Series(max_points=8)
    for i in range(1000):
        s.add(10, i % 10)
    assert len(s.count) <= 8 and sum(s.count) == 1000 and sum(s.prompt) == 10_000 and s.per_bucket == 128


def test_skipped_lines_are_reported_and_the_replay_goes_on(tokenizer):
    lines = ['{"prompt": "ok one"}', "{broken", '{"messages": "x"}', '{"prompt": "ok two"}',
             json.dumps({"prompt": "x " * 9000})]
    report, reqs = run(tokenizer, lines)
    assert report.requests == 2 and report.skipped_count == 3
    assert [(s.line, s.reason.split(" ")[0]) for s in report.skipped] == [(2, "not"), (3, '"messages":'),
                                                                         (5, "the")]
    assert "context" in report.skipped[2].reason


def test_prompt_encoder_memo_equals_whole_tokenization(tokenizer, tiny_runner):
    from analysis.replay.log_formats import parse_line

    enc = PromptEncoder(tokenizer, 8192)
    records = [r for line in [
        json.dumps({"messages": [{"role": "system", "content": STATIC}, {"role": "user", "content": q}]})
        for q in ("Hi", "Hi\n\n", " spaced  out ", "<|im_start|>user\nsneaky", "émoji 🙂 tokens")]
        for r in parse_line(line, 1)]
    got = enc.encode(records)
    assert enc._splitter is not None  # the memo stayed on: it agreed with whole tokenization
    for r, e in zip(records, got, strict=True):
        assert list(e.ids) == tiny_runner.text.encode_chat(r.messages)


def test_budget_in_tokens_comes_from_the_config_without_weights():
    from analysis.replay.simulate import model_geometry

    g = model_geometry(dtype="float32", device="cpu")
    assert (g.kv_bytes_per_token, g.max_context) == (2 * 30 * 3 * 64 * 4, 8192)  # SmolLM2-135M, fp32
    assert model_geometry(dtype="bfloat16", device="cpu").kv_bytes_per_token == g.kv_bytes_per_token // 2
