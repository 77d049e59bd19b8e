"""Replay a prompt log and see what prefix caching saves, and why it misses.

    python -m tools.replay LOG.jsonl --simulate --report report.html [--ttl 5m] [--budget-mb N] [--disk-cache-mb N]
    python -m tools.replay LOG.jsonl [--baseline] [--no-cache] [--report report.html]

Two speeds:

- ``--simulate``: the model's tokenizer and the pure radix tree with the
  engine's budget and LRU eviction; no model runs (hits, tokens and cost, no
  timings); thousands of requests a second. ``--ttl 5m|1h`` adds the hosted
  APIs' time-to-live on the log's timestamps. ``--disk-cache-mb N`` adds the
  engine's second tier (evicted prefixes kept in 64-token chunks, loaded back
  instead of recomputed) with its own budget.
- default: every request runs on the real model through the engine (measured
  prefill; ``--baseline`` also times each prompt with no reuse). stdout gets one
  JSON object per request, as before.

Log lines: ``{"messages": [...]}``, ``{"prompt": "..."}``, OpenAI Batch API lines
(``{"custom_id", "body": {"messages": ...}}``) or ShareGPT
(``{"conversations": [{"from", "value"}]}``), with optional ``timestamp``,
``session``, ``max_new_tokens`` and ``response`` (see analysis/replay/log_formats.py).
A malformed line is reported with its number and skipped (``--strict`` stops).
``LOG.jsonl.gz`` is read compressed.
stdout ends with ``{"summary": {...}}``; a progress bar goes to stderr. Ctrl-C
stops after the current request and still writes the report. Nothing in the log
leaves this machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import signal
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

from analysis.lab.cost_estimate import PricingRules
from analysis.no_reuse import run_measured
from analysis.replay.log_formats import LogLineError, LogOrder, LogRecord, SkippedLine, parse_ttl, read_log
from analysis.replay.replay_stats import ReplayReport, ReplayStats, summary_text
from engine.types import EngineError, GenerationRequest, SamplingParams


# ------------------------------------------------------------------ Ctrl-C
class StopFlag:
    """First Ctrl-C asks the replay to stop after the current request (the report is
    still written); a second one aborts at once."""

    def __init__(self, err: TextIO | None = None) -> None:
        self.stop, self.err, self._previous = False, err or sys.stderr, None

    def __enter__(self) -> StopFlag:
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.stop:
            raise KeyboardInterrupt
        self.stop = True
        print("\nstopping after the current request; the report covers what was replayed "
              "(Ctrl-C again to abort)", file=self.err, flush=True)

    def __call__(self) -> bool:
        return self.stop


# ------------------------------------------------------------------ progress
class Progress:
    """A tqdm bar on stderr: requests, prompt tokens and the running token hit rate."""

    def __init__(self, enabled: bool, label: str) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(desc=label, unit=" req", file=sys.stderr, mininterval=0.5, dynamic_ncols=True)

    def update(self, stats: ReplayStats) -> None:
        if self.bar is None:
            return
        rate = stats.cached_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0
        self.bar.set_postfix_str(f"{stats.prompt_tokens:,} tokens, {rate:.0%} from cache"
                                 + (f", {stats.skipped_count:,} skipped" if stats.skipped_count else ""), refresh=False)
        self.bar.update(stats.requests - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ------------------------------------------------------------------ the real model
def to_request(record: LogRecord, max_new_tokens: int, baseline: bool,
               sampling: SamplingParams | None = None) -> GenerationRequest:
    """The engine request for one log record; ``sampling`` carries the loop guard (greedy, off by default)."""
    sampling = dataclasses.replace(sampling or SamplingParams(),
                                   max_new_tokens=record.max_new_tokens if record.max_new_tokens is not None
                                   else max_new_tokens)
    common = dict(sampling=sampling, measure_baseline=baseline, namespace=record.session, tag="replay")
    if record.messages is not None:
        return GenerationRequest(messages=record.messages, **common)
    return GenerationRequest(prompt=record.prompt, **common)


def replay_on_engine(engine, records: Iterable[LogRecord], stats: ReplayStats, max_new_tokens: int, baseline: bool,
                     out: TextIO | None = None, err: TextIO | None = None, progress: Progress | None = None,
                     should_stop=lambda: False, sampling: SamplingParams | None = None) -> tuple[bool, int]:
    """Run each record on the engine; one JSON line per request on ``out`` (default: stdout,
    looked up at call time). Returns (stopped, peak cache bytes)."""
    out, err = out or sys.stdout, err or sys.stderr
    peak, now, index = 0, 0.0, 0
    for record in records:
        try:
            m = run_measured(engine, to_request(record, max_new_tokens, baseline, sampling))
        except EngineError as exc:
            print(f"line {record.line}: skipped: {exc}", file=err, flush=True)
            stats.skip(SkippedLine(record.line, str(exc)))
            continue
        stamp = record.timestamp
        now = max(stamp, now + 1e-6) if stamp is not None else now + 1e-6
        text = engine.render_chat(record.messages) if record.messages is not None else record.prompt or ""
        fed = list(m.prompt_ids) + list(m.output_ids[:-1])  # the last sampled token is never fed
        kind = stats.observe(record, m.prompt_ids, fed, m.cached_tokens, text, now, m.prefill_ms,
                             m.baseline_prefill_ms, m.tier_tokens)
        peak = max(peak, m.cache_bytes)
        print(json.dumps({
            "index": index, "line": record.line, "prompt_tokens": m.prompt_tokens, "cached_tokens": m.cached_tokens,
            "computed_tokens": m.computed_tokens, "prefill_ms": round(m.prefill_ms, 3),
            "baseline_prefill_ms": None if m.baseline_prefill_ms is None else round(m.baseline_prefill_ms, 3),
            "ttft_ms": None if m.ttft_ms is None else round(m.ttft_ms, 3), "output_text": m.output_text,
            "prompt_ids": m.prompt_ids, "output_ids": m.output_ids, "cache_bytes": m.cache_bytes, "cache_budget_bytes": m.cache_budget_bytes,
            "evicted_tokens": m.evicted_tokens, "miss_cause": kind,
            **({"tier_tokens": m.tier_tokens} if getattr(engine, "tier", None) is not None else {}),
        }, ensure_ascii=False), file=out, flush=True)
        index += 1
        if progress is not None:
            progress.update(stats)
        if should_stop():
            return True, peak
    return False, peak


# ------------------------------------------------------------------ command line
def summary_json(report: ReplayReport, peak_cache_bytes: int | None = None, report_path: Path | None = None) -> dict:
    n = report.requests
    return {
        "mode": report.mode, "requests": n, "prompt_tokens": report.prompt_tokens,
        "cached_tokens": report.cached_tokens, "token_hit_rate": round(report.hit_rate, 4),
        "tokens_saved": report.cached_tokens,
        **({"tier_tokens": report.tier_tokens, "tier_budget_bytes": report.tier_budget_bytes}
           if report.has_tier else {}),
        "mean_prefill_ms": round(report.prefill_ms / n, 3) if report.prefill_ms is not None and n else None,
        "mean_baseline_prefill_ms": (round(report.baseline_prefill_ms / max(1, _baseline_count(report)), 3)
                                     if report.baseline_prefill_ms is not None else None),
        "peak_cache_bytes": (peak_cache_bytes if peak_cache_bytes is not None
                             else report.peak_cached_tokens * report.kv_bytes_per_token),
        "evicted_tokens": report.evicted_tokens, "expired_tokens": report.expired_tokens,
        "miss_causes": {c.kind: {"requests": c.requests, "computed_tokens": c.computed_tokens,
                                 "share_of_computed": round(c.share_of_computed, 4)} for c in report.causes},
        "block_cached_tokens": report.granularity, "skipped_lines": report.skipped_count,
        "hosted_api_usd": {"without_caching": round(report.cost.usd_without_caching, 6),
                           "with_caching": round(report.cost.usd_with_caching, 6)},
        "stopped": report.stopped, "elapsed_s": round(report.elapsed_s, 3),
        "report": None if report_path is None else str(report_path), "text": summary_text(report),
    }


def _baseline_count(report: ReplayReport) -> int:
    return sum(report.series.baseline_count)


def open_log(path: Path) -> TextIO:
    """The log as text lines, streamed: ``.gz`` files decompressed on the fly, a UTF-8 byte-order
    mark ignored, undecodable bytes replaced (the line then fails to parse and is reported)."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8-sig", errors="replace")
    return path.open(encoding="utf-8-sig", errors="replace")


def write_report(report: ReplayReport, path: Path) -> None:
    """The HTML report is drawn by the UI layer's figure code (plotly), loaded only here:
    nothing in ``engine/`` imports this module, and ``engine/`` never imports the UI at
    module level (tests/test_layering.py)."""
    from components.views.replay_report import write_html

    write_html(report, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.replay", description=__doc__.split("\n\n")[0])
    p.add_argument("log", type=Path, help="JSONL file, one request per line (ShareGPT: one conversation)")
    p.add_argument("--simulate", action="store_true", help="tokenizer + radix tree only, no model (no timings)")
    p.add_argument("--report", type=Path, default=None, help="write a self-contained HTML report here")
    p.add_argument("--ttl", type=parse_ttl, default=None, help="simulation: entries expire after 5m, 1h, ...")
    p.add_argument("--strict", action="store_true", help="stop at the first malformed line")
    p.add_argument("--budget-mb", type=float, default=None, help="KV cache budget in MiB (default: the engine's)")
    p.add_argument("--disk-cache-mb", type=float, default=0.0, metavar="N",
                   help="a second tier of N MiB: evicted prefixes kept in 64-token chunks and loaded back instead of "
                        "recomputed (0: off). Simulation: simulated from the model's KV bytes per token. Real model: "
                        "the engine's own second tier (as app.py --disk-cache-mb), in a fresh temporary folder on a "
                        "CPU (a replay never reads another run's chunks), in host memory on a GPU")
    p.add_argument("--eviction-policy", default="lru", metavar="NAME",
                   help="lru (default) or lfu: as the app's flag (engine/kvcache/eviction.py)")
    p.add_argument("--model", default="embedded", help="HF causal LM id or path (default: embedded SmolLM2)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--no-cache", action="store_true", help="real model: no reuse at all (cached_tokens is 0)")
    p.add_argument("--baseline", action="store_true", help="real model: also time each prefill with no reuse")
    p.add_argument("--max-new-tokens", type=int, default=32, help="real model: default per request")
    p.add_argument("--no-repeat-ngram", type=int, default=0, metavar="N",
                   help="real model: loop guard, never repeat an N-gram of the answer (0: off; the page uses 4)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="P",
                   help="real model: loop guard, divide the logits of tokens already in the answer (1: off; the "
                        "page uses 1.1)")
    p.add_argument("--per-request", action="store_true", help="simulation: also print one JSON line per request")
    p.add_argument("--price-usd-per-mtok", type=float, default=PricingRules.input_usd_per_mtok,
                   help="cost estimate: input price per million tokens")
    p.add_argument("--cached-fraction", type=float, default=PricingRules.cached_fraction,
                   help="cost estimate: cached input costs this fraction of the input price")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = p.parse_args(argv)
    if not args.log.is_file():
        print(f"error: no such log file: {args.log}", file=sys.stderr)
        return 2
    if args.disk_cache_mb < 0:
        print("error: --disk-cache-mb cannot be negative", file=sys.stderr)
        return 2
    if args.ttl is not None and not args.simulate:
        print("error: --ttl needs --simulate (the engine itself has no time-to-live)", file=sys.stderr)
        return 2
    try:
        pricing = PricingRules(args.price_usd_per_mtok, args.cached_fraction).validated()
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.report is not None:
        args.report.parent.mkdir(parents=True, exist_ok=True)
    try:
        report, peak = (_simulate(args, pricing) if args.simulate else _run_model(args, pricing))
    except (LogLineError, EngineError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for s in report.skipped[:20]:
        print(f"line {s.line}: skipped: {s.reason}", file=sys.stderr)
    if report.skipped_count > 20:
        print(f"... {report.skipped_count - 20:,} more skipped lines (listed in the report)", file=sys.stderr)
    if args.report is not None:
        write_report(report, args.report)
        print(f"report written to {args.report}", file=sys.stderr)
    print(json.dumps({"summary": summary_json(report, peak, args.report)}, ensure_ascii=False), flush=True)
    print(summary_text(report), file=sys.stderr)
    return 130 if report.stopped else 0


class ModelError(RuntimeError):
    """The model or tokenizer could not be loaded."""


def _simulate(args: argparse.Namespace, pricing: PricingRules) -> tuple[ReplayReport, int | None]:
    from analysis.replay.simulate import model_geometry, simulate_lines
    from engine.device_defaults import default_budget_bytes
    from engine.model.loader import ModelLoadError, load_tokenizer, resolve_device

    try:
        tokenizer = load_tokenizer(args.model)
        geometry = model_geometry(args.model, args.dtype, args.device)
        budget = (int(args.budget_mb * 2**20) if args.budget_mb is not None
                  else default_budget_bytes(resolve_device(args.device)))
    except (ModelLoadError, OSError, ValueError) as exc:
        raise ModelError(f"could not load the tokenizer or config of {args.model!r}: {exc}") from exc
    progress = Progress(not args.no_progress, "simulating")

    tier_bytes = int(args.disk_cache_mb * 2**20)

    def per_request(item, served, kind) -> None:
        line = {"line": item.record.line, "prompt_tokens": len(item.ids), "cached_tokens": served.cached_tokens,
                "evicted_tokens": served.evicted_tokens, "expired_tokens": served.expired_tokens, "miss_cause": kind}
        if tier_bytes > 0:
            line["tier_tokens"] = served.tier_tokens
        print(json.dumps(line), flush=False)

    with StopFlag() as stop, open_log(args.log) as fh:
        try:
            report = simulate_lines(fh, tokenizer, geometry, budget // geometry.kv_bytes_per_token, args.ttl,
                                    args.strict, pricing, args.log.name, on_progress=progress.update,
                                    should_stop=stop, on_request=per_request if args.per_request else None,
                                    tier_bytes=tier_bytes, eviction_policy=args.eviction_policy)
        finally:
            progress.close()
    return report, None


def _run_model(args: argparse.Namespace, pricing: PricingRules) -> tuple[ReplayReport, int]:
    from engine.engine import Engine
    from engine.model.loader import ModelLoadError, load_model
    from engine.model.runner import ModelRunner

    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    try:
        runner = ModelRunner(load_model(args.model, args.device, args.dtype))
    except ModelLoadError as exc:
        raise ModelError(str(exc)) from exc
    budget = None if args.budget_mb is None else int(args.budget_mb * 2**20)
    tier_bytes = int(args.disk_cache_mb * 2**20)
    # A fresh folder: a replay measures its own log, never chunks another run left (removed at exit).
    tier_dir = (tempfile.TemporaryDirectory(prefix="replay-kv-tier-")
                if tier_bytes > 0 and runner.device.type == "cpu" else None)
    engine = Engine(runner, budget_bytes=budget, enable_cache=not args.no_cache, max_new_tokens_cap=10**6,
                    tier_bytes=tier_bytes, tier_dir=None if tier_dir is None else tier_dir.name,
                    eviction_policy=args.eviction_policy)
    budget_tokens = engine.cache.budget_bytes // runner.kv_bytes_per_token
    stats = ReplayStats(budget_tokens, engine.decode, lambda t: len(engine.encode(t)) if t else 0,
                        engine.special_token_ids, None, pricing)
    order = LogOrder()
    progress = Progress(not args.no_progress, "replaying on the model")
    started = time.perf_counter()
    with StopFlag() as stop, open_log(args.log) as fh:
        try:
            records = read_log(fh, on_skip=stats.skip, strict=args.strict, order=order)
            guard = SamplingParams(no_repeat_ngram_size=args.no_repeat_ngram,
                                   repetition_penalty=args.repetition_penalty)
            stopped, peak = replay_on_engine(engine, records, stats, args.max_new_tokens, args.baseline,
                                             progress=progress, should_stop=stop, sampling=guard)
        finally:
            progress.close()
    s = engine.stats()
    notes = [f"Measured on the real model ({runner.name}, {runner.device}, {str(runner.dtype).removeprefix('torch.')})"
             f" with the engine's budget of {engine.cache.budget_bytes / 2**20:,.0f} MiB; greedy decoding"
             f"{'' if args.baseline else '; run with --baseline to also time every prefill with no reuse'}."]
    if args.no_cache:
        notes.append("--no-cache: the engine reused nothing; miss causes say what a cache would have matched.")
    report = stats.finish("measured", runner.name, args.log.name, runner.kv_bytes_per_token,
                          engine.snapshot(), stopped, time.perf_counter() - started, order.late,
                          s.evicted_tokens, 0, peak // max(1, runner.kv_bytes_per_token), notes,
                          engine.tier.budget_bytes if engine.tier is not None else None)
    return report, peak


if __name__ == "__main__":
    sys.exit(main())
