"""Flood bench: how fast another visitor gets first text while one client floods a public app.

Starts the app in-process as ``python app.py --isolate`` does (``app.parse_args``,
``app.build_engine``, ``app.build_app``, the API with two keys: one per client, since both run
from this machine's address) and runs issue 28's scenarios, each on a fresh engine over the
same loaded model:

- ``flood``: one client sends ``--flood`` requests of ``--flood-tokens`` tokens at once over
  ``/v1/completions``, unsalted, and another client asks ``--questions`` chat questions over
  ``/v1/chat/completions``, one after another, each while a new flood arrives;
- ``salted``: the same, every flood request with a ``cache_salt`` of its own;
- ``long``: one visitor runs two ``--long-tokens``-token prompts at once, another asks;
- ``start``: the app just started (warm start done, the growth curve begun in the background),
  a visitor asks at once; then the same question again once the curve is done (idle);
- ``classroom``: ``--tabs`` page tabs behind one address (this machine's), each with a session
  of its own, click a starter question at once (the handbook preset, ``--class-new-tokens`` new
  tokens, the page's defaults otherwise), over the page's own event route; first text per tab.

It prints, per scenario, the asking visitor's first text (seconds from sending to the first
streamed text: queueing included) as p50 / p95, what the flood got back (200 / 429 / 503), and
the process's resident memory: its growth while serving against the KV budget plus the
prefill timer's scratch bound plus ``RSS_OVERHEAD_MB`` (activations, the in-process clients,
the HTTP server). Exits non-zero when a visitor was refused or the memory went over.

    python -m tools.flood_bench                      # the issue's figures: run it on a quiet machine
    python -m tools.flood_bench --scenarios start    # one scenario

Figures on a shared or busy machine mean little: every scenario is a race for the same cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.measure import offline_env, percentile, rss_bytes  # noqa: E402

offline_env()

import httpx  # noqa: E402

SCENARIOS = ("flood", "salted", "long", "start", "classroom")
KEYS = {"flooder": "flood-bench-flooder", "visitor": "flood-bench-visitor", "long": "flood-bench-long"}
RSS_OVERHEAD_MB = 512  # beside the KV budget and the timer's scratch: activations, clients, server, Gradio
QUESTION = "In two sentences: which of our delivery options is fastest, and what does it cost?"


@dataclass
class Scale:
    """What a run sends (the defaults are the issue's)."""

    flood: int = 48
    flood_tokens: int = 3000
    questions: int = 3
    long_tokens: int = 4000
    max_new_tokens: int = 16
    tabs: int = 8
    class_new_tokens: int = 96
    class_preset: str = "Northwind handbook (long)"  # components.chat_presets.HANDBOOK_SYSTEM


@dataclass
class ScenarioResult:
    name: str
    first_text_s: list[float] = field(default_factory=list)  # the asking visitor's, one per question
    idle_first_text_s: list[float] = field(default_factory=list)  # "start": the same question on the idle app
    refused: list[str] = field(default_factory=list)  # the asking visitor's refusals (must stay empty)
    flood_status: dict[int, int] = field(default_factory=dict)  # HTTP status -> count, the flooder's
    rss_start: int = 0
    rss_peak: int = 0
    rss_limit: int = 0  # growth allowed: budget + scratch bound + RSS_OVERHEAD_MB

    @property
    def rss_growth(self) -> int:
        return max(0, self.rss_peak - self.rss_start)

    @property
    def ok(self) -> bool:
        return (not self.refused and len(self.first_text_s) > 0 and 503 not in self.flood_status
                and self.rss_growth <= self.rss_limit)


def serve(engine, max_queue: int):
    """The app over ``engine`` on a free local port, with the bench's keys (one per client)."""
    import app
    from components.demo import launch_kwargs
    from tools.load_test import free_port

    demo = app.build_app(engine, max_queue)
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=free_port(), quiet=True,
                **launch_kwargs(app.app_kwargs(engine, ",".join(KEYS.values()))))
    return demo


def _prompt_ids(engine, n: int, tag: str) -> list[int]:
    """``n`` token ids of shipped text, opened by ``tag`` so that no two prompts share a prefix."""
    from components.warm_start import growth_filler

    head = engine.encode(f"{tag}. ")
    return head + growth_filler(engine, max(1, n - len(head)))


def _post(http: httpx.Client, who: str, body: dict) -> httpx.Response:
    return http.post("v1/completions", json=body, headers={"Authorization": f"Bearer {KEYS[who]}"})


def ask(http: httpx.Client, who: str, question: str, max_tokens: int, refused: list[str]) -> float | None:
    """Ask one chat question, streamed; seconds from sending to its first text (or to its end,
    should the model end at once). None: refused."""
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    t0 = time.perf_counter()
    first = None
    with http.stream("POST", "v1/chat/completions", json=body,
                     headers={"Authorization": f"Bearer {KEYS[who]}"}) as r:
        if r.status_code != 200:
            refused.append(f"{r.status_code}: {r.read()[:200]!r}")
            return None
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content") or choices[0].get("finish_reason"):
                    first = time.perf_counter() - t0
    return first


def _sampler(result: ScenarioResult, stop: threading.Event) -> None:
    while not stop.wait(0.05):
        result.rss_peak = max(result.rss_peak, rss_bytes())


def _wait_idle(engine, timeout_s: float = 1800.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.busy():
        if time.monotonic() > deadline:
            raise TimeoutError("the engine did not become idle")
        time.sleep(0.05)


def run_scenario(runner, name: str, scale: Scale, log=print) -> ScenarioResult:
    """One scenario on a fresh ``--isolate`` engine over ``runner``."""
    import app
    from analysis.prefill_timing import timer_for
    from components.warm_start import start_growth_curve, warm_start

    cap = max(scale.max_new_tokens, scale.class_new_tokens) if name == "classroom" else scale.max_new_tokens
    args = app.parse_args(["--isolate", "--max-new-tokens", str(cap)])
    engine = app.build_engine(args, runner=runner)
    result = ScenarioResult(name)
    timer = timer_for(engine)
    if name in ("start", "classroom"):
        warm_start(engine)  # as app.py: before the page is served
    result.rss_start = result.rss_peak = rss_bytes()
    result.rss_limit = engine.cache.budget_bytes + timer.scratch_bound_bytes + RSS_OVERHEAD_MB * 2**20
    stop = threading.Event()
    sampler = threading.Thread(target=_sampler, args=(result, stop), daemon=True)
    sampler.start()
    demo = serve(engine, args.max_queue)
    try:
        with httpx.Client(base_url=demo.local_url, timeout=3600,
                          limits=httpx.Limits(max_connections=2 * scale.flood + 8)) as http:
            if name in ("flood", "salted"):
                _flood(engine, http, scale, salted=name == "salted", result=result, log=log)
            elif name == "long":
                _long(engine, http, scale, result, log)
            elif name == "classroom":
                _classroom(demo.local_url, scale, result, log)
            elif name == "start":
                curve = start_growth_curve(engine)
                first = ask(http, "visitor", QUESTION, scale.max_new_tokens, result.refused)
                if first is not None:
                    result.first_text_s.append(first)
                log(f"  right after start: first text {first:.2f} s (curve {timer.curve.state})"
                    if first is not None else "  right after start: refused")
                if curve is not None:
                    curve.join()
                _wait_idle(engine)
                idle = ask(http, "visitor", QUESTION, scale.max_new_tokens, result.refused)
                if idle is not None:
                    result.idle_first_text_s.append(idle)
                log(f"  idle, after the curve: first text {idle:.2f} s" if idle is not None else "  idle: refused")
        _wait_idle(engine)
    finally:
        demo.close()
        stop.set()
        sampler.join()
        engine.close()
    return result


def _flood(engine, http: httpx.Client, scale: Scale, salted: bool, result: ScenarioResult, log) -> None:
    from server.client_limits import default_max_per_client

    cap = default_max_per_client(True, engine.max_queue) or 0
    for q in range(scale.questions):
        statuses: list[int] = []

        def one(i: int, q: int = q, statuses: list[int] = statuses) -> None:
            body: dict = {"prompt": _prompt_ids(engine, scale.flood_tokens, f"Flood {q}-{i}"),
                          "max_tokens": scale.max_new_tokens, "temperature": 0}
            if salted:
                body["cache_salt"] = f"bench-{q}-{i}"
            statuses.append(_post(http, "flooder", body).status_code)

        _visitor_asks_during(engine, http, scale, result, log, q, one, scale.flood, statuses,
                             lambda s=statuses: len(s) >= scale.flood - cap,  # the excess refused, the rest queued
                             hold=cap > 0)


def _long(engine, http: httpx.Client, scale: Scale, result: ScenarioResult, log) -> None:
    for q in range(scale.questions):
        statuses: list[int] = []

        def one(i: int, q: int = q, statuses: list[int] = statuses) -> None:
            body = {"prompt": _prompt_ids(engine, scale.long_tokens, f"Long {q}-{i}"),
                    "max_tokens": scale.max_new_tokens, "temperature": 0}
            statuses.append(_post(http, "long", body).status_code)

        _visitor_asks_during(engine, http, scale, result, log, q, one, 2, statuses,
                             lambda: engine.stats().running > 0)  # the long prompts are under way


def _classroom(url: str, scale: Scale, result: ScenarioResult, log) -> None:
    """``scale.tabs`` tabs (gradio_client sessions, all from this machine's one address) click a
    starter question at once; each tab's first text, from its click to the first streamed token
    (the answer's first words, or the status that says the answer is being written)."""
    from gradio_client import Client

    from components.chat_presets import STARTER_QUESTIONS

    tabs = [Client(url, verbose=False, download_files=False) for _ in range(scale.tabs)]
    go = threading.Barrier(scale.tabs)
    firsts: list[float | None] = [None] * scale.tabs

    def click(i: int) -> None:
        question = STARTER_QUESTIONS[i % len(STARTER_QUESTIONS)]
        go.wait()
        t0 = time.perf_counter()
        job = tabs[i].submit(question, [], scale.class_preset, "", scale.class_new_tokens, True, api_name="/chat")
        for update in job:  # (chatbot, message box, coloured prompt, status, ...)
            history = update[0] if isinstance(update, list | tuple) and update else None
            status = update[3] if isinstance(update, list | tuple) and len(update) > 3 else None
            answering = isinstance(status, str) and status.startswith("*Writing the answer")  # first token out
            if answering or (history and history[-1].get("role") == "assistant"
                             and _text(history[-1].get("content"))):
                firsts[i] = time.perf_counter() - t0
                break
        outputs = job.result()
        if firsts[i] is None:
            # A short answer can arrive whole in its last update, with no "writing" status before it,
            # and a few tokens can decode to no visible text yet (a character's first bytes): the
            # tab was answered if its turn ended with the assistant's message in the chat.
            history = outputs[0] if isinstance(outputs, list | tuple) and outputs else None
            status = outputs[3] if isinstance(outputs, list | tuple) and len(outputs) > 3 else None
            failed = isinstance(status, str) and ("request failed" in status or "Stopped" in status)
            if history and history[-1].get("role") == "assistant" and not failed:
                firsts[i] = time.perf_counter() - t0
            else:
                result.refused.append(f"tab {i}: no answer")

    threads = [threading.Thread(target=click, args=(i,), daemon=True) for i in range(scale.tabs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.first_text_s += [f for f in firsts if f is not None]
    log("  first text per tab (s): " + ", ".join(f"{f:.1f}" if f is not None else "-" for f in sorted(
        firsts, key=lambda f: float("inf") if f is None else f)))


def _text(content) -> str:
    """A chatbot message's text (Gradio sends a list of parts)."""
    if isinstance(content, list):
        return "".join(_text(c) for c in content)
    if isinstance(content, dict):
        return str(content.get("text") or "")
    return str(content or "")


def _visitor_asks_during(engine, http: httpx.Client, scale: Scale, result: ScenarioResult, log, q: int,
                         send, senders: int, statuses: list[int], under_way, hold: bool = False) -> None:
    """Start ``senders`` threads of ``send(i)``; once ``under_way()``, the visitor asks question
    ``q`` and its first-text time is recorded; then the senders' statuses, and an idle engine.
    ``hold``: the engine takes no step until ``under_way()``, so the senders all arrive before any
    is answered (a flood at once, whatever the machine's speed; ``under_way`` must then come true
    without an answer, as the per-client cap's refusals do)."""
    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(senders)]
    with engine.runner.lock if hold else contextlib.nullcontext():
        for t in threads:
            t.start()
        while not under_way() and any(t.is_alive() for t in threads):
            time.sleep(0.01)
    first = ask(http, "visitor", f"Question {q}: {QUESTION}", scale.max_new_tokens, result.refused)
    if first is not None:
        result.first_text_s.append(first)
    for t in threads:
        t.join()
    for s in statuses:
        result.flood_status[s] = result.flood_status.get(s, 0) + 1
    log(f"  question {q + 1}: first text {first:.2f} s" if first is not None else f"  question {q + 1}: refused")
    _wait_idle(engine)


def format_results(results: list[ScenarioResult]) -> str:
    lines = ["scenario   first text p50 / p95 (s)   n   other client's answers   RSS growth / allowed (MiB)"]
    for r in results:
        s = r.first_text_s
        figures = f"{percentile(s, 0.5):6.2f} / {percentile(s, 0.95):6.2f}" if s else "   -   /    -  "
        status = ", ".join(f"{k}: {v}" for k, v in sorted(r.flood_status.items())) or "-"
        lines.append(f"{r.name:<10} {figures:<26} {len(s):<3} {status:<24} "
                     f"{r.rss_growth / 2**20:,.0f} / {r.rss_limit / 2**20:,.0f}{'' if r.ok else '  FAILED'}")
        lines += [f"  the same question on the idle app: {x:.2f} s" for x in r.idle_first_text_s]
        lines += [f"  refused: {x}" for x in r.refused]
    return "\n".join(lines)


def run_bench(runner, scenarios: tuple[str, ...] = SCENARIOS, scale: Scale | None = None,
              log=print) -> list[ScenarioResult]:
    scale = scale or Scale()
    results = []
    for name in scenarios:
        log(f"{name}: ...")
        results.append(run_scenario(runner, name, scale, log))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="embedded", help="model id or path (default: the embedded SmolLM2)")
    p.add_argument("--device", default="auto")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}")
    default = Scale()
    p.add_argument("--flood", type=int, default=default.flood, help="requests the flooder sends at once (48)")
    p.add_argument("--flood-tokens", type=int, default=default.flood_tokens, help="tokens per flood request (3,000)")
    p.add_argument("--questions", type=int, default=default.questions, help="questions the other visitor asks (3)")
    p.add_argument("--long-tokens", type=int, default=default.long_tokens, help="tokens of each long prompt (4,000)")
    p.add_argument("--max-new-tokens", type=int, default=default.max_new_tokens)
    p.add_argument("--tabs", type=int, default=default.tabs, help="classroom: tabs behind one address (8)")
    p.add_argument("--class-new-tokens", type=int, default=default.class_new_tokens,
                   help="classroom: new tokens per starter question (96)")
    args = p.parse_args(argv)
    scenarios = tuple(s.strip() for s in args.scenarios.split(",") if s.strip())
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")

    from engine.model.loader import ModelLoadError, load_model
    from engine.model.runner import ModelRunner

    print(f"loading {args.model} ...", flush=True)
    rss_before_model = rss_bytes()
    try:
        runner = ModelRunner(load_model(args.model, device=args.device))
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    rss_model = rss_bytes()
    print(f"model: {runner.name} on {runner.device} ({str(runner.dtype).replace('torch.', '')})", flush=True)
    scale = Scale(args.flood, args.flood_tokens, args.questions, args.long_tokens, args.max_new_tokens, args.tabs,
                  args.class_new_tokens)
    results = run_bench(runner, scenarios, scale, log=lambda s: print(s, flush=True))
    print(format_results(results), flush=True)
    if results:
        peak = max(r.rss_peak for r in results)
        print(f"resident memory: {rss_before_model / 2**20:,.0f} MiB before the model, {rss_model / 2**20:,.0f} MiB "
              f"with it loaded; peak {peak / 2**20:,.0f} MiB while serving, each scenario's growth allowed: "
              f"KV budget + the timer's scratch bound + {RSS_OVERHEAD_MB} MiB", flush=True)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
