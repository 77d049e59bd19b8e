"""Start and stop a fleet on loopback: N replicas, then vLLM's router (``vllm-router``) in front.

Owns: the command line of each child (our ``app.py --replica`` or vLLM's CPU server; the router
with its policy and, for ``kv_aware``, each replica's KV-event endpoints), their ports, waiting
until each answers (a replica's ``GET /health``; the router's ``/health``), and stopping them:
every child runs in a session of its own, and ``stop`` sends SIGTERM to its process group, then
SIGKILL after a grace period, so nothing it started outlives the fleet. Knows nothing about the
requests sent through the fleet (``tools.fleet.trace``).

Ports: with ``base_port`` 0 every port is a free one; otherwise the router listens on
``base_port``, replica ``i`` on ``base_port + 1 + i``, its events on ``base_port + 100 + 2i`` and
its replay endpoint on the next one, the router's Prometheus page on ``base_port + 99``.

Our replicas publish their KV events on loopback (``"publisher_binds": true``: the router
connects). vLLM binds only wildcard endpoints (``tcp://*:P``, every interface), so a vLLM
replica's event sockets are reachable from the network: use that engine on a trusted host only.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
ROUTER_VERSION = "0.1.17"  # tools/install_router.sh
POLICIES = ("random", "round_robin", "cache_aware", "kv_aware", "power_of_two", "consistent_hash",
            "sticky_least_loaded")
EVENT_BLOCK_SIZE = 32  # our publisher's default, and the only size vLLM's CPU build takes
# The replicas publish under the empty topic: vllm-router's static event sources subscribe to ""
# and drop every message whose topic frame is not exactly that (a "kv-events" topic left
# kv_aware with no index at all: every lookup missed, and it routed on load alone).
EVENT_TOPIC = ""
HOST = "127.0.0.1"
HEALTH_CHECK_S = 2  # the router checks each replica's /health this often (seconds), drops it after two misses


def router_venv() -> Path:
    """``RADIX_ROUTER_VENV``, default ``.venv-router`` at the repository's root."""
    return Path(os.environ.get("RADIX_ROUTER_VENV") or ROOT / ".venv-router")


def router_binary(venv: Path | None = None) -> Path | None:
    """The ``vllm-router`` command of that venv, or None when it is not installed."""
    path = (venv or router_venv()) / "bin" / "vllm-router"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def free_port() -> int:
    """A loopback port nobody listens on now (never 7860, the lead's app)."""
    while True:
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        if port != 7860:
            return port


@dataclass
class Child:
    """One process the fleet started, in a session (process group) of its own."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to its process group, SIGKILL after ``grace_s``; reaps it."""
        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
        try:  # what the leader left in its group (a worker it forked) goes too
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def wait_ready(child: Child, url: str, timeout_s: float) -> float:
    """Poll ``url`` until it answers 200; seconds taken. Fails with the child's log tail when it
    exits first or the time runs out."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if not child.alive():
            raise RuntimeError(f"{child.name} exited before it was ready; {child.log_path}:\n{child.log_tail()}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{child.name} was not ready within {timeout_s:.0f} s; {child.log_path}:\n{child.log_tail()}")


@dataclass
class Replica:
    index: int
    port: int
    events_port: int
    replay_port: int
    child: Child | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def events(self) -> str:
        return f"tcp://{HOST}:{self.events_port}"

    @property
    def replay(self) -> str:
        return f"tcp://{HOST}:{self.replay_port}"


@dataclass
class Fleet:
    """N replicas of one engine and the router in front (see the module's docstring)."""

    replicas: int
    policy: str
    engine: str = "ours"  # or "vllm" (vLLM's CPU build from RADIX_VLLM_VENV)
    model: str | None = None  # ours: any --model (default: the embedded one); vLLM: a folder
    base_port: int = 0
    budget_mb: float = 64.0
    log_dir: Path | None = None
    threads: int | None = None  # torch threads per replica (default: the cores shared out)
    members: list[Replica] = field(default_factory=list)
    router: Child | None = None
    router_port: int = 0
    model_name: str = ""  # what the replicas serve, from their /v1/models

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; one of {', '.join(POLICIES)}")
        if self.engine not in ("ours", "vllm"):
            raise ValueError(f"unknown engine {self.engine!r}: ours or vllm")
        self.log_dir = Path(self.log_dir or tempfile.mkdtemp(prefix="radix-fleet-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        b = self.base_port
        self.router_port = b or free_port()
        self.prometheus_port = b + 99 if b else free_port()
        self.members = [Replica(i, b + 1 + i if b else free_port(), b + 100 + 2 * i if b else free_port(),
                                b + 101 + 2 * i if b else free_port()) for i in range(self.replicas)]

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.router_port}"

    # ------------------------------------------------------------------ replicas
    def replica_child(self, r: Replica) -> Child:
        log = self.log_dir / f"replica-{r.index}.log"
        threads = self.threads or max(1, (os.cpu_count() or 1) // self.replicas)
        env = dict(os.environ, HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1",
                   TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(threads))
        if self.engine == "ours":
            events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": r.events,
                      "replay_endpoint": r.replay, "topic": EVENT_TOPIC, "block_size": EVENT_BLOCK_SIZE,
                      "publisher_binds": True}
            cmd = [sys.executable, "app.py", "--replica", "--host", HOST, "--port", str(r.port), "--no-isolate",
                   "--cache-budget-mb", f"{self.budget_mb:g}", "--disk-cache-mb", "0",
                   "--kv-events-config", json.dumps(events)]
            if self.model:
                cmd += ["--model", self.model]
            return Child(f"replica {r.index}", cmd, env, log)
        return Child(f"vLLM replica {r.index}", self.vllm_command(r), {**env, **self.vllm_env(r)}, log)

    def vllm_command(self, r: Replica) -> list[str]:
        from tools.vllm_server import model_dir, venv_path

        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{r.events_port}",
                  "replay_endpoint": f"tcp://*:{r.replay_port}", "topic": EVENT_TOPIC}
        return [str(venv_path() / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                "--model", self.model or str(model_dir()), "--served-model-name", "SmolLM2-135M-Instruct",
                "--host", HOST, "--port", str(r.port), "--enable-prefix-caching", "--enable-prompt-tokens-details",
                "--max-model-len", "4096", "--dtype", "bfloat16", "--block-size", str(EVENT_BLOCK_SIZE),
                "--enforce-eager", "--enable-scale-out",  # its /render routes, which kv_aware asks first
                "--kv-events-config", json.dumps(events)]

    def vllm_env(self, r: Replica) -> dict[str, str]:
        return {"VLLM_CPU_KVCACHE_SPACE": str(max(1, math.ceil(self.budget_mb / 1024))),
                "VLLM_CPU_OMP_THREADS_BIND": "0-1" if (os.cpu_count() or 1) >= 2 else "0",
                "VLLM_CACHE_ROOT": str(self.log_dir / f"vllm-cache-{r.index}"), "VLLM_SERVER_DEV_MODE": "1",
                "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"}

    def start_replicas(self, timeout_s: float) -> None:
        for r in self.members:
            r.child = self.replica_child(r)
            r.child.start()
        for r in self.members:  # they load side by side; each is waited for in turn
            assert r.child is not None
            wait_ready(r.child, r.url + "/health", timeout_s)
        models = httpx.get(self.members[0].url + "/v1/models", timeout=10).json()
        self.model_name = str(models["data"][0]["id"])

    def kill_replica(self, index: int) -> None:
        """SIGKILL replica ``index``'s process group (a crash: no goodbye to the router or subscribers)."""
        child = self.members[index].child
        if child is not None and child.proc is not None:
            try:
                os.killpg(child.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.proc.wait(timeout=30)

    def restart_replica(self, index: int, timeout_s: float = 300.0) -> float:
        """Start replica ``index`` again, on its ports (a new process: empty cache, events from seq 0);
        seconds until it answers ``/health``."""
        r = self.members[index]
        if r.child is not None and r.child.alive():
            r.child.stop()
        r.child = self.replica_child(r)
        r.child.start()
        return wait_ready(r.child, r.url + "/health", timeout_s)

    # ------------------------------------------------------------------ the router
    def router_command(self, policy: str) -> list[str]:
        binary = router_binary()
        if binary is None:
            raise RuntimeError(f"vllm-router is not installed in {router_venv()}: run tools/install_router.sh")
        cmd = [str(binary), "--worker-urls", *[r.url for r in self.members], "--policy", policy,
               "--host", HOST, "--port", str(self.router_port), "--prometheus-host", HOST,
               "--prometheus-port", str(self.prometheus_port), "--worker-startup-check-interval", "1",
               # a replica that dies is dropped within seconds (defaults: a check a minute, three failures)
               "--health-check-interval-secs", str(HEALTH_CHECK_S), "--health-failure-threshold", "2",
               "--health-check-timeout-secs", "2",
               "--log-level", os.environ.get("RADIX_ROUTER_LOG_LEVEL", "warning")]
        if policy == "kv_aware":
            for r in self.members:
                cmd += ["--kv-event-source", f"{r.url}={r.events}", "--kv-event-replay-source", f"{r.url}={r.replay}"]
            cmd += ["--kv-event-block-size", str(EVENT_BLOCK_SIZE), "--kv-event-model", self.model_name]
        return cmd

    def start_router(self, policy: str | None = None, timeout_s: float = 60.0) -> None:
        """Start the router (again, after ``stop_router``) with ``policy`` (default: the fleet's)."""
        self.policy = policy or self.policy
        log = self.log_dir / f"router-{self.policy}.log"
        self.router = Child(f"router ({self.policy})", self.router_command(self.policy), dict(os.environ), log)
        self.router.start()
        wait_ready(self.router, self.url + "/health", timeout_s)

    def stop_router(self) -> None:
        if self.router is not None:
            self.router.stop(grace_s=10.0)
            self.router = None

    # ------------------------------------------------------------------ the whole fleet
    def start(self, timeout_s: float = 600.0) -> Fleet:
        """Replicas first (each answers /health), then the router; on any failure everything stops."""
        try:
            self.start_replicas(timeout_s)
            self.start_router(timeout_s=min(timeout_s, 120.0))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """The router, then every replica (SIGTERM to its group, SIGKILL after a grace period)."""
        self.stop_router()
        for r in self.members:
            if r.child is not None:
                r.child.stop()

    def describe(self) -> list[str]:
        def events(r: Replica) -> str:  # vLLM binds every interface (see the module's docstring)
            return r.events if self.engine == "ours" else f"tcp://*:{r.events_port}"

        lines = [f"replica {r.index}: {r.url}  events {events(r)} (replay {r.replay_port})" for r in self.members]
        return lines + [f"router ({self.policy}): {self.url}  logs {self.log_dir}"]

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def metrics_of(url: str, names: Sequence[str] = ("radix_requests_total", "radix_prefix_cache_queries_total",
                                                  "radix_prefix_cache_hits_total")) -> dict[str, float]:
    """Some of a replica's ``/metrics`` counters (ours; a private replica answers anyone)."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            out[name] = float(value)
    return out
