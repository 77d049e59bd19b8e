"""Load test: many gradio_client visitors chatting with the launched app at once.

Starts the app in-process (the same ``app.build_engine`` and ``app.build_app`` as
``python app.py``) on a free port, then runs N concurrent visitors doing multi-turn
chats for a fixed time. While they run, a sampler reads the engine's stats and
checks its invariants. Afterwards it checks that:

- no visitor saw an error;
- every greedy answer is identical to the same prompt run alone (each distinct
  prompt re-run on a fresh engine with no prefix cache, sharing the model);
- the cache budget was never exceeded, by the pool's count and by the process's resident
  memory: its growth during the run (``VmRSS``, sampled) stays within the budget plus
  ``RSS_SLACK_MB`` (activations, the visitors' own clients, which run in this process);
- once idle, no lock is held and the pool's used slots equal the tree's tokens.

It prints requests served, p50/p95 time to first token (as the visitor saw it,
queueing included, and inside the engine), hit rate and peak cache bytes, and
exits non-zero if a check failed.

    python tools/load_test.py                 # 16 visitors, 120 s, real model
    python tools/load_test.py --seconds 20 --visitors 4
    python tools/load_test.py --visitors 8 --max-batch 1   # the one-at-a-time engine, to compare

For a long soak of the app as a Space runs it (a subprocess, page and API traffic from many
addresses, its resident memory's slope, the flood and classroom checks): ``python -m tools.soak``.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.measure import add_engine_args, offline_env, percentile, rss_bytes  # noqa: E402

offline_env()

from components.chat_presets import SYSTEM_PRESETS  # noqa: E402

# Each conversation: a preset system prompt and the questions asked turn by turn.
QUESTIONS = [
    "Can I return a tent I used once?",
    "How much is express shipping?",
    "Do sleeping bags have a warranty?",
    "What is photosynthesis?",
    "Where is the treasure buried?",
    "How long does delivery take?",
    "Why is the sky blue?",
    "Can you recommend a good hiking boot?",
]


SHORT_SYSTEM_CHARS = 4000  # system presets the visitors pick from (see _visitor)
RSS_SLACK_MB = 384  # growth allowed beside the KV budget: activations, sixteen in-process clients, Gradio


@dataclass
class Turn:
    system_name: str
    history: tuple[tuple[str, str], ...]  # (role, text) before this turn
    question: str
    answer: str = ""
    ttft_s: float | None = None  # first streamed answer text, as the visitor saw it
    total_s: float = 0.0
    error: str | None = None
    cancelled: bool = False  # the visitor cancelled it after its first text (not compared, not added to the chat)


@dataclass
class LoadReport:
    seconds: float
    visitors: int
    turns: list[Turn] = field(default_factory=list)
    engine_ttft_ms: list[float] = field(default_factory=list)
    queue_ms: list[float] = field(default_factory=list)
    batch_sizes_max: list[int] = field(default_factory=list)  # per served request: largest decode batch it ran in
    peak_cache_bytes: int = 0
    budget_bytes: int = 0
    samples: int = 0
    budget_violations: int = 0
    invariant_failures: list[str] = field(default_factory=list)
    idle_problems: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    exact: bool = True  # float32 or the exact forward (issue 44): batched answers must equal lone runs; else reported
    distinct_prompts: int = 0
    hit_rate: float = 0.0
    evicted_tokens: int = 0
    rss_start: int = 0  # process resident bytes when the visitors start
    cancelled_in_engine: int = 0  # requests the engine ended as "cancelled"
    rss_peak: int = 0

    @property
    def rss_growth(self) -> int:
        return max(0, self.rss_peak - self.rss_start)

    @property
    def rss_over(self) -> bool:
        """Resident memory grew past the KV budget plus the slack: KV held outside the pool?"""
        return self.rss_growth > self.budget_bytes + RSS_SLACK_MB * 2**20

    @property
    def errors(self) -> list[str]:
        return [t.error for t in self.turns if t.error]

    @property
    def ok(self) -> bool:
        return not (self.errors or self.budget_violations or self.invariant_failures or self.idle_problems
                    or (self.exact and self.mismatches) or self.rss_over) and bool(self.turns)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flat_text(content) -> str:
    """A chatbot message's content as a string (Gradio sends a list of parts): the page's clients
    here, ``tools.soak`` and the tests read answers through it."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(flat_text(p) for p in content)
    if isinstance(content, dict):
        return str(content.get("text") or content.get("value") or "")
    return "" if content is None else str(content)


def _visitor(url: str, index: int, deadline: float, turns: list[Turn], lock: threading.Lock,
             max_new_tokens: int, turns_per_chat: int, cancel_every: int = 0) -> None:
    from gradio_client import Client

    rng = random.Random(index)
    # The short presets: the shipped handbook alone (2,300 tokens, about 100 MiB of KV in fp32) is larger
    # than the small budgets this test runs under to make evictions happen.
    systems = [name for name, text in SYSTEM_PRESETS.items() if len(text) <= SHORT_SYSTEM_CHARS]
    client = Client(url, verbose=False, download_files=False)
    asked = 0
    while time.monotonic() < deadline:
        system = systems[rng.randrange(len(systems))]
        chatbot: list = []
        for _ in range(turns_per_chat):
            if time.monotonic() >= deadline:
                break
            history = tuple((m["role"], flat_text(m["content"])) for m in chatbot)
            turn = Turn(system, history, QUESTIONS[rng.randrange(len(QUESTIONS))])
            asked += 1
            turn.cancelled = bool(cancel_every) and asked % cancel_every == 0
            t0 = time.perf_counter()
            try:
                job = client.submit(turn.question, chatbot, system, "", max_new_tokens, False, api_name="/chat")
                seen = 0
                while not job.done() or seen < len(job.outputs()):
                    outs = job.outputs()
                    for out in outs[seen:]:
                        if turn.ttft_s is None and out[0] and flat_text(out[0][-1]["content"]):
                            turn.ttft_s = time.perf_counter() - t0
                    seen = len(outs)
                    if turn.cancelled and turn.ttft_s is not None:
                        job.cancel()  # mid-answer, as a visitor who closes the tab or presses Stop
                        break
                    time.sleep(0.01)
                if turn.cancelled:
                    turn.total_s = time.perf_counter() - t0
                    with lock:
                        turns.append(turn)
                    continue  # the chat goes on without that turn
                result = job.result()
                chatbot = result[0]
                if len(chatbot) != len(history) + 2:
                    raise RuntimeError(f"the turn was not added (chat has {len(chatbot)} messages)")
                turn.answer = flat_text(chatbot[-1]["content"])
                if turn.ttft_s is None:  # an empty answer: the visitor saw the end
                    turn.ttft_s = time.perf_counter() - t0
            except Exception as exc:  # every error is a finding, reported below
                turn.error = f"visitor {index}: {type(exc).__name__}: {exc}"[:300]
            turn.total_s = time.perf_counter() - t0
            with lock:
                turns.append(turn)
            if turn.error:
                break


def _sampler(engine, stop: threading.Event, report: LoadReport) -> None:

    last_check = 0.0
    while not stop.is_set():
        st = engine.stats()
        report.samples += 1
        report.rss_peak = max(report.rss_peak, rss_bytes())
        report.peak_cache_bytes = max(report.peak_cache_bytes, st.cache_bytes)
        if st.cache_bytes > st.budget_bytes:
            report.budget_violations += 1
        if time.monotonic() - last_check > 1.0:
            last_check = time.monotonic()
            try:
                engine.check_invariants()
            except AssertionError as exc:
                report.invariant_failures.append(str(exc))
        stop.wait(0.05)


def _wait_idle(engine, timeout_s: float = 600.0) -> None:
    deadline, quiet = time.monotonic() + timeout_s, 0
    while quiet < 3 and time.monotonic() < deadline:
        busy = engine.stats().queue_depth > 0 or engine.runner.lock.locked()
        quiet = 0 if busy else quiet + 1
        time.sleep(0.05)


def check_idle(engine) -> list[str]:
    problems = []
    try:
        engine.check_invariants()
    except AssertionError as exc:
        problems.append(f"invariants: {exc}")
    cache = engine.cache
    if hasattr(cache, "pool"):
        if cache.locked_tokens():
            problems.append(f"{cache.locked_tokens()} tokens still locked")
        if cache.pool.num_used != cache.tree.num_tokens:
            problems.append(f"pool slots used {cache.pool.num_used} != tree tokens {cache.tree.num_tokens}")
    return problems


def check_against_lone_runs(runner, report: LoadReport, max_new_tokens: int, log=print) -> None:
    """Re-run every distinct prompt alone, greedy, on a fresh engine with no prefix cache, with the
    sampling the page's chat endpoint uses (its loop guard on)."""
    from components.panels.chat_panel import chat_messages, sampling_for
    from engine.engine import Engine
    from engine.types import GenerationRequest

    alone = Engine(runner, enable_cache=False, max_new_tokens_cap=max_new_tokens)
    reference: dict[tuple, str] = {}
    for turn in report.turns:
        if turn.error or turn.cancelled:
            continue
        key = (turn.system_name, turn.history, turn.question)
        if key not in reference:
            history = [{"role": r, "content": t} for r, t in turn.history]
            msgs = chat_messages(SYSTEM_PRESETS[turn.system_name], history, turn.question)
            req = GenerationRequest(messages=tuple(msgs), sampling=sampling_for(alone, max_new_tokens, True))
            reference[key] = alone.run(req).output_text
            if len(reference) % 10 == 0:
                log(f"  ... {len(reference)} prompts re-run alone")
        if turn.answer != reference[key]:
            report.mismatches.append(f"{turn.system_name} / {turn.question!r} after {len(turn.history)} messages: "
                                     f"got {turn.answer[:60]!r}, alone {reference[key][:60]!r}")
    report.distinct_prompts = len(reference)


def run_load(runner, seconds: float = 120.0, visitors: int = 16, budget_mb: float = 64.0,
             max_new_tokens: int = 16, turns_per_chat: int = 3, isolate: bool = False, log=print,
             max_batch: int | None = None, cancel_every: int = 0) -> LoadReport:
    """Launch the app on ``runner``, run the visitors, check everything; return the report.

    ``max_batch`` overrides the engine's batch limit (1: the one-at-a-time engine, to compare);
    ``cancel_every`` > 0: each visitor cancels every that-many-th turn after its first text."""
    import app
    from components.demo import launch_kwargs

    argv = ["--cache-budget-mb", str(budget_mb), "--max-new-tokens", str(max_new_tokens),
            "--isolate" if isolate else "--no-isolate"]
    args = app.parse_args(argv)  # the app's own flags, env vars and defaults
    engine = app.build_engine(args, runner=runner)
    if max_batch is not None:
        engine.scheduler.config = dataclasses.replace(engine.scheduler.config, max_batch=max(1, int(max_batch)))
    demo = app.build_app(engine, args.max_queue)
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=free_port(), quiet=True,
                **launch_kwargs())
    report = LoadReport(seconds=seconds, visitors=visitors, budget_bytes=engine.cache.budget_bytes,
                        exact=str(runner.dtype) == "torch.float32" or bool(getattr(runner, "runs_exact", False)))
    stop = threading.Event()
    sampler = threading.Thread(target=_sampler, args=(engine, stop, report), daemon=True)
    try:
        log(f"app on {demo.local_url}; {visitors} visitors for {seconds:.0f} s, budget {budget_mb:g} MiB, "
            f"max {max_new_tokens} new tokens, isolation {'on' if isolate else 'off'}, "
            f"batches of up to {engine.scheduler.config.max_batch}")

        report.rss_start = report.rss_peak = rss_bytes()
        sampler.start()
        lock = threading.Lock()
        deadline = time.monotonic() + seconds
        threads = [threading.Thread(target=_visitor, args=(demo.local_url, i, deadline, report.turns, lock,
                                                            max_new_tokens, turns_per_chat, cancel_every),
                                    daemon=True)
                   for i in range(visitors)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        _wait_idle(engine)
    finally:
        stop.set()
        sampler.join()
        demo.close()
    report.idle_problems = check_idle(engine)
    served = [m for m in engine.recent() if m.tag == "chat"]
    report.engine_ttft_ms = [m.ttft_ms for m in served if m.ttft_ms is not None]  # None: stopped before one
    report.queue_ms = [m.queue_ms for m in served]
    report.batch_sizes_max = [m.batch_size_max for m in served]
    report.cancelled_in_engine = sum(m.finish_reason == "cancelled" for m in served)
    stats = engine.stats()
    report.hit_rate, report.evicted_tokens = stats.hit_rate, stats.evicted_tokens
    log(f"load done: {len(report.turns)} turns; re-running each distinct prompt alone to compare answers")
    check_against_lone_runs(runner, report, max_new_tokens, log=log)
    return report


def format_report(r: LoadReport) -> str:
    ttft = [t.ttft_s * 1000 for t in r.turns if t.ttft_s is not None and not t.error]

    def ms(v: float) -> str:
        return f"{v:,.0f} ms"

    cancelled = sum(t.cancelled and not t.error for t in r.turns)
    compared = len(r.turns) - len(r.errors) - cancelled

    lines = [
        f"visitors: {r.visitors}, duration: {r.seconds:.0f} s",
        f"requests served: {len([t for t in r.turns if not t.error])} "
        f"({len(r.turns) / r.seconds * 60:.1f} per minute); errors: {len(r.errors)}",
        f"time to first token, as visitors saw it (queueing included): p50 {ms(percentile(ttft, 0.5))}, "
        f"p95 {ms(percentile(ttft, 0.95))}",
        f"time to first token inside the engine (from arrival, queue included): "
        f"p50 {ms(percentile(r.engine_ttft_ms, 0.5))}, p95 {ms(percentile(r.engine_ttft_ms, 0.95))}; "
        f"queue wait p50 {ms(percentile(r.queue_ms, 0.5))}",
        f"batching: largest decode batch {max(r.batch_sizes_max, default=0)}, "
        f"mean of each request's largest {sum(r.batch_sizes_max) / max(1, len(r.batch_sizes_max)):.1f}",
        f"peak cache bytes: {r.peak_cache_bytes:,} of a {r.budget_bytes:,}-byte budget "
        f"({r.samples} samples, {r.budget_violations} over budget); evicted tokens: {r.evicted_tokens:,}; "
        f"token hit rate: {r.hit_rate:.0%}",
        f"process resident memory: grew {r.rss_growth / 2**20:,.0f} MiB during the run (peak "
        f"{r.rss_peak / 2**20:,.0f} MiB) against a {r.budget_bytes / 2**20:,.0f} MiB KV budget "
        f"(+{RSS_SLACK_MB} MiB allowed for the rest){': OVER' if r.rss_over else ''}",
        f"cancelled mid-answer by visitors: {cancelled}; ended as cancelled in the engine: {r.cancelled_in_engine}",
        f"answers identical to the prompt run alone: {r.distinct_prompts and compared - len(r.mismatches)}"
        f" of {compared} ({r.distinct_prompts} distinct prompts); "
        f"mismatches: {len(r.mismatches)}" + ("" if r.exact else
                                              " (half precision on PyTorch's kernels: batched rows round differently, not a failure)"),
        f"invariants while running: {'ok' if not r.invariant_failures else r.invariant_failures[:3]}; "
        f"once idle: {'ok (no locks, pool slots == tree tokens)' if not r.idle_problems else r.idle_problems}",
    ]
    lines += [f"  error: {e}" for e in r.errors[:10]] + [f"  mismatch: {m}" for m in r.mismatches[:10]]
    lines.append("RESULT: " + ("PASS" if r.ok else "FAIL"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=120.0, help="how long visitors keep chatting (default 120)")
    p.add_argument("--visitors", type=int, default=16, help="concurrent gradio_client visitors (default 16)")
    p.add_argument("--budget-mb", type=float, default=64.0, help="KV cache budget in MiB (default 64: evictions happen)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="new tokens per answer (default 16)")
    p.add_argument("--turns", type=int, default=3, help="turns per conversation before a new chat (default 3)")
    add_engine_args(p)
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16 (as app.py's --dtype)")
    p.add_argument("--cancel-every", type=int, default=5,
                   help="each visitor cancels every Nth turn after its first text (default 5; 0: never)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="requests decoded together (default: the engine's, 16; 1 = one at a time)")
    args = p.parse_args(argv)

    from engine.model.loader import ModelLoadError, load_model
    from engine.model.runner import ModelRunner

    print(f"loading {args.model} ...", flush=True)
    try:
        runner = ModelRunner(load_model(args.model, device=args.device, dtype=args.dtype))
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"model: {runner.name} on {runner.device} ({str(runner.dtype).replace('torch.', '')})", flush=True)
    report = run_load(runner, args.seconds, args.visitors, args.budget_mb, args.max_new_tokens, args.turns,
                      args.isolate, log=lambda s: print(s, flush=True), max_batch=args.max_batch,
                      cancel_every=args.cancel_every)
    print(format_report(report), flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
