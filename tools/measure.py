"""What the command lines measure with: percentiles of timings and the process's resident memory.

Owns: ``percentile`` (nearest rank over the sorted values, the one definition every bench and
the load test print) ``rss_bytes`` (``VmRSS`` from /proc), ``read_bandwidth`` and
``bytes_per_token`` (what one decode step of one stream must read: the memory-bandwidth ceiling)
and ``add_engine_args`` (the engine flags the load-shaped command lines share). Knows nothing
about engines.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path


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


def read_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes per second of a plain read with every thread PyTorch uses: the best of ``repeats``
    sums over a float32 tensor of ``nbytes`` (far larger than any cache), on a fresh thread so
    the caller's keeps no OpenMP pool."""
    import torch

    from engine.model.compute_thread import in_fresh_thread

    def measure() -> float:
        data = torch.ones(nbytes // 4, dtype=torch.float32)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            float(data.sum())
            best = min(best, time.perf_counter() - t0)
        return nbytes / best

    return in_fresh_thread(measure)


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def bytes_per_token(folder: Path, dtype: str, context_tokens: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) that one decode step of one stream reads in ``dtype`` for a
    context of ``context_tokens``: every weight in the model folder's safetensors files once (tied
    embeddings are stored once and read once, as the LM head), and every layer's K and V of
    every context token (from its ``config.json``)."""
    elem = DTYPE_BYTES[dtype]
    params = 0
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for name, info in header.items():
            if name != "__metadata__":
                n = 1
                for dim in info["shape"]:
                    n *= dim
                params += n
    cfg = json.loads((Path(folder) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim * elem
    return params * elem, kv * context_tokens


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
