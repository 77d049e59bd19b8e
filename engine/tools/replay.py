"""Replay a prompt log through the engine and see what prefix caching saves.

    python -m engine.tools.replay TRACE.jsonl [--no-cache] [--baseline] [--budget-mb N]
                            [--model ID] [--max-new-tokens N] [--device D] [--dtype T]

Each TRACE line is ``{"messages": [...]}`` (chat template applied, generation
prompt added) or ``{"prompt": "..."}`` (raw text, tokenized as is), with
optional ``"max_new_tokens"`` and ``"session"`` (a cache namespace). Decoding
is greedy. stdout gets one JSON object per request, then ``{"summary": {...}}``;
progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from engine.engine import Engine
from engine.types import EngineError, GenerationRequest, SamplingParams


def read_trace(path: Path) -> Iterator[tuple[int, dict]]:
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise EngineError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(item, dict) or ("messages" in item) == ("prompt" in item):
                raise EngineError(f"{path}:{lineno}: each line needs exactly one of \"messages\" or \"prompt\"")
            yield lineno, item


def to_request(item: dict, max_new_tokens: int, baseline: bool) -> GenerationRequest:
    sampling = SamplingParams(max_new_tokens=int(item.get("max_new_tokens", max_new_tokens)))
    namespace = str(item.get("session", ""))
    if "messages" in item:
        if not isinstance(item["messages"], list):
            raise EngineError("\"messages\" must be a list of {role, content} objects")
        return GenerationRequest(messages=tuple(item["messages"]), sampling=sampling, measure_baseline=baseline,
                                 namespace=namespace, tag="replay")
    return GenerationRequest(prompt=str(item["prompt"]), sampling=sampling, measure_baseline=baseline,
                             namespace=namespace, tag="replay")


def replay(engine: Engine, items: Iterable[tuple[int, dict]], max_new_tokens: int, baseline: bool,
           out=sys.stdout, err=sys.stderr) -> dict:
    n = hit = prompt = saved = peak = 0
    prefill = baseline_sum = 0.0
    baseline_n = 0
    for index, (lineno, item) in enumerate(items):
        try:
            m = engine.run(to_request(item, max_new_tokens, baseline))
        except EngineError as exc:
            print(f"line {lineno}: skipped: {exc}", file=err)
            continue
        n += 1
        prompt += m.prompt_tokens
        hit += m.cached_tokens
        saved += m.cached_tokens
        prefill += m.prefill_ms
        peak = max(peak, m.cache_bytes)
        if m.baseline_prefill_ms is not None:
            baseline_sum += m.baseline_prefill_ms
            baseline_n += 1
        record = {
            "index": index, "line": lineno, "prompt_tokens": m.prompt_tokens, "cached_tokens": m.cached_tokens,
            "computed_tokens": m.computed_tokens, "prefill_ms": round(m.prefill_ms, 3),
            "baseline_prefill_ms": None if m.baseline_prefill_ms is None else round(m.baseline_prefill_ms, 3),
            "ttft_ms": round(m.ttft_ms, 3), "output_text": m.output_text, "prompt_ids": m.prompt_ids,
            "output_ids": m.output_ids, "cache_bytes": m.cache_bytes, "cache_budget_bytes": m.cache_budget_bytes,
            "evicted_tokens": m.evicted_tokens,
        }
        print(json.dumps(record, ensure_ascii=False), file=out, flush=True)
        print(f"[{index + 1}] {m.prompt_tokens} prompt tokens, {m.cached_tokens} cached, "
              f"prefill {m.prefill_ms:.0f} ms", file=err, flush=True)
    summary = {
        "requests": n, "prompt_tokens": prompt, "cached_tokens": hit,
        "token_hit_rate": round(hit / prompt, 4) if prompt else 0.0, "tokens_saved": saved,
        "mean_prefill_ms": round(prefill / n, 3) if n else None,
        "mean_baseline_prefill_ms": round(baseline_sum / baseline_n, 3) if baseline_n else None,
        "peak_cache_bytes": peak,
    }
    print(json.dumps({"summary": summary}), file=out, flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.tools.replay", description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path, help="JSONL file, one request per line")
    p.add_argument("--no-cache", action="store_true", help="no reuse at all (cached_tokens is 0)")
    p.add_argument("--baseline", action="store_true", help="also time each prompt's prefill with no reuse")
    p.add_argument("--budget-mb", type=float, default=None, help="KV cache budget in MiB")
    p.add_argument("--model", default="embedded", help="HF causal LM id or path (default: embedded SmolLM2)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="default per request (a line may override)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)
    if not args.trace.exists():
        print(f"error: no such trace file: {args.trace}", file=sys.stderr)
        return 2
    from engine.model_loader import ModelLoadError, load_model
    from engine.model_runner import ModelRunner

    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    try:
        runner = ModelRunner(load_model(args.model, args.device, args.dtype))
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    budget = None if args.budget_mb is None else int(args.budget_mb * 2**20)
    engine = Engine(runner, budget_bytes=budget, enable_cache=not args.no_cache, max_new_tokens_cap=10**6)
    try:
        replay(engine, read_trace(args.trace), args.max_new_tokens, args.baseline)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
