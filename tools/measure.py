"""What the command lines measure with: percentiles of timings and the process's resident memory.

Owns: ``percentile`` (nearest rank over the sorted values, the one definition every bench and
the load test print) ``rss_bytes`` (``VmRSS`` from /proc) and
``add_engine_args`` (the engine flags the load-shaped command lines share). Knows nothing about engines.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable


def percentile(values: list[float], q: float) -> float:
    """The value at quantile ``q`` (0..1) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(q * (len(ordered) - 1) + 0.5)))]


def rss_bytes() -> int:
    """This process's resident memory (``VmRSS``), 0 where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags every load-shaped command line takes: isolation, model, device."""
    p.add_argument("--isolate", action="store_true", help="per-visitor cache namespaces, as on Spaces")
    p.add_argument("--model", default="embedded", help="model id or path (default: the embedded SmolLM2)")
    p.add_argument("--device", default="auto")


def offline_env() -> None:
    """The environment the in-process app runs under in these tools (before gradio or the hub
    are imported): no hub calls, no analytics, no tokenizer thread pools fighting the model's."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run_clients(client: Callable[..., None], n: int, daemon: bool = False,
                prepare: Callable[[], object] | None = None) -> float:
    """Run ``client`` on ``n`` threads at once (a closed loop's streams); seconds until all end.
    With ``prepare``, each thread first makes what its client needs (an HTTP client with its
    TLS context: 30-40 ms each here, the client's cost, not the server's), all wait until every
    one is ready, and only then the clock starts; ``client`` is called with it."""
    ready = threading.Barrier(n + 1)

    def run() -> None:
        made = prepare() if prepare is not None else None
        try:
            ready.wait()
        except threading.BrokenBarrierError:
            return
        client(made) if prepare is not None else client()

    threads = [threading.Thread(target=run, daemon=daemon) for _ in range(n)]
    for t in threads:
        t.start()
    ready.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0
