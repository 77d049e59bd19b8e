"""Soak: the app as a Space runs it, under mixed page and API traffic for a long while.

Starts ``python app.py`` in a subprocess (``SYSTEM=spaces``: isolation, visitors told apart by
``X-Forwarded-For``; ``--budget-mb`` of KV), then for ``--minutes``:

- ``--page-visitors`` page visitors, each from an address of its own, post chat events
  (``/gradio_api/call/chat``, a new Gradio session each, as scripts and fresh tabs do) and
  read their results, and poll a panel refresh now and then;
- ``--api-clients`` ``/v1`` clients stream completions and drop every third stream half way;
- a sampler reads the server's resident memory (``VmRSS`` of its pid) every ``--sample-s``.

Then, each once the traffic before it has settled, two checks on the same server: the flood (one address posts 150 chat events at once while
another address asks, timed: first text against the same question asked before the flood) and
the classroom (eight sessions behind one address ask at once: first text p50 and slowest).

It prints the 5xx count, the tracebacks seen in the server's output, the memory samples and the
slope over the second half (MiB per hour, least squares), the flood and classroom figures, and
exits non-zero on a 5xx, a traceback, or a slope over ``--max-slope-mib-h`` (100).

    python -m tools.soak                               # 20 minutes, the embedded model
    python -m tools.soak --minutes 4 --page-visitors 3 --api-clients 2   # a short check

Figures on a shared or busy machine mean little; run the long one on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.load_test import flat_text  # noqa: E402
from tools.measure import offline_env, percentile, rss_bytes  # noqa: E402

offline_env()

import httpx  # noqa: E402

SYSTEM_PRESET = "Support agent (short)"
QUESTIONS = ["How much is express shipping?", "Can I return a tent I used once?", "Why is the sky blue?",
             "Do sleeping bags have a warranty?", "What is photosynthesis?", "How long does delivery take?"]


@dataclass
class SoakReport:
    answers: int = 0
    status_5xx: int = 0
    other_errors: list[str] = field(default_factory=list)
    rss: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, MiB)
    tracebacks: int = 0
    flood: dict = field(default_factory=dict)
    classroom: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, status: int, what: str) -> None:
        with self.lock:
            if status >= 500:
                self.status_5xx += 1
                self.other_errors.append(f"{what}: {status}")
            elif status == 200:
                self.answers += 1

    def slope_mib_h(self) -> float:
        """Least-squares slope of resident memory over the second half of the samples, MiB/hour."""
        half = self.rss[len(self.rss) // 2:]
        if len(half) < 3:
            return float("nan")
        xs, ys = [t for t, _ in half], [m for _, m in half]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        return 3600 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else float("nan")


def rss_mib(pid: int) -> float:
    """``pid``'s resident memory in MiB (NaN where it cannot be read: the app has gone)."""
    rss = rss_bytes(pid)
    return rss / 2**20 if rss else float("nan")


def chat_event(http: httpx.Client, address: str, question: str, max_new_tokens: int) -> tuple[int, float | None]:
    """One chat event from ``address`` in a session of its own: (status, seconds to first text)."""
    t0 = time.monotonic()
    r = http.post("gradio_api/call/chat", headers={"x-forwarded-for": address},
                  json={"data": [question, [], SYSTEM_PRESET, "", max_new_tokens, False]})
    if r.status_code != 200:
        return r.status_code, None
    first = None
    with http.stream("GET", f"gradio_api/call/chat/{r.json()['event_id']}",
                     headers={"x-forwarded-for": address}) as s:
        for line in s.iter_lines():
            if first is None and line.startswith("data:") and line[5:].strip().startswith("["):
                history = json.loads(line[5:])[0] or []
                if history and flat_text(history[-1].get("content")).strip():
                    first = time.monotonic() - t0
    return 200, first


def _page_visitor(url: str, i: int, deadline: float, report: SoakReport, max_new: int) -> None:
    address = f"198.51.100.{10 + i}"
    with httpx.Client(base_url=url, timeout=300) as http:
        n = 0
        while time.monotonic() < deadline:
            try:
                status, _ = chat_event(http, address, QUESTIONS[(i + n) % len(QUESTIONS)], max_new)
                report.count(status, "page chat")
            except httpx.HTTPError as exc:
                report.other_errors.append(f"page chat: {type(exc).__name__}")
            n += 1
            time.sleep(0.5)


def _api_client(url: str, i: int, deadline: float, report: SoakReport, max_new: int) -> None:
    address = f"203.0.113.{10 + i}"
    with httpx.Client(base_url=url, timeout=300, headers={"x-forwarded-for": address}) as http:
        n = 0
        while time.monotonic() < deadline:
            body = {"prompt": f"Client {i}, request {n}: {QUESTIONS[n % len(QUESTIONS)]}", "max_tokens": max_new,
                    "stream": True, "ignore_eos": True}
            if n % 2:
                body["cache_salt"] = f"soak-{i}"
            try:
                with http.stream("POST", "v1/completions", json=body) as r:
                    report.count(r.status_code, "api stream")
                    for k, _ in enumerate(r.iter_lines()):
                        if n % 3 == 0 and k >= max_new // 2:
                            break  # a client that drops its stream half way
            except httpx.HTTPError as exc:
                report.other_errors.append(f"api: {type(exc).__name__}")
            n += 1
            time.sleep(0.3)


def flood_check(url: str, events: int = 150, max_new: int = 16) -> dict:
    """One address posts ``events`` chat events at once; another address's question is timed
    before and during the flood (first text, seconds)."""
    with httpx.Client(base_url=url, timeout=300) as http:
        _, alone = chat_event(http, "192.0.2.200", QUESTIONS[0], max_new)
        statuses: list[int] = []

        def post(k: int) -> None:
            with httpx.Client(base_url=url, timeout=300) as h:
                r = h.post("gradio_api/call/chat", headers={"x-forwarded-for": "192.0.2.66"},
                           json={"data": [f"flood {k}", [], SYSTEM_PRESET, "", max_new, False]})
                statuses.append(r.status_code)

        threads = [threading.Thread(target=post, args=(k,)) for k in range(events)]
        for t in threads:
            t.start()
        status, during = chat_event(http, "192.0.2.200", QUESTIONS[0], max_new)
        for t in threads:
            t.join()
    return {"alone_s": alone, "during_flood_s": during, "asker_status": status,
            "flood": {s: statuses.count(s) for s in sorted(set(statuses))}}


def classroom_check(url: str, tabs: int = 8, max_new: int = 96) -> dict:
    """``tabs`` sessions behind one address ask at once: first text per tab, seconds."""
    firsts: list[float | None] = [None] * tabs
    codes: list[int] = [0] * tabs

    def tab(k: int) -> None:
        with httpx.Client(base_url=url, timeout=300) as http:
            codes[k], firsts[k] = chat_event(http, "192.0.2.30", QUESTIONS[k % len(QUESTIONS)], max_new)

    threads = [threading.Thread(target=tab, args=(k,)) for k in range(tabs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = [f for f in firsts if f is not None]
    return {"tabs": tabs, "answered": len(got), "statuses": codes, "first_text_p50_s": percentile(got, 0.5),
            "slowest_s": max(got) if got else float("nan")}


def settle(url: str, quiet_s: float = 15.0, timeout_s: float = 600.0) -> None:
    """Wait until no page event has waited for ``quiet_s`` (Gradio's queue status), so that what
    is left of the traffic before (its running events) has ended."""
    deadline, quiet_since = time.monotonic() + timeout_s, None
    with httpx.Client(base_url=url, timeout=30) as http:
        while time.monotonic() < deadline:
            waiting = http.get("gradio_api/queue/status").json().get("queue_size", 0)
            now = time.monotonic()
            quiet_since = (quiet_since or now) if not waiting else None
            if quiet_since is not None and now - quiet_since >= quiet_s:
                return
            time.sleep(0.5)


def _read_output(proc: subprocess.Popen, report: SoakReport, log: list[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        log.append(line)
        if "Traceback" in line or "terminate called" in line:
            with report.lock:
                report.tracebacks += 1


def run_soak(args) -> SoakReport:
    from tests.helpers_app import free_port

    port = free_port()
    env = dict(os.environ, SYSTEM="spaces", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               GRADIO_ANALYTICS_ENABLED="False")
    cmd = [sys.executable, "app.py", "--port", str(port), "--cache-budget-mb", str(args.budget_mb),
           "--no-growth-curve", *(["--model", args.model] if args.model else [])]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    report, log = SoakReport(), []
    reader = threading.Thread(target=_read_output, args=(proc, report, log), daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 600
        while not any("Running on local URL" in line for line in log):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the app did not start:\n" + "".join(log[-40:]))
            time.sleep(0.5)
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        workers = [threading.Thread(target=_page_visitor, args=(url, i, end, report, args.max_new_tokens))
                   for i in range(args.page_visitors)]
        workers += [threading.Thread(target=_api_client, args=(url, i, end, report, args.max_new_tokens))
                    for i in range(args.api_clients)]
        for w in workers:
            w.start()
        while time.monotonic() < end:
            report.rss.append((time.monotonic() - t0, rss_mib(proc.pid)))
            print(f"  {report.rss[-1][0] / 60:5.1f} min  RSS {report.rss[-1][1]:,.0f} MiB  answers {report.answers}",
                  flush=True)
            time.sleep(min(args.sample_s, max(0.0, end - time.monotonic())) or 0.1)
        for w in workers:
            w.join()
        report.rss.append((time.monotonic() - t0, rss_mib(proc.pid)))
        if not args.no_checks:
            settle(url)
            report.flood = flood_check(url)
            settle(url)  # the flood's accepted events run to their end first: a classroom on a quiet app
            report.classroom = classroom_check(url)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        reader.join(10)
    if not (log and log[-1].strip() == "Stopped."):
        report.other_errors.append("the server did not end with 'Stopped.' on SIGTERM: " + "".join(log[-5:]).strip())
    return report


def format_report(r: SoakReport, max_slope: float) -> str:
    samples = ", ".join(f"{t / 60:.1f}m {m:,.0f}" for t, m in r.rss)
    lines = [
        f"answers: {r.answers}   5xx: {r.status_5xx}   tracebacks in the server's output: {r.tracebacks}",
        f"resident memory (MiB): {samples}",
        f"slope over the second half: {r.slope_mib_h():,.0f} MiB/hour (limit {max_slope:,.0f})",
    ]
    if r.flood:
        f = r.flood
        lines.append(f"flood: 150 page events from one address {f['flood']}; another address's first text "
                     f"{f['alone_s']:.2f} s alone, {f['during_flood_s'] or float('nan'):.2f} s during the flood "
                     f"(status {f['asker_status']})")
    if r.classroom:
        c = r.classroom
        lines.append(f"classroom: {c['answered']} of {c['tabs']} tabs behind one address answered; first text p50 "
                     f"{c['first_text_p50_s']:.2f} s, slowest {c['slowest_s']:.2f} s")
    lines += [f"error: {e}" for e in r.other_errors[:10]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--page-visitors", type=int, default=6)
    p.add_argument("--api-clients", type=int, default=3)
    p.add_argument("--budget-mb", type=float, default=256.0)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--sample-s", type=float, default=30.0)
    p.add_argument("--model", default="", help="model id or path (default: app.py's, the embedded SmolLM2)")
    p.add_argument("--max-slope-mib-h", type=float, default=100.0)
    p.add_argument("--no-checks", action="store_true", help="skip the flood and classroom checks")
    args = p.parse_args(argv)
    report = run_soak(args)
    print(format_report(report, args.max_slope_mib_h), flush=True)
    slope = report.slope_mib_h()
    bad = report.status_5xx or report.tracebacks or report.other_errors or not (slope == slope and
                                                                                 slope <= args.max_slope_mib_h)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
