"""Tree-tab stall: does keeping the Radix tree tab open in many sessions slow a running stream?

The goal (issue #22): with a 5,000-node tree and the tree tab open in 8 sessions, a running
stream's inter-token time changes by under 10%. This script measures it on the engine the app
builds (``app.build_engine``, the app's own flags and defaults):

1. fills the cache with a tree of ``--nodes`` nodes by real prefills through the pool (each
   prompt a cached prefix of an earlier one cut at a random point plus a few new tokens: one
   split and one leaf), under a budget big enough that nothing is evicted;
2. streams one request of ``--new-tokens`` tokens and records its inter-token times
   (a) alone, (b) while ``--sessions`` simulated sessions keep the Radix tree tab open and
   (c) while as many sessions poll the public ``tree_snapshot`` endpoint, alternating
   (a), (b), (c) ``--rounds`` times.

A tab session runs exactly what the tab's timer tick runs on the server: the tree panel's
refresh (``components.panels.tree_panel``, through ``components.panels.live._quiet`` as ``LiveView.refresh_on``
wires it) with its own ``gr.Request`` (session hash) and its own ``seen`` state, at the
timer's own interval, from its own thread (phases spread over the interval, as browsers'
timers are), then Gradio's ``gr.Plot.postprocess`` of a figure it returns (the JSON the
server sends). Each session has drawn once before the stream starts (an open tab). An API
session calls the function registered as ``tree_snapshot``. It prints the median and p95
inter-token time of each mode, the ratios (b)/(a) and (c)/(a), and PASS when both of
(b)'s ratios are under 1.10.

    python tools/tree_stall.py                      # embedded model, 5,000 nodes, 8 sessions
    python tools/tree_stall.py --tiny --nodes 500   # the tests' tiny random Llama: a quick look
    python tools/tree_stall.py --isolate            # per-visitor namespaces, as on Spaces
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.measure import add_engine_args, offline_env, percentile  # noqa: E402

offline_env()

GOAL_RATIO = 1.10
MODES = ("alone", "tree tab", "tree_snapshot API")
PROMPT = "Write a long story about a lighthouse keeper who finds a map in a bottle. Describe every day of the week."
SUFFIX_TOKENS = (3, 8)  # new tokens per filling prompt (inclusive range)


@dataclass
class StallReport:
    num_nodes: int
    sessions: int
    tick_s: float
    evicted_tokens: int = 0
    gaps_ms: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in MODES})
    tokens: dict[str, list[int]] = field(default_factory=lambda: {m: [] for m in MODES})
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MODES, 0))  # ticks or API calls
    redraws: int = 0  # tab ticks that built and serialised a figure
    errors: list[str] = field(default_factory=list)

    def median(self, mode: str) -> float:
        return statistics.median(self.gaps_ms[mode]) if self.gaps_ms[mode] else float("nan")

    def p95(self, mode: str) -> float:
        return percentile(self.gaps_ms[mode], 0.95)

    def ratios(self, mode: str) -> tuple[float, float]:
        """(median, p95) of ``mode`` over those of the stream alone."""
        return self.median(mode) / self.median(MODES[0]), self.p95(mode) / self.p95(MODES[0])

    @property
    def passed(self) -> bool:
        return not self.errors and all(r < GOAL_RATIO for r in self.ratios(MODES[1]))


# ------------------------------------------------------------------ the engine and its tree
def load_runner(tiny: bool, model: str, device: str):
    """The embedded (or ``model``) runner, or the tests' tiny random Llama."""
    if tiny:
        from engine.model.loader import load_tokenizer
        from tests.conftest import make_tiny_runner

        return make_tiny_runner(load_tokenizer())
    from engine.model.loader import load_model
    from engine.model.runner import ModelRunner

    return ModelRunner(load_model(model, device=device))


def build_engine(runner, num_nodes: int, new_tokens: int, isolate: bool):
    """The app's engine (``app.build_engine``) with a budget that holds the whole tree and the
    stream, and no second tier (nothing is evicted, nothing written to disk)."""
    import app

    tokens = 64 + (num_nodes // 2 + 1) * SUFFIX_TOKENS[1] + 8 * (new_tokens + 200)
    budget_mb = tokens * runner.kv_bytes_per_token * 1.25 / 2**20 + 16
    args = app.parse_args(["--cache-budget-mb", f"{budget_mb:.1f}", "--disk-cache-mb", "0",
                           "--max-new-tokens", str(max(new_tokens, 16)), "--isolate" if isolate else "--no-isolate"])
    return app.build_engine(args, runner=runner)


def fill_tree(engine, num_nodes: int, seed: int = 0) -> int:
    """Grow the cache to ``num_nodes`` nodes by real prefills in the pool; returns prompts run."""
    from engine.types import CacheKey

    rng = random.Random(seed)
    vocab = engine.runner.text.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(48)]]
    engine.prefill_in_pool(CacheKey(tuple(prompts[0])))
    while engine.cache.num_nodes < num_nodes:
        base = rng.choice(prompts)
        cut = rng.randrange(1, len(base))
        ids = base[:cut] + [rng.randrange(10, vocab) for _ in range(rng.randint(*SUFFIX_TOKENS))]
        engine.prefill_in_pool(CacheKey(tuple(ids)))
        prompts.append(ids)
    return len(prompts)


# ------------------------------------------------------------------ the sessions
class TabSession:
    """One open Radix tree tab: its refresh as the timer tick runs it, with its own state."""

    def __init__(self, live, plot, index: int) -> None:
        import gradio as gr

        from components.panels.live import _quiet

        self.fn = _quiet(live.fn, len(live.outputs), live.status is not None)
        self.values = [getattr(c, "value", None) for c in live.inputs[1:-1]]  # colour, view, chains as shown
        self.plot, self.seen = plot, None
        self.request = gr.Request(session_hash=f"tree-stall-{index}")
        self.redraws = 0

    def tick(self) -> None:
        import plotly.graph_objects as go

        out = self.fn(None, *self.values, self.seen, self.request)
        fig, self.seen = out[0], out[1]
        if isinstance(fig, go.Figure):
            self.plot.postprocess(fig)  # what the server serialises and sends
            self.redraws += 1


def tree_panel_sessions(engine, sessions: int) -> tuple[list[TabSession], Callable, float]:
    """The tree panel built once (as the app builds it), ``sessions`` tab sessions on it, the
    function registered as the ``tree_snapshot`` endpoint, and the tab timer's interval."""
    import gradio as gr

    from components.panels.tree_panel import build_tree_panel

    with gr.Blocks() as blocks:
        last_metrics = gr.State(None)
        live = build_tree_panel(engine, last_metrics, active=True)
    plot = live.outputs[0]
    api = next(f.fn for f in blocks.fns.values() if f.api_name == "tree_snapshot")
    return [TabSession(live, plot, i) for i in range(sessions)], api, float(live.timer.value)


def _poll(call: Callable[[], None], interval_s: float, offset_s: float, stop: threading.Event, counts: list[int],
          errors: list[str]) -> None:
    next_at = time.perf_counter() + offset_s
    while not stop.is_set():
        wait = next_at - time.perf_counter()
        if wait > 0 and stop.wait(wait):
            return
        try:
            call()
            counts[0] += 1
        except Exception as exc:  # a finding: reported, the run goes on
            errors.append(f"{type(exc).__name__}: {exc}")
        next_at = max(next_at + interval_s, time.perf_counter())


def stream_gaps(engine, new_tokens: int) -> list[float]:
    """One streamed request: milliseconds between consecutive tokens (the first, after the
    prefill, is not a gap)."""
    from engine.types import GenerationRequest, SamplingParams

    sampling = SamplingParams(max_new_tokens=new_tokens, no_repeat_ngram_size=4)
    stamps = [time.perf_counter() for e in engine.submit(GenerationRequest(
        messages=({"role": "user", "content": PROMPT},), sampling=sampling, tag="tree-stall"))
        if e.token_id is not None]
    return [(b - a) * 1000 for a, b in zip(stamps, stamps[1:], strict=False)]


def _with_pollers(engine, calls: list[Callable[[], None]], interval_s: float, new_tokens: int,
                  errors: list[str]) -> tuple[list[float], int]:
    """Stream while each of ``calls`` runs every ``interval_s`` from its own thread (phases
    spread over the interval); every poller runs once before the stream starts."""
    stop = threading.Event()
    counts = [[0] for _ in calls]
    threads = [threading.Thread(target=_poll, args=(c, interval_s, i * interval_s / len(calls), stop, n, errors),
                                daemon=True) for i, (c, n) in enumerate(zip(calls, counts, strict=True))]
    for t in threads:
        t.start()
    deadline = time.perf_counter() + 30 * interval_s + 60
    while any(n[0] == 0 for n in counts) and time.perf_counter() < deadline and not errors:
        time.sleep(0.01)
    try:
        gaps = stream_gaps(engine, new_tokens)
    finally:
        stop.set()
        for t in threads:
            t.join()
    return gaps, sum(n[0] for n in counts)


def measure(engine, num_nodes: int, sessions: int = 8, new_tokens: int = 200, rounds: int = 3,
            log: Callable[[str], None] = print) -> StallReport:
    """Fill the tree, then alternate the three modes ``rounds`` times (see the module docstring)."""
    import gradio as gr

    t0 = time.perf_counter()
    prompts = fill_tree(engine, num_nodes)
    log(f"tree: {engine.cache.num_nodes:,} nodes, {engine.cache.num_tokens:,} tokens from {prompts:,} prefills "
        f"in {time.perf_counter() - t0:.1f} s")
    tabs, api, tick_s = tree_panel_sessions(engine, sessions)
    report = StallReport(engine.cache.num_nodes, sessions, tick_s)
    api_calls = [lambda req=gr.Request(session_hash=f"tree-stall-api-{i}"): api(req) for i in range(sessions)]
    stream_gaps(engine, min(new_tokens, 8))  # warm-up: the prompt is cached, the kernels are hot
    for r in range(rounds):
        for mode in MODES:
            if mode == MODES[0]:
                gaps, calls = stream_gaps(engine, new_tokens), 0
            else:
                pollers = [t.tick for t in tabs] if mode == MODES[1] else api_calls
                gaps, calls = _with_pollers(engine, pollers, tick_s, new_tokens, report.errors)
            report.gaps_ms[mode] += gaps
            report.tokens[mode].append(len(gaps) + 1)
            report.calls[mode] += calls
            log(f"round {r + 1}, {mode}: {len(gaps) + 1} tokens, median gap "
                f"{statistics.median(gaps) if gaps else float('nan'):.1f} ms, {calls} calls")
    report.redraws = sum(t.redraws for t in tabs)
    report.evicted_tokens = engine.stats().evicted_tokens
    return report


def format_report(r: StallReport) -> str:
    lines = [f"tree: {r.num_nodes:,} nodes; {r.sessions} sessions; tab tick every {r.tick_s:g} s; "
             f"evicted tokens: {r.evicted_tokens:,}"]
    for mode in MODES:
        extra = ""
        if mode == MODES[1]:
            extra = f"; {r.calls[mode]:,} ticks, {r.redraws:,} figures built and serialised"
        elif mode == MODES[2]:
            extra = f"; {r.calls[mode]:,} calls"
        lines.append(f"{mode:>18}: inter-token median {r.median(mode):7.2f} ms, p95 {r.p95(mode):7.2f} ms "
                     f"over {len(r.gaps_ms[mode]):,} gaps{extra}")
    for mode in MODES[1:]:
        med, p95 = r.ratios(mode)
        lines.append(f"{mode} / alone: median x{med:.3f}, p95 x{p95:.3f}")
    lines += [f"  error: {e}" for e in r.errors[:10]]
    med, p95 = r.ratios(MODES[1])
    lines.append(f"RESULT: {'PASS' if r.passed else 'FAIL'} (goal: the tree tab's median and p95 ratios under "
                 f"{GOAL_RATIO:.2f}; median x{med:.3f}, p95 x{p95:.3f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=5000, help="nodes in the cache's tree (default 5,000)")
    p.add_argument("--sessions", type=int, default=8, help="sessions with the tree tab open (default 8)")
    p.add_argument("--new-tokens", type=int, default=200, help="tokens the measured stream generates (default 200)")
    p.add_argument("--rounds", type=int, default=3, help="times each mode is run, alternating (default 3)")
    p.add_argument("--tiny", action="store_true", help="the tests' tiny random Llama instead of the model")
    add_engine_args(p)
    args = p.parse_args(argv)
    print("loading", "the tiny random Llama" if args.tiny else args.model, "...", flush=True)
    runner = load_runner(args.tiny, args.model, args.device)
    engine = build_engine(runner, args.nodes, args.new_tokens, args.isolate)
    try:
        report = measure(engine, args.nodes, args.sessions, args.new_tokens, args.rounds,
                         log=lambda s: print(s, flush=True))
    finally:
        engine.close()
    print(format_report(report), flush=True)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
