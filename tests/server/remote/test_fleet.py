"""A fleet (issue 45): three replicas of this app (``app.py --replica``, the tiny random Llama saved
as a model folder) behind the real ``vllm-router`` (``tools.fleet``), on loopback.

Every request through the router is answered; each replica's ``/metrics`` counted exactly the
requests (and cached tokens) it was sent; and on the built-in trace (three system prompts, eight
users, three turns each) ``cache_aware`` and ``kv_aware`` routing each reach a higher fleet-wide
cached-token share than ``round_robin``; ``kv_aware`` by looking its blocks up in an index the
router builds from our KV events (the replicas publish under the empty topic, the one vllm-router's
static event sources take: ``tools/fleet/processes.py``). The policies run on one set of replicas: the router is restarted
between them, and each replay opens its system prompts with a tag of its own, so the second shares
no block with the first.

The router comes from ``RADIX_ROUTER_VENV`` (default ``.venv-router``: ``tools/install_router.sh``);
without it these tests skip, unless ``RADIX_REQUIRE_ROUTER=1`` (CI) makes that a failure.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.helpers_app import save_tiny_model
from tools.fleet import Fleet, metrics_of, router_binary, router_venv
from tools.fleet.trace import built_in_trace, replay, summarize

pytestmark = pytest.mark.fleet
REPLICAS = 3
ROOT = Path(__file__).resolve().parents[3]


def need_router() -> None:
    if router_binary() is None:
        message = f"vllm-router is not installed in {router_venv()} (tools/install_router.sh)"
        if os.environ.get("RADIX_REQUIRE_ROUTER") == "1":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tokenizer) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("fleet-model") / "tiny-llama", tokenizer)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_model):
    need_router()
    logs = tmp_path_factory.mktemp("fleet-logs")
    with Fleet(REPLICAS, "round_robin", model=tiny_model, budget_mb=32, log_dir=logs, threads=1) as f:
        yield f


def counters(f: Fleet) -> list[dict[str, float]]:
    return [metrics_of(r.url) for r in f.members]


def run(f: Fleet, policy: str, tag: str) -> tuple[dict[str, float], list[dict[str, float]], list]:
    """The trace through the router under ``policy``: its summary, each replica's counter deltas, results."""
    if f.policy != policy or f.router is None:
        f.stop_router()
        f.start_router(policy)
    before = counters(f)
    t0 = time.monotonic()
    results = replay(f.url, f.model_name, built_in_trace(users=8, turns=3), max_tokens=6, tag=tag, deadline_s=240)
    summary = summarize(results, time.monotonic() - t0)
    deltas = [{k: a[k] - b.get(k, 0.0) for k in a} for a, b in zip(counters(f), before, strict=True)]
    return summary, deltas, results


def test_every_request_is_answered_and_each_replica_counted_what_it_got(fleet):
    summary, deltas, results = run(fleet, "round_robin", "[round robin] ")
    assert summary["answered"] == summary["requests"] == 24, [r.error for r in results if r.error]
    assert all(r.completion_tokens >= 1 and r.prompt_tokens > 0 for r in results)
    received = [d["radix_requests_total"] for d in deltas]
    assert received == [24 / REPLICAS] * REPLICAS  # round robin: an even share each, each one counted
    assert sum(d["radix_prefix_cache_queries_total"] for d in deltas) == summary["prompt_tokens"]
    assert sum(d["radix_prefix_cache_hits_total"] for d in deltas) == summary["cached_tokens"]
    health = [httpx.get(r.url + "/health", timeout=5).status_code for r in fleet.members]
    assert health == [200] * REPLICAS


def test_cache_aware_routing_caches_more_of_the_fleets_prompts_than_round_robin(fleet):
    robin, _, _ = run(fleet, "round_robin", "[robin, again] ")
    aware, deltas, results = run(fleet, "cache_aware", "[cache aware] ")
    assert aware["answered"] == 24, [r.error for r in results if r.error]
    assert sum(d["radix_requests_total"] for d in deltas) == 24  # each request counted by the replica it reached
    assert sum(d["radix_prefix_cache_hits_total"] for d in deltas) == aware["cached_tokens"]
    print(f"cached-token share: round_robin {robin['hit_rate']:.1%}, cache_aware {aware['hit_rate']:.1%}")
    assert aware["hit_rate"] > robin["hit_rate"] + 0.1


def router_counters(f: Fleet) -> dict[str, float]:
    """The router's own Prometheus counters (its ``--prometheus-port``, loopback)."""
    out: dict[str, float] = {}
    for line in httpx.get(f"http://127.0.0.1:{f.prometheus_port}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_kv_aware_routes_on_our_events_and_caches_more_than_round_robin(fleet):
    """What kv_aware gets from our replicas: it follows their loopback event endpoints, renders
    each prompt through our ``/v1/chat/completions/render`` (vLLM's route, never
    ``render_unavailable``), looks the prompt's blocks up in the index our events built (hits, in
    the router's own counters), and so caches more of the fleet's prompts than round robin."""
    robin, _, _ = run(fleet, "round_robin", "[robin, for kv] ")
    summary, deltas, results = run(fleet, "kv_aware", "[kv aware] ")
    assert summary["answered"] == 24, [r.error for r in results if r.error]
    assert sum(d["radix_requests_total"] for d in deltas) == 24
    assert sum(d["radix_prefix_cache_hits_total"] for d in deltas) == summary["cached_tokens"]
    c = router_counters(fleet)
    rendered = c.get('vllm_router_kv_routing_inputs_total{transport="http",result="render"}', 0)
    assert rendered >= 24, c
    assert not [k for k in c if "kv_routing_inputs_total" in k and "render\"" not in k], c  # nothing else
    assert c.get('vllm_router_kv_placement_lookups_total{result="hit"}', 0) >= 8, c  # every later turn at least
    print(f"cached-token share: round_robin {robin['hit_rate']:.1%}, kv_aware {summary['hit_rate']:.1%}")
    assert summary["hit_rate"] > robin["hit_rate"] + 0.1


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _processes_naming(needles: list[str]) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "app.py" in text and any(n in text for n in needles):
            found.append(text)
    return found


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_the_command_line_stops_every_process_it_started(tiny_model, tmp_path, sig):
    """``python -m tools.fleet``: prints each replica and the router, serves through the router, and
    on Ctrl+C (SIGINT, even started in the background) or SIGTERM leaves no process and no port behind."""
    need_router()
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "tools.fleet", "--replicas", "2", "--policy", "round_robin",
                             "--model", tiny_model, "--budget-mb", "16", "--threads", "1", "--log-dir", str(tmp_path)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
            if line.startswith("Send OpenAI requests"):
                break
        out = "".join(lines)
        replica_ports = [int(p) for p in re.findall(r"replica \d+: http://127\.0\.0\.1:(\d+)", out)]
        event_ports = [int(p) for p in re.findall(r"events tcp://127\.0\.0\.1:(\d+)", out)]
        router_port = int(re.search(r"router \(round_robin\): http://127\.0\.0\.1:(\d+)", out).group(1))
        assert len(replica_ports) == len(event_ports) == 2, out
        r = httpx.post(f"http://127.0.0.1:{router_port}/v1/completions", timeout=60,
                       json={"prompt": "The harbour opens at", "max_tokens": 2})
        assert r.status_code == 200, r.text
        proc.send_signal(sig)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0 and "Stopped." in rest and "Traceback" not in rest, out + rest
    assert not [p for p in [*replica_ports, *event_ports, router_port] if _listening(p)]
    assert _processes_naming([f"--port {p}" for p in replica_ports]) == []


# ---------------------------------------------------------------- the dashboard in front of the router (--fleet)
def _content_chains(tree) -> Counter:
    """Each held block's content as the tokens from its first block (a plain walk up the parents):
    an independent count of what ``server.remote.fleet.duplication`` counts by interning."""
    out: Counter = Counter()
    with tree.lock:
        for b in tree.blocks.values():
            tokens, cur, attached = [], b, True
            while cur is not None:
                tokens[:0] = cur.token_ids
                if cur.parent is None:
                    break
                cur = tree.blocks.get(cur.parent)
                attached = cur is not None
            out[(b.salt if attached else ("detached", b.hash), tuple(tokens))] += len(b.token_ids)
    return out


def test_the_dashboard_with_fleet_sees_each_replicas_real_tree_and_where_requests_landed(fleet, tiny_model):
    """``app.py --backend ROUTER --fleet URL,...``: chat requests go through the router; the fleet view
    holds, per replica, exactly the blocks an independent subscriber of that replica counts; each
    request is attributed to a replica, and per replica the attributed requests add up to what its own
    ``/metrics`` counted (requests, prompt tokens, cached tokens as reported in usage); the duplication
    equals a direct count; and the page gets a Fleet tab."""
    import app
    from components.demo import build_demo
    from components.views.fleet_tables import duplication_line, replicas_table, requests_table
    from engine.types import GenerationRequest, SamplingParams
    from server.remote.block_tree import BlockTree
    from server.remote.kv_events import KVEventSubscriber, discover

    if fleet.policy != "round_robin" or fleet.router is None:
        fleet.stop_router()
        fleet.start_router("round_robin")
    urls = [r.url for r in fleet.members]
    engine = app.build_remote_engine(app.parse_args(["--backend", fleet.url, "--model", tiny_model,
                                                     "--fleet", ",".join(urls)]))
    mine = []
    try:
        for r in fleet.members:
            client = httpx.Client(base_url=r.url, timeout=10)
            mine.append(KVEventSubscriber(discover(lambda p, c=client: c.get(p).json(), r.url), BlockTree()).start())
        before = counters(fleet)
        system = "You answer questions about the harbour office of Northwind. " * 6 + "[fleet tab] "
        sent = []
        for i in range(6):
            m = engine.run(GenerationRequest(
                messages=({"role": "system", "content": system}, {"role": "user", "content": f"Question {i}?"}),
                sampling=SamplingParams(max_new_tokens=4), tag="chat"))
            sent.append(m)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(engine.fleet_view().requests) < len(sent):
            time.sleep(0.1)
        deltas = [{k: a[k] - b.get(k, 0.0) for k in a} for a, b in zip(counters(fleet), before, strict=True)]
        view = engine.fleet_view()
        assert len(view.requests) == len(sent) and len(view.replicas) == REPLICAS

        # Each replica's tree is what an independent subscriber of its events holds.
        for sub, r in zip(mine, engine.fleet.replicas, strict=True):
            assert sub.wait_for(lambda s=sub, t=r.blocks: _content_chains(s.tree) == _content_chains(t), 10)
        view = engine.fleet_view()
        for sub, rv in zip(mine, view.replicas, strict=True):
            assert rv.blocks_held == len(sub.tree.blocks) > 0
            assert rv.tokens_held == sum(len(b.token_ids) for b in sub.tree.blocks.values())
            assert rv.snapshot.num_tokens == rv.tokens_held and rv.events_alive

        # Each request landed somewhere known; per replica, they add up to its own counters.
        by_id = {m.request_id: m for m in sent}
        assert all(q.landed is not None for q in view.requests), view.requests
        assert {q.rule for q in view.requests} <= {"gained", "counted"}, view.requests  # events, else exact counters
        for i, d in enumerate(deltas):
            landed = [by_id[q.request_id] for q in view.requests if q.landed == i]
            assert d["radix_requests_total"] == len(landed) == 2, (  # round robin: 6 requests, 2 each
                i, deltas, [(q.landed, q.rule, q.cached_reported, q.cached_on_landed) for q in view.requests])
            assert d["radix_prefix_cache_queries_total"] == sum(m.prompt_tokens for m in landed)
            assert d["radix_prefix_cache_hits_total"] == sum(m.cached_tokens for m in landed)
        bs = view.replicas[0].block_size
        for q in view.requests:
            m = by_id[q.request_id]
            assert q.cached_reported == m.cached_tokens and q.prompt_tokens == m.prompt_tokens
            # what the landed replica's events held of the prompt, checked against what it reported
            assert q.cached_on_landed == m.cached_tokens // bs * bs, (q, m.cached_tokens)
            assert q.best_before >= q.cached_on_landed
        assert any(q.best_before > q.cached_on_landed for q in view.requests)  # round robin leaves reuse behind

        # Duplication: a direct count over the independent subscribers' trees.
        chains = [_content_chains(s.tree) for s in mine]
        sizes: dict = {}
        copies: Counter = Counter()
        for c in chains:
            for k, n in c.items():
                sizes[k], copies[k] = n, copies[k] + 1
        assert view.tokens_held == sum(sum(c.values()) for c in chains)
        assert view.tokens_distinct == sum(sizes.values())
        assert view.tokens_on_several == sum(sizes[k] for k, n in copies.items() if n > 1) > 0
        assert view.kv_bytes_per_token and view.duplicate_bytes == int(view.duplicate_copy_tokens
                                                                       * view.kv_bytes_per_token)

        # The page: a Fleet tab, and its words over the real view.
        from components.views.routing_lab_report import parse_report, to_json
        from tests.components.test_routing_lab_report import REPORT

        demo = build_demo(engine, routing_lab=parse_report(to_json(REPORT)))
        assert "Fleet" in [b.label for b in demo.blocks.values() if type(b).__name__ == "Tab"]
        texts = [str(b.value) for b in demo.blocks.values() if type(b).__name__ == "Markdown"]
        assert any("| cache_aware | 24/24 | 87.0%" in t for t in texts)  # the routing lab's table (--routing-lab)
        assert "No report loaded" in " ".join(str(b.value) for b in build_demo(engine).blocks.values()
                                              if type(b).__name__ == "Markdown")
        from components.panels.tree_panel import REMOTE_FLEET_NOTE, remote_note
        assert remote_note(engine) == REMOTE_FLEET_NOTE  # the tree tab points to the Fleet tab
        assert "replica 2" in replicas_table(view) and "landed" in requests_table(view)
        assert f"{view.duplicate_copy_tokens:,} tokens" in duplication_line(view)
    finally:
        for sub in mine:
            sub.close()
        engine.close()


def _until(predicate, timeout_s: float, every_s: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every_s)
    return bool(predicate())


def test_faults_a_replica_dies_restarts_and_its_events_stop_and_the_router_restarts(fleet, tiny_model):
    """Issue 45, item 6, on the real fleet: a replica killed mid-run is shown down (its tree the last
    known) and the router's health checks drop it, so every later request is answered by the others;
    restarted, it is live again with its tree rebuilt from its new events (a subscriber of its own holds
    the same); a replica whose events stop while it computes prompts is shown stale, not empty; and while
    the router restarts the dashboard's requests fail with one clear message, then work again."""
    import app
    from engine.types import EngineError, GenerationRequest, SamplingParams
    from server.remote.block_tree import BlockTree
    from server.remote.kv_events import EventSource, KVEventSubscriber, discover

    if fleet.policy != "round_robin" or fleet.router is None:
        fleet.stop_router()
        fleet.start_router("round_robin")
    engine = app.build_remote_engine(app.parse_args(["--backend", fleet.url, "--model", tiny_model,
                                                     "--fleet", ",".join(r.url for r in fleet.members)]))
    system = "You answer questions about the lighthouse of Northwind. " * 6 + "[faults] "

    def ask(i: int):
        return engine.run(GenerationRequest(
            messages=({"role": "system", "content": system}, {"role": "user", "content": f"Fault question {i}?"}),
            sampling=SamplingParams(max_new_tokens=3), tag="chat"))

    try:
        for i in range(3):
            ask(i)
        assert [r.state for r in engine.fleet_view().replicas] == ["live"] * REPLICAS
        # 1. A replica dies: shown down, its tree the last known; the router drops it; all later answered.
        held = engine.fleet_view().replicas[2].tokens_held
        fleet.kill_replica(2)
        assert _until(lambda: engine.fleet_view().replicas[2].state == "down", 15)
        down = engine.fleet_view().replicas[2]
        assert down.since is not None and down.tokens_held == held
        from components.views.fleet_tables import replica_title, replicas_table
        assert "**down** since" in replica_title(2, down) and "last known" in replicas_table(engine.fleet_view())
        time.sleep(3 * 2 + 1)  # the router's health checks: two misses, two seconds apart (tools.fleet)
        answered = [ask(10 + i) for i in range(6)]
        assert all(m.output_tokens > 0 for m in answered)
        # 2. It restarts: live again, its tree rebuilt from its new process's events.
        fleet.restart_replica(2)
        assert _until(lambda: engine.fleet_view().replicas[2].state == "live", 30)
        follower = engine.fleet.replicas[2]
        client = httpx.Client(base_url=fleet.members[2].url, timeout=10)
        own = KVEventSubscriber(discover(lambda p: client.get(p).json(), fleet.members[2].url), BlockTree()).start()
        try:
            time.sleep(2 * 2 + 1)  # the router takes it back after two passed checks, two seconds apart
            for i in range(6):
                ask(20 + i)
            assert _until(lambda: _content_chains(own.tree) == _content_chains(follower.blocks)
                          and len(own.tree.blocks) > 0, 20), (len(own.tree.blocks), len(follower.blocks.blocks),
                                                               follower.events.stats)
        finally:
            own.close()
            client.close()
        # 3. Its events stop (our follower now listens where nothing is published) while it computes:
        #    shown stale, what it holds unknown, not empty.
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        port = silent.getsockname()[1]
        silent.close()
        follower.events.close()
        follower.events = KVEventSubscriber(EventSource(f"tcp://127.0.0.1:{port}", None, "kv-events"),
                                            follower.blocks).start(wait_s=0.5)
        assert engine.fleet_view().replicas[2].state == "live"  # counted from here: nothing computed yet
        with httpx.Client(timeout=60) as http:
            for i in range(3):  # straight to the replica, prompts of its own: blocks computed, none published
                http.post(fleet.members[2].url + "/v1/completions",
                          json={"model": fleet.model_name, "prompt": f"silent {i} " + "lighthouse keeper " * 40,
                                "max_tokens": 1})
        assert _until(lambda: engine.fleet_view().replicas[2].state == "stale", 20)
        assert "unknown, not empty" in replica_title(2, engine.fleet_view().replicas[2])
        # 4. The router restarts: one clear message meanwhile, then answers again.
        fleet.stop_router()
        with pytest.raises(EngineError, match="(?i)cannot reach the backend"):
            ask(30)
        fleet.start_router("round_robin")
        assert ask(31).output_tokens > 0
    finally:
        engine.close()
        if not fleet.members[2].child.alive():
            fleet.restart_replica(2)


def test_the_routing_lab_writes_the_report_the_fleet_tab_reads(tiny_model, tmp_path, capsys):
    """``python -m tools.routing_lab --json FILE`` on two fresh tiny replicas: the table it prints and the
    report it writes, which ``app.py --routing-lab`` reads back (duplication from the replicas' events)."""
    from components.views.routing_lab_report import parse_report
    from tools.routing_lab import main

    need_router()
    out = tmp_path / "lab.json"
    assert main(["--replicas", "2", "--policies", "round_robin", "--model", tiny_model, "--budget-mb", "32",
                 "--users", "4", "--turns", "2", "--max-tokens", "4", "--threads", "1", "--json", str(out)]) == 0
    report = parse_report(out.read_bytes())
    row = report["rows"][0]
    assert row["policy"] == "round_robin" and row["answered"] == row["requests"] == 8
    assert row["per_replica"] == [4, 4] and row["held_tokens"] > 0 and row["duplicate_tokens"] >= 0
    assert report["predicted"] is not None and "round_robin" in report["predicted"]
    assert "| round_robin | 8/8 |" in capsys.readouterr().out
