"""What the command lines measure with: percentiles of timings and the process's resident memory.

Owns: ``percentile`` (nearest rank over the sorted values, the one definition every bench and
the load test print) ``rss_bytes`` (``VmRSS`` from /proc), ``read_bandwidth`` and
``bytes_per_token`` (what one decode step of one stream must read: the memory-bandwidth ceiling),
the machine's limits beside a benchmark's figures (``machine_limits``: read bandwidth and float32
FMA rate measured in the same run; ``model_cost`` and ``decode_limit``: the tokens/s a decode step
of a model cannot beat; ``machine_header``: the CPU, its ISA flags and ``RADIX_ISA``) and
``add_engine_args`` (the engine flags the load-shaped command lines share). Knows nothing about
engines.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


def percentile(values: list[float], q: float) -> float:
    """The value at quantile ``q`` (0..1) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(q * (len(ordered) - 1) + 0.5)))]


def rss_bytes(pid: int | str = "self") -> int:
    """A process's resident memory (``VmRSS``; this one by default), 0 where /proc is missing."""
    try:
        with open(f"/proc/{pid}/status") as f:
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


def fma_rate(n: int = 2048, repeats: int = 3) -> float:
    """Float32 FLOP/s of a compute-bound product (``n x n`` by ``n x n``, 2 n^3 FLOPs, one
    multiply-add counted as two), the best of ``repeats`` after a warm-up, with every thread
    PyTorch uses, on a fresh thread (like ``read_bandwidth``)."""
    import torch

    from engine.model.compute_thread import in_fresh_thread

    def measure() -> float:
        gen = torch.Generator().manual_seed(0)
        a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
        torch.mm(a, b)  # warm-up: MKL's buffers and threads
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
        return 2 * n**3 / best

    return in_fresh_thread(measure)


@dataclass(frozen=True)
class MachineLimits:
    """What the machine can do at best, measured in the benchmark's own run."""

    read_bytes_per_s: float  # a plain read (``read_bandwidth``)
    flops_per_s: float  # float32 multiply-adds, two FLOPs each (``fma_rate``)

    def describe(self) -> str:
        return (f"read bandwidth {self.read_bytes_per_s / 1e9:.1f} GB/s (torch sum over 1 GiB float32, best of 3), "
                f"FMA rate {self.flops_per_s / 1e9:.0f} GFLOP/s (float32 2048^3 matmul, best of 3)")


def machine_limits(read_bytes: int = 2**30, matmul_n: int = 2048, repeats: int = 3) -> MachineLimits:
    """This machine's read bandwidth and float32 FMA rate, now (a second or two)."""
    return MachineLimits(read_bandwidth(read_bytes, repeats), fma_rate(matmul_n, repeats))


@dataclass(frozen=True)
class ModelCost:
    """What one decode token of a model costs: bytes read once per step whatever the rows, FLOPs per
    row, and what each context token adds."""

    weight_bytes: int  # every parameter's bytes, a tied embedding counted once
    kv_bytes_per_token: int  # K and V of every layer for one context token
    flops_per_token: int  # 2 x the parameters a token multiplies by (not the input embedding's lookup)
    attention_flops_per_context_token: int  # q.k and p.v of every layer and query head: 4 x layers x Hq x D

    def read_bytes(self, rows: int, context_tokens: int, shared_tokens: int = 0) -> int:
        """What one decode step of ``rows`` streams, each over ``context_tokens``, reads: the
        weights once and the rows' KV, the first ``shared_tokens`` of every row's context (a prefix
        they share in the cache) once."""
        shared = max(0, min(shared_tokens, context_tokens)) if rows > 1 else 0
        return self.weight_bytes + (shared + rows * (context_tokens - shared)) * self.kv_bytes_per_token

    def step_seconds(self, rows: int, context_tokens: int, limits: MachineLimits, shared_tokens: int = 0) -> float:
        """The least time of one decode step: its reading (``read_bytes``) at the read bandwidth, or
        its FLOPs at the FMA rate, whichever is longer."""
        flops = rows * (self.flops_per_token + context_tokens * self.attention_flops_per_context_token)
        return max(self.read_bytes(rows, context_tokens, shared_tokens) / limits.read_bytes_per_s,
                   flops / limits.flops_per_s)

    def serial_seconds(self, rows: int, context_tokens: int, limits: MachineLimits, shared_tokens: int = 0) -> float:
        """Issue 48's estimate of a step, the sum of its parts with no overlap: its reading
        (``read_bytes``) at the read bandwidth, then every row's linear FLOPs (not attention's) at
        half the FMA rate. An estimate, not a bound like ``step_seconds``: a step between the two
        overlaps little of its reading with its arithmetic."""
        return (self.read_bytes(rows, context_tokens, shared_tokens) / limits.read_bytes_per_s
                + rows * self.flops_per_token / (limits.flops_per_s / 2))


def decode_limit(cost: ModelCost, rows: int, context_tokens: int, limits: MachineLimits,
                 shared_tokens: int = 0) -> float:
    """The tokens/s ``rows`` streams decoding together cannot beat (``ModelCost.step_seconds``)."""
    return rows / cost.step_seconds(rows, context_tokens, limits, shared_tokens)


def model_cost(model, kv_bytes_per_token: int, num_layers: int, q_heads: int, head_dim: int) -> ModelCost:
    """``ModelCost`` of a loaded torch model: its parameters as loaded (a tied embedding, one tensor,
    counted once; an untied input embedding is a lookup, no FLOPs)."""
    seen: dict[int, tuple[int, int]] = {}
    for p in model.parameters():
        seen.setdefault(p.data_ptr(), (p.numel(), p.numel() * p.element_size()))
    params = sum(n for n, _ in seen.values())
    weight_bytes = sum(b for _, b in seen.values())
    embed = getattr(model, "get_input_embeddings", lambda: None)()
    head = getattr(model, "get_output_embeddings", lambda: None)()
    lookup = 0
    if embed is not None and (head is None or head.weight.data_ptr() != embed.weight.data_ptr()):
        lookup = embed.weight.numel()
    return ModelCost(weight_bytes, kv_bytes_per_token, 2 * (params - lookup), 4 * num_layers * q_heads * head_dim)


def limit_cell(tokens_per_s: float, limit: float) -> str:
    """A row's figure beside its limit: ``"20.0 (62% of 32.1)"``."""
    return f"{limit:.1f} ({tokens_per_s / limit:.0%})" if limit > 0 else "-"


def machine_header(limits: MachineLimits | None = None) -> str:
    """The CPU, its ISA flags, ``RADIX_ISA`` and (given) the limits measured: the lines a
    benchmark prints first, so a figure says which machine it came from."""
    from engine.model import native_build

    flags = native_build.cpu_flags()
    model = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    shown = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile"))
    import torch

    lines = [f"CPU: {model}, {os.cpu_count()} cores; {shown}",
             f"RADIX_ISA={os.environ.get(native_build.ENV_ISA) or '(unset)'}: our kernels {native_build.describe_isa()}",
             # RADIX_ISA narrows our C only; PyTorch's own vector code follows ATEN_CPU_CAPABILITY (and oneDNN
             # ONEDNN_MAX_CPU_ISA, MKL MKL_ENABLE_INSTRUCTIONS), read once when torch first needs them
             f"PyTorch's kernels: {torch.backends.cpu.get_cpu_capability()} (ATEN_CPU_CAPABILITY="
             f"{os.environ.get('ATEN_CPU_CAPABILITY') or '(unset)'}, ONEDNN_MAX_CPU_ISA="
             f"{os.environ.get('ONEDNN_MAX_CPU_ISA') or '(unset)'})"]
    if limits is not None:
        lines.append(f"Limits measured in this run: {limits.describe()}")
    return "\n".join(lines)


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
