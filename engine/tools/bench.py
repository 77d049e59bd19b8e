"""Benchmark: prefill with reuse through the engine vs full prefill vs the ideal path.

    python -m engine.tools.bench [--sizes 256,1024,2048,4096] [--suffix 32] [--repeats 3] [--model ID]

For each cached-prefix size, all in one process and interleaved per repeat:

- full: prefill of prefix + suffix from scratch (no reuse);
- engine: the engine's prefill path on a warm cache: tree match, lock, copy of
  the prefix's KV from the pool into the request buffer, suffix forward,
  insert of the suffix into the tree and pool;
- ideal: the same suffix forward on a ready-made ``DynamicCache`` holding the
  prefix (no tree, no pool, no copy beyond what ``DynamicCache`` itself does);
- tree: the pure radix-tree work of one hit (match + insert), as a share of
  the engine's prefill time.

Prints medians and the ratios: speedup = full / engine, overhead = engine / ideal - 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from engine.engine import Engine
from engine.radix_tree import CacheKey, RadixTree


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


def bench_size(engine: Engine, prefix_len: int, suffix_len: int, repeats: int, seed: int = 0) -> dict:
    runner = engine.runner
    vocab = len(runner.tokenizer)
    gen = torch.Generator().manual_seed(seed + prefix_len)
    prefix = torch.randint(10, vocab, (prefix_len,), generator=gen).tolist()
    suffixes = [torch.randint(10, vocab, (suffix_len,), generator=gen).tolist() for _ in range(repeats + 1)]

    # Warm the cache with the prefix, and keep its KV for the ideal path.
    kv = runner.new_request_kv(prefix_len + 1)
    warm = engine.prefill(CacheKey(tuple(prefix)), kv)
    assert warm.cached_tokens == 0
    prefix_kv = [(kv.k[i, :, :prefix_len].unsqueeze(0).clone(), kv.v[i, :, :prefix_len].unsqueeze(0).clone())
                 for i in range(runner.num_layers)]

    full, eng, ideal, tree_ms, max_diff = [], [], [], [], 0.0
    for r, suffix in enumerate(suffixes):
        ids = prefix + suffix
        # full prefill, no reuse
        ref_logits, ms = runner.baseline_prefill(ids)
        full.append(ms)
        # engine path
        kv = runner.new_request_kv(len(ids))
        res = engine.prefill(CacheKey(tuple(ids)), kv)
        assert res.cached_tokens == prefix_len, res.cached_tokens
        eng.append(res.prefill_ms)
        max_diff = max(max_diff, float((res.logits - ref_logits).abs().max()))
        # ideal path
        cache = _ideal_cache(prefix_kv)
        positions = torch.arange(prefix_len, len(ids), device=runner.device).unsqueeze(0)
        runner.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            runner.model(input_ids=torch.tensor([suffix], device=runner.device), position_ids=positions,
                         cache=cache, use_cache=True, logits_to_keep=1)
        runner.synchronize()
        ideal.append((time.perf_counter() - t0) * 1000)
        # pure tree work of one hit: match the prefix, insert the new suffix
        tree = RadixTree()
        tree.insert(CacheKey(tuple(prefix)), [None] * prefix_len)
        t0 = time.perf_counter()
        tree.match(CacheKey(tuple(ids)), max_len=len(ids) - 1)
        tree.insert(CacheKey(tuple(ids)), [None] * len(ids))
        tree_ms.append((time.perf_counter() - t0) * 1000)
        if r == 0:  # first round warms kernels for these shapes; not counted
            full, eng, ideal, tree_ms = [], [], [], []
    med = statistics.median
    row = dict(cached=prefix_len, suffix=suffix_len, full_ms=med(full), engine_ms=med(eng), ideal_ms=med(ideal),
               tree_ms=med(tree_ms), max_logit_diff=max_diff)
    row["speedup"] = row["full_ms"] / row["engine_ms"]
    row["overhead"] = row["engine_ms"] / row["ideal_ms"] - 1
    row["tree_share"] = row["tree_ms"] / row["engine_ms"]
    return row


def format_table(rows: list[dict], title: str) -> str:
    lines = [title, "",
             "| cached tokens | + suffix | full prefill | engine (reuse) | ideal | speedup vs full | engine overhead "
             "vs ideal | tree match+insert | max logit diff |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['cached']:,} | {r['suffix']} | {r['full_ms']:,.0f} ms | {r['engine_ms']:,.1f} ms | "
                     f"{r['ideal_ms']:,.1f} ms | {r['speedup']:.1f}x | {r['overhead']:+.1%} | "
                     f"{r['tree_ms']:.2f} ms ({r['tree_share']:.2%}) | {r['max_logit_diff']:.1e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.tools.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="256,1024,2048,4096", help="cached prefix sizes, comma-separated")
    p.add_argument("--suffix", type=int, default=32, help="new tokens after the cached prefix")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per size (median reported)")
    p.add_argument("--model", default="embedded")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)
    from engine.model_loader import ModelLoadError, load_model
    from engine.model_runner import ModelRunner

    try:
        runner = ModelRunner(load_model(args.model, args.device, args.dtype))
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    engine = Engine(runner, budget_bytes=(sum(sizes) + (args.repeats + 2) * args.suffix * len(sizes) + 64)
                    * runner.kv_bytes_per_token)
    rows = []
    for size in sizes:
        print(f"benchmarking {size} cached + {args.suffix} new tokens ...", file=sys.stderr, flush=True)
        rows.append(bench_size(engine, size, args.suffix, args.repeats))
    engine.check_invariants()
    dev = runner.device
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{dev.type}, {torch.get_num_threads()} threads"
    print(format_table(rows, f"{runner.name}, {str(runner.dtype).replace('torch.', '')}, {where}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
