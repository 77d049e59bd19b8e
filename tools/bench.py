"""Benchmark: prefill with reuse through the engine vs full prefill vs the ideal path, per dtype.

    python -m tools.bench [--sizes 256,1024,2048,4096] [--suffix 32] [--repeats 3] [--model ID]
                                 [--dtypes float32,bfloat16]

For each cached-prefix size, all in one process and interleaved per repeat:

- full: prefill of prefix + suffix from scratch (no reuse): the app's one no-reuse
  measurement (``analysis.no_reuse.no_reuse_prefill``, the engine's scratch pool, in one block);
- engine: the scheduler's prefill path on a warm cache (``Engine.prefill_in_pool``):
  tree match and lock, the prefix's KV read in place from the pool, the suffix
  forward into pool slots of the request's own, which then pass to the tree;
- tier: the same serving path after the prefix was evicted to the second tier
  (disk chunks on a CPU, host memory on a GPU): loading it back into the pool
  instead of recomputing it, then the suffix forward;
- ideal: the same suffix forward on a ready-made ``DynamicCache`` holding the
  prefix (no tree, no pool, no copy beyond what ``DynamicCache`` itself does);
- tree: the pure radix-tree work of one hit (match + insert), as a share of
  the engine's prefill time.

Prints medians and the ratios: speedup = full / engine, overhead = engine / ideal - 1.
Exactness, per size: the largest difference between the engine's logits and full
prefill's, and how many tokens of a short greedy generation (``--greedy-tokens``)
are the same with reuse (warm cache) as without (an engine with no cache); per
dtype, whether greedy answers to a few support-chat questions are identical. With
several ``--dtypes`` (the model is loaded once per dtype, all in one run) a second
table puts them side by side: how much faster each path is than in the first dtype,
and the KV bytes per token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from analysis.no_reuse import no_reuse_prefill
from engine.engine import Engine
from engine.kvcache.kv_tier import CHUNK_TOKENS
from engine.kvcache.radix_tree import RadixTree
from engine.types import CacheKey, GenerationRequest, SamplingParams


def _ideal_cache(prefix_kv):
    """A DynamicCache already holding the prefix, built without copying it."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for k, v in prefix_kv:
        layer = cache.layer_class_to_replicate()
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
        cache.layers.append(layer)
    return cache


def greedy_agreement(engine: Engine, ids: list[int], new_tokens: int) -> tuple[int, int]:
    """Greedy tokens of ``ids`` with reuse (``engine``, whose cache holds a prefix of ``ids``) vs
    without (a twin engine with no cache): (tokens equal before the first difference, tokens compared)."""
    request = GenerationRequest(prompt_ids=tuple(ids), sampling=SamplingParams(max_new_tokens=new_tokens))
    with_reuse = engine.run(request).output_ids
    without = Engine(engine.runner, enable_cache=False).run(request).output_ids
    same = next((i for i, (a, b) in enumerate(zip(with_reuse, without, strict=False)) if a != b),
                min(len(with_reuse), len(without)))
    return same, max(len(with_reuse), len(without))  # equal lists: same == compared


# A short support chat (a long-ish system prompt every question shares, as on the app's first tab): the
# realistic case for answer agreement. Random-token prompts (the timing rows) have nearly flat logits, so a
# rounding difference flips a greedy pick far more easily there: they are the worst case.
CHAT_SYSTEM = (
    "You are the support assistant of a small online bookshop. Orders ship within 3 business days. Shipping "
    "is free over $40, otherwise $5. Books can be returned unread within 30 days for a full refund. Gift cards "
    "never expire. Answer in two short, friendly sentences.")
CHAT_QUESTIONS = ("Can I return a book I already read?", "How much is shipping on a $25 order?",
                  "Do gift cards expire?", "How fast do you ship?")


def chat_agreement(engine: Engine, new_tokens: int = 32) -> tuple[int, int]:
    """Greedy answers to ``CHAT_QUESTIONS`` with reuse (the system prompt cached after the first) vs without:
    (answers identical, answers compared); (0, 0) for a model without a chat template."""
    if not engine.text.has_chat_template:
        return 0, 0
    plain, same = Engine(engine.runner, enable_cache=False), 0
    for question in CHAT_QUESTIONS:
        request = GenerationRequest(messages=({"role": "system", "content": CHAT_SYSTEM},
                                              {"role": "user", "content": question}),
                                    sampling=SamplingParams(max_new_tokens=new_tokens))
        same += engine.run(request).output_ids == plain.run(request).output_ids
    return same, len(CHAT_QUESTIONS)


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().max())


def _ideal_ms(runner, prefix_kv, prefix_len: int, suffix: list[int]) -> float:
    """The ideal path: the suffix forward on a ready-made ``DynamicCache`` (no tree, no pool)."""
    cache = _ideal_cache(prefix_kv)
    positions = torch.arange(prefix_len, prefix_len + len(suffix), device=runner.device).unsqueeze(0)
    runner.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        runner.model(input_ids=torch.tensor([suffix], device=runner.device), position_ids=positions,
                     use_cache=True, logits_to_keep=1, **{runner.cache_arg: cache})
    runner.synchronize()
    return (time.perf_counter() - t0) * 1000


def bench_size(engine: Engine, prefix_len: int, suffix_len: int, repeats: int, seed: int = 0,
               greedy_tokens: int = 16) -> dict:
    runner = engine.runner
    vocab = len(runner.text.tokenizer)
    gen = torch.Generator().manual_seed(seed + prefix_len)
    prefix = torch.randint(10, vocab, (prefix_len,), generator=gen).tolist()
    suffixes = [torch.randint(10, vocab, (suffix_len,), generator=gen).tolist() for _ in range(repeats + 1)]
    greedy_suffix = torch.randint(10, vocab, (suffix_len,), generator=gen).tolist()
    tier_suffixes = [torch.randint(10, vocab, (suffix_len,), generator=gen).tolist() for _ in range(repeats + 1)]

    # Warm the cache with the prefix, and keep its KV for the ideal path.
    kv = runner.new_request_kv(prefix_len + 1)
    warm = engine.prefill(CacheKey(tuple(prefix)), kv)
    assert warm.cached_tokens == 0
    # Tensor work here runs on the runner's compute thread, like the engine's: a second thread with
    # an OpenMP pool of its own would slow both paths (see engine.model.compute_thread).
    prefix_kv = runner.compute.call(lambda: [(kv.k[i, :, :prefix_len].unsqueeze(0).clone(),
                                              kv.v[i, :, :prefix_len].unsqueeze(0).clone())
                                             for i in range(runner.num_layers)])

    full, eng, ideal, tree_ms, tier, max_diff = [], [], [], [], [], 0.0
    for r, suffix in enumerate(suffixes):
        ids = prefix + suffix
        # full prefill, no reuse: the one no-reuse measurement, one block
        scratch = no_reuse_prefill(engine, CacheKey(tuple(ids)), block_tokens=len(ids))
        ref_logits = scratch.last_logits
        full.append(scratch.forward_ms)
        # engine path: what serving does
        res = engine.prefill_in_pool(CacheKey(tuple(ids)))
        assert res.cached_tokens == prefix_len, res.cached_tokens
        eng.append(res.prefill_ms)
        max_diff = max(max_diff, runner.compute.call(_max_abs_diff, res.logits, ref_logits))
        if engine.tier is not None:  # the prefix out of the pool, into the second tier, and back
            engine.offload_cache()
            tier_ids = prefix + tier_suffixes[r]
            res = engine.prefill_in_pool(CacheKey(tuple(tier_ids)))
            assert res.cached_tokens == prefix_len // CHUNK_TOKENS * CHUNK_TOKENS, res.cached_tokens
            tier.append(res.prefill_ms)
            tier_ref = no_reuse_prefill(engine, CacheKey(tuple(tier_ids)), block_tokens=len(tier_ids)).last_logits
            max_diff = max(max_diff, runner.compute.call(_max_abs_diff, res.logits, tier_ref))
        ideal.append(runner.compute.call(_ideal_ms, runner, prefix_kv, prefix_len, suffix))
        # pure tree work of one hit: match the prefix, insert the new suffix
        tree = RadixTree()
        tree.insert(CacheKey(tuple(prefix)), [None] * prefix_len)
        t0 = time.perf_counter()
        tree.match(CacheKey(tuple(ids)), max_len=len(ids) - 1)
        tree.insert(CacheKey(tuple(ids)), [None] * len(ids))
        tree_ms.append((time.perf_counter() - t0) * 1000)
        if r == 0:  # first round warms kernels for these shapes; not counted
            full, eng, ideal, tree_ms, tier = [], [], [], [], []
    same, compared = greedy_agreement(engine, prefix + greedy_suffix, greedy_tokens) if greedy_tokens else (0, 0)
    med = statistics.median
    row = dict(cached=prefix_len, suffix=suffix_len, dtype=str(runner.dtype).replace("torch.", ""),
               full_ms=med(full), engine_ms=med(eng), ideal_ms=med(ideal), tree_ms=med(tree_ms),
               max_logit_diff=max_diff, greedy_same=same, greedy_tokens=compared,
               kv_bytes_per_token=runner.kv_bytes_per_token)
    row["speedup"] = row["full_ms"] / row["engine_ms"]
    row["overhead"] = row["engine_ms"] / row["ideal_ms"] - 1
    row["tree_share"] = row["tree_ms"] / row["engine_ms"]
    row["tier_ms"] = med(tier) if tier else None
    return row


def format_table(rows: list[dict], title: str) -> str:
    lines = [title, "",
             "| cached tokens | + suffix | dtype | full prefill | engine (reuse) | ideal | speedup vs full | engine "
             "overhead vs ideal | tree match+insert | max logit diff | greedy tokens same with/without reuse "
             "| second tier: load + suffix | tier vs recompute |",
             "|---:|---:|:--|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['cached']:,} | {r['suffix']} | {r.get('dtype', '')} | {r['full_ms']:,.0f} ms | "
                     f"{r['engine_ms']:,.1f} ms | {r['ideal_ms']:,.1f} ms | {r['speedup']:.1f}x | "
                     f"{r['overhead']:+.1%} | {r['tree_ms']:.2f} ms ({r['tree_share']:.2%}) | "
                     f"{r['max_logit_diff']:.1e} | {r.get('greedy_same', 0)} of {r.get('greedy_tokens', 0)} | "
                     + (f"{r['tier_ms']:,.1f} ms | {r['full_ms'] / r['tier_ms']:.1f}x |" if r.get("tier_ms") else
                        "- | - |"))
    return "\n".join(lines)


def format_dtype_table(rows: list[dict]) -> str:
    """Each dtype against the first one, size by size: how much faster, and the KV bytes per token."""
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    by = {(r["dtype"], r["cached"]): r for r in rows}
    first = dtypes[0]
    lines = [f"| cached tokens | dtype | full prefill vs {first} | engine (reuse) vs {first} | speedup from reuse "
             "| KV bytes per token | greedy tokens same with/without reuse |",
             "|---:|:--|---:|---:|---:|---:|---:|"]
    for size in dict.fromkeys(r["cached"] for r in rows):
        base = by.get((first, size))
        for dtype in dtypes:
            r = by.get((dtype, size))
            if r is None or base is None:
                continue
            lines.append(f"| {size:,} | {dtype} | {base['full_ms'] / r['full_ms']:.2f}x | "
                         f"{base['engine_ms'] / r['engine_ms']:.2f}x | {r['speedup']:.1f}x | "
                         f"{r['kv_bytes_per_token']:,} | {r['greedy_same']} of {r['greedy_tokens']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="256,1024,2048,4096", help="cached prefix sizes, comma-separated")
    p.add_argument("--suffix", type=int, default=32, help="new tokens after the cached prefix")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per size (median reported)")
    p.add_argument("--greedy-tokens", type=int, default=16,
                   help="greedy tokens generated with and without reuse to compare (0: skip)")
    p.add_argument("--model", default="embedded")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="one dtype (auto, float32, bfloat16, float16)")
    p.add_argument("--dtypes", default=None, help="several, side by side in one run, e.g. float32,bfloat16")
    p.add_argument("--no-tier", action="store_true", help="skip the second-tier row (disk on CPU, host memory on GPU)")
    p.add_argument("--json", default=None, help="also write the rows and the title to this file")
    args = p.parse_args(argv)
    from engine.model.loader import ModelLoadError, load_model
    from engine.model.runner import ModelRunner

    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    dtypes = [d.strip() for d in (args.dtypes or args.dtype).split(",") if d.strip()]
    rows, titles, chats = [], [], []
    for dtype in dtypes:
        try:
            runner = ModelRunner(load_model(args.model, args.device, dtype))
        except ModelLoadError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        import tempfile

        tier_dir = None if runner.device.type != "cpu" or args.no_tier else tempfile.mkdtemp(prefix="radix-tier-")
        engine = Engine(runner, budget_bytes=(sum(sizes) + (args.repeats + 3) * args.suffix * len(sizes) * 2
                                              + (args.greedy_tokens + 64) * len(sizes)) * runner.kv_bytes_per_token,
                        tier_bytes=0 if args.no_tier else 4 * 2**30, tier_dir=tier_dir)
        for size in sizes:
            print(f"benchmarking {size} cached + {args.suffix} new tokens, {dtype} ...", file=sys.stderr, flush=True)
            rows.append(bench_size(engine, size, args.suffix, args.repeats, greedy_tokens=args.greedy_tokens))
        if args.greedy_tokens:
            print(f"comparing chat answers with and without reuse, {dtype} ...", file=sys.stderr, flush=True)
            same, total = chat_agreement(engine, 2 * args.greedy_tokens)
            if total:
                chats.append(f"{str(runner.dtype).replace('torch.', '')}: greedy answers ({2 * args.greedy_tokens} "
                             f"tokens) to {total} support-chat questions, identical with and without reuse: "
                             f"{same} of {total}")
        engine.check_invariants()
        dev = runner.device
        where = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
                 else f"{dev.type}, {torch.get_num_threads()} threads")
        titles.append(f"{runner.name}, {where}")
        engine.close()
        if tier_dir is not None:
            import shutil

            shutil.rmtree(tier_dir, ignore_errors=True)
        runner.close()  # its compute thread (and OpenMP pool) ends before the next dtype's starts
        del engine, runner
    print(format_table(rows, "; ".join(dict.fromkeys(titles))))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(title="; ".join(dict.fromkeys(titles)), rows=rows, chats=chats), f, indent=1)
    if len(dtypes) > 1:
        print()
        print(format_dtype_table(rows))
    if chats:
        print("\nGreedy tokens in the tables: a random-token prompt (the worst case: nearly flat logits).")
        print("\n".join(chats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
