"""Serving benchmark: the same chat requests at 1, 4, 8, 16 concurrent streams, three ways.

    python -m tools.serve_bench [--streams 1,4,8,16] [--requests 16] [--max-new-tokens 32]
                                       [--engines one,batched,hf] [--model ID] [--device auto] [--dtype auto]
    python -m tools.serve_bench --quick      # a smoke run: 1 and 4 streams, 4 short requests
    python -m tools.serve_bench --system-tokens 2300 --streams 16   # a long shared prefix

Every request is a chat turn with the same system prompt and its own question
(greedy). For each number of streams ``c``, ``c`` client threads take the
requests one after another (a closed loop: a stream sends its next request
when its answer is done), through:

- ``one``: this engine one request at a time (``Engine(max_batch=1)``), radix cache on;
- ``batched``: this engine with continuous batching (``max_batch`` 16), radix cache on;
- ``hf``: transformers' ``generate_batch`` (paged KV, ``allow_block_sharing=True``,
  page size 16, at most ``c`` requests per batch), all requests handed over at once.
  It runs in a child process with the model exactly as transformers loads it (plain
  linears, SDPA), so its threads, like ours, have the CPU's OpenMP pool to themselves
  (see ``engine.model.compute_thread``).

With ``--system-tokens N`` the system prompt is a policy manual of about ``N``
tokens (one copy of its KV is ``N x kv_bytes_per_token``), the workload this product
exists for: many requests behind one long prefix. Our engines then start with that
prefix already cached (``--cold`` starts them empty), as a running service would.

Each run starts from a cold cache otherwise. Printed per row: output tokens per second
(all streams together, wall clock), time to first token p50/p95 (from sending the
request to its first token, queueing included), the peak growth of the process's
resident memory during the run (``VmRSS``, sampled every 20 ms; the KV budget is the
bound it should respect) and how many answers are token-identical to the same request
run alone on an engine with no cache, and the row's limit: the tokens/s its decode steps cannot
beat on this machine (``tools.measure.decode_limit``: each step reads the model's weights and the
shared system prompt's KV once and each row's own KV at the read bandwidth, or does its FLOPs at the float32 FMA rate, both measured at the
start of the run; rows per step: 1 one at a time, the streams up to 16 batched, the streams for hf;
the context: the mean prompt plus half the answer) and the row's share of it. First come the CPU,
its ISA flags, ``RADIX_ISA`` and the limits measured. Finally, at 8 streams (or the largest run):
batched / one-at-a-time and batched / hf throughput.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import json
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch

from engine.engine import Engine
from engine.model.compute_thread import in_fresh_thread
from engine.model.native_linear import plain_linears
from engine.model.packed_linear import unpack_linears
from engine.model.runner import ModelRunner
from engine.types import GenerationRequest, SamplingParams
from tools.measure import (
    MachineLimits,
    ModelCost,
    decode_limit,
    limit_cell,
    machine_header,
    machine_limits,
    model_cost,
    percentile,
    rss_bytes,
    run_clients,
)

SYSTEM = ("You are the help desk of Trailhead Outfitters, a shop for hiking and camping gear. Answer in two or "
          "three friendly sentences. Returns: unused items within 30 days with a receipt; used tents and sleeping "
          "bags within 14 days if clean. Shipping: standard 3-5 days, free over $50; express next day for $15. "
          "Warranty: two years on backpacks, tents and sleeping bags. Stores open 9-6 Monday to Saturday.")
QUESTIONS = [
    "Can I return a tent I used once?", "How much is express shipping?", "Do sleeping bags have a warranty?",
    "When are you open on Saturday?", "Is shipping free for a $40 order?", "What boots do you recommend?",
    "Can I return a backpack without a receipt?", "How long does standard shipping take?",
    "Do you sell water filters?", "What should I pack for a rainy hike?", "Can I exchange a jacket size?",
    "Are your tents waterproof?", "Do you ship to Canada?", "How do I clean a sleeping bag?",
    "What is your warranty on stoves?", "Can I pick up an order in store?",
]


_MANUAL_TOPICS = ["returns", "exchanges", "shipping", "warranty claims", "repairs", "rentals", "gift cards",
                  "price matching", "store pickup", "membership", "trade-ins", "safety recalls"]


def policy_manual(encode: Callable[[str], Sequence[int]], num_tokens: int) -> str:
    """A deterministic help-desk policy manual of about ``num_tokens`` tokens (the system
    prompt of the long-prefix workload; ``encode`` counts them), cut at a sentence near the
    target. ``tools.peer_bench`` sends the same one over HTTP."""
    parts = [SYSTEM, "\n\nPolicy manual (staff edition). Quote the clause that applies."]
    i = 0
    while len(encode(" ".join(parts))) < num_tokens:
        topic = _MANUAL_TOPICS[i % len(_MANUAL_TOPICS)]
        n = i + 1
        parts.append(
            f"\n\nSection {n}: {topic}. {n}.1 Staff confirm the order number and the date of purchase before "
            f"handling {topic}. {n}.2 Items covered by {topic} must be clean, complete and in their original "
            f"packaging unless a manager approves an exception in writing. {n}.3 Refunds for {topic} go back to "
            f"the original payment method within {3 + i % 5} business days. {n}.4 Members get {5 + i % 4} extra "
            f"days for {topic}. {n}.5 Questions the manual does not answer go to the duty manager.")
        i += 1
    return " ".join(parts)


def chat_requests(n: int, max_new_tokens: int, system_text: str = SYSTEM) -> list[GenerationRequest]:
    system = {"role": "system", "content": system_text}
    return [GenerationRequest(messages=(system, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]
                                                 + ("" if i < len(QUESTIONS) else f" (ask {i})")}),
                              sampling=SamplingParams(max_new_tokens=max_new_tokens), tag="bench")
            for i in range(n)]


@dataclass
class Row:
    engine: str
    streams: int
    requests: int
    output_tokens: int
    wall_s: float
    ttft_ms: list[float]
    identical: int
    rss_growth_mb: float | None = None  # peak VmRSS growth during the run (our engines only)
    budget_mb: float | None = None
    device_peak_mb: float | None = None  # on CUDA: peak GPU memory allocated during the run (weights and pool in)
    limit_tokens_per_s: float = 0.0  # what its decode steps cannot beat here (module docstring); 0: unknown

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


class RssPeak:
    """Samples ``VmRSS`` every 20 ms in a thread; ``growth`` is the peak over the start."""

    def __init__(self) -> None:
        self.start = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss_bytes())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        return self.peak - self.start


def run_engine(runner: ModelRunner, requests: list[GenerationRequest], streams: int, max_batch: int,
               reference: list[list[int]], budget_bytes: int | None = None,
               warm: GenerationRequest | None = None) -> tuple[float, list[float], list[list[int]], int, int | None]:
    """``streams`` closed-loop clients through a fresh engine (``warm`` run first, off the
    clock, to cache a shared prefix); returns wall s, TTFTs (ms), outputs, peak RSS growth and,
    on CUDA, the peak GPU memory allocated during the run (bytes; None elsewhere)."""
    engine = Engine(runner, max_batch=max_batch, max_queue=max(32, len(requests)), budget_bytes=budget_bytes)
    if warm is not None:
        engine.run(warm)
    cuda = runner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(runner.device)
        torch.cuda.reset_peak_memory_stats(runner.device)
    rss = RssPeak()
    outputs: list[list[int]] = [[] for _ in requests]
    ttfts: list[float] = [0.0] * len(requests)
    nxt = iter(range(len(requests)))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            t0 = time.perf_counter()
            first = None
            for event in engine.submit(requests[i]):
                if first is None and (event.token_id is not None or event.done):
                    first = time.perf_counter()
                if event.done:
                    outputs[i] = event.metrics.output_ids
            ttfts[i] = ((first or time.perf_counter()) - t0) * 1000

    wall = run_clients(client, streams)
    growth = rss.stop()
    device_peak = torch.cuda.max_memory_allocated(runner.device) if cuda else None
    engine.close()
    return wall, ttfts, outputs, growth, device_peak


def hf_peer(runner: ModelRunner):
    """A copy of the model as transformers ships it (plain ``nn.Linear``, SDPA attention), for an
    in-process peer run (the tiny test model, which no child process can load by name)."""
    model = runner.compute.call(copy.deepcopy, runner.model)
    unpack_linears(model)
    plain_linears(model)
    model.set_attn_implementation("sdpa")
    return model


def run_hf(model, ids: list[list[int]], eos_ids: Collection[int], streams: int,
           max_new_tokens: int) -> tuple[float, list[float], list[list[int]]]:
    """transformers' ``generate_batch`` over prompt ids; returns wall s, TTFTs (ms), outputs."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    eos = sorted(eos_ids)
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
                           pad_token_id=eos[0] if eos else 0)
    longest = max(len(i) for i in ids) + max_new_tokens
    pages = (longest + 15) // 16
    # the page size is ``page_size`` on transformers 5.24, ``block_size`` on 5.17 (the GPU machine's)
    page = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
    cb = ContinuousBatchingConfig(num_blocks=pages * len(ids) + 8, max_batch_tokens=512,
                                  max_requests_per_batch=streams, allow_block_sharing=True, **{page: 16})
    t0 = time.perf_counter()
    results = model.generate_batch(inputs=ids, generation_config=gen, continuous_batching_config=cb,
                                   record_timestamps=True, progress_bar=False)
    wall = time.perf_counter() - t0
    outputs, ttfts = [], []
    for out in results.values():
        toks = [t for t in out.generated_tokens]
        while toks and toks[-1] in eos_ids:
            toks.pop()
        outputs.append(toks)
        stamps = out.timestamps or []
        ttfts.append(((stamps[0] if stamps else time.perf_counter()) - t0) * 1000)
    return wall, ttfts, outputs


_CHILD_MODEL = None  # the peer's model, in its child process (see the module docstring)


def _child_load(model: str, device: str, dtype: str) -> None:
    global _CHILD_MODEL
    from engine.model.loader import load_model

    _CHILD_MODEL = load_model(model, device=device, dtype=dtype).model
    _CHILD_MODEL.set_attn_implementation("sdpa")


def _child_run(ids: list[list[int]], eos_ids: Collection[int], streams: int, max_new_tokens: int):
    return in_fresh_thread(run_hf, _CHILD_MODEL, ids, eos_ids, streams, max_new_tokens)


class HfPeer:
    """transformers' ``generate_batch``: in a child process (``model`` named) or in this one."""

    def __init__(self, runner: ModelRunner, model: str | None = None, device: str = "auto",
                 dtype: str = "auto") -> None:
        self._pool = self._model = None
        if model is None:
            self._model = hf_peer(runner)
        else:
            ctx = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(1, mp_context=ctx, initializer=_child_load,
                                             initargs=(model, device, dtype))

    def run(self, ids, eos_ids, streams: int, max_new_tokens: int):
        if self._pool is not None:
            return self._pool.submit(_child_run, ids, eos_ids, streams, max_new_tokens).result()
        return in_fresh_thread(run_hf, self._model, ids, eos_ids, streams, max_new_tokens)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


def default_budget(runner: ModelRunner) -> int | None:
    """512 MiB on a CPU (the engine's default elsewhere)."""
    return 512 * 2**20 if runner.device.type == "cpu" else None


MAX_BATCH = 16  # the batched engine's


def runner_cost(runner: ModelRunner) -> ModelCost:
    """The runner's model's decode cost: its loaded parameters and its KV bytes per token."""
    q_heads = int(getattr(getattr(runner.model, "config", None), "num_attention_heads", 0) or runner.num_kv_heads)
    return model_cost(runner.model, runner.kv_bytes_per_token, runner.num_layers, q_heads, runner.head_dim)


def rows_per_step(engine: str, streams: int) -> int:
    """How many streams one decode step of ``engine`` carries at ``streams`` clients."""
    return 1 if engine == "one" else min(streams, MAX_BATCH) if engine == "batched" else streams


def run_bench(runner: ModelRunner, streams: list[int], n_requests: int, max_new_tokens: int,
              engines: list[str], log=print, peer_model: str | None = None, device: str = "auto",
              dtype: str = "auto", system_tokens: int = 0, warm: bool = True,
              budget_bytes: int | None = None, max_batch: int = 16,
              limits: MachineLimits | None = None) -> list[Row]:
    """``peer_model`` names the model for a peer in a child process; None runs the peer here.
    ``system_tokens`` > 0: the long-prefix workload (see the module docstring). ``limits``: the
    machine's, measured by the caller, for each row's limit (none without them)."""
    system = policy_manual(runner.text.encode, system_tokens) if system_tokens else SYSTEM
    requests = chat_requests(n_requests, max_new_tokens, system)
    budget = default_budget(runner) if budget_bytes is None else budget_bytes
    warm_up = None
    if system_tokens and warm:  # the shared prefix cached before the clock starts, as in a running service
        warm_up = GenerationRequest(messages=({"role": "system", "content": system},
                                              {"role": "user", "content": "Hello"}),
                                    sampling=SamplingParams(max_new_tokens=1))
    alone = Engine(runner, enable_cache=False, max_batch=1)
    reference = [alone.run(r).output_ids for r in requests]
    alone.close()
    peer = HfPeer(runner, peer_model, device, dtype) if "hf" in engines else None
    ids = [runner.text.encode_chat(r.messages) for r in requests]
    cost = runner_cost(runner)
    context = int(sum(map(len, ids)) / max(1, len(ids)) + (max_new_tokens - 1) / 2)
    shared = len(os.path.commonprefix([list(x) for x in ids])) if len(ids) > 1 else 0  # the system prompt: read once
    rows = []
    try:
        for c in streams:
            for kind in engines:
                growth = device_peak = None
                if kind == "hf":
                    wall, ttfts, outs = peer.run(ids, runner.text.eos_ids, c, max_new_tokens)
                else:
                    wall, ttfts, outs, growth, device_peak = run_engine(
                        runner, requests, c, 1 if kind == "one" else max_batch, reference, budget, warm_up)
                same = sum(o == ref for o, ref in zip(outs, reference, strict=False))
                budget_mb = (budget or 0) / 2**20 if kind != "hf" else None
                limit = decode_limit(cost, rows_per_step(kind, c), context, limits, shared) if limits else 0.0
                row = Row(kind, c, len(requests), sum(len(o) for o in outs), wall, ttfts, same,
                          None if growth is None else growth / 2**20, budget_mb,
                          None if device_peak is None else device_peak / 2**20, limit)
                rows.append(row)
                log(format_row(row))
    finally:
        if peer is not None:
            peer.close()
    return rows


NAMES = {"one": "one at a time (max_batch 1)", "batched": "continuous batching", "hf": "transformers generate_batch"}


def format_row(r: Row) -> str:
    memory = "-"
    if r.rss_growth_mb is not None:
        memory = f"{r.rss_growth_mb:,.0f} MiB" + (f" ({r.rss_growth_mb / r.budget_mb:.2f}x)" if r.budget_mb else "")
    return (f"| {r.streams} | {NAMES.get(r.engine, r.engine)} | {r.tokens_per_s:.1f} | "
            f"{percentile(r.ttft_ms, 0.5):.0f} | {percentile(r.ttft_ms, 0.95):.0f} | {memory} | "
            f"{r.identical}/{r.requests} | {limit_cell(r.tokens_per_s, r.limit_tokens_per_s)} |")


def format_table(rows: list[Row], title: str) -> str:
    lines = [f"Serving benchmark: {title}", "",
             "| streams | engine | output tokens/s | TTFT p50 ms | TTFT p95 ms | peak RSS growth (x budget) "
             "| identical to solo | limit tokens/s (share) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    lines += [format_row(r) for r in rows]
    by = {(r.engine, r.streams): r for r in rows}
    c = 8 if any(r.streams == 8 for r in rows) else max(r.streams for r in rows)
    batched = by.get(("batched", c))
    if batched:
        lines.append("")
        for other in ("one", "hf"):
            if (other, c) in by and by[(other, c)].tokens_per_s > 0:
                ratio = batched.tokens_per_s / by[(other, c)].tokens_per_s
                lines.append(f"At {c} streams: continuous batching = {ratio:.2f}x {NAMES[other]} (tokens/s)")
    return "\n".join(lines)


def write_json(path: str, runner: ModelRunner, title: str, rows: list[Row]) -> None:
    """The rows as JSON (``tools/gpu_check.py`` reads them), with what the memory figures are measured against."""
    weights = sum(t.numel() * t.element_size() for t in runner.model.state_dict().values())
    out = dict(title=title, device=str(runner.device), weight_bytes=weights, kv_bytes_per_token=runner.kv_bytes_per_token,
               rows=[dict(dataclasses.asdict(r), tokens_per_s=r.tokens_per_s, ttft_p50_ms=percentile(r.ttft_ms, 0.5),
                          ttft_p95_ms=percentile(r.ttft_ms, 0.95)) for r in rows])
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def describe_cost(cost: ModelCost) -> str:
    return (f"Model: {cost.weight_bytes / 1e6:,.0f} MB of weights (parameters as loaded, a tied embedding once), "
            f"{cost.kv_bytes_per_token:,} bytes of KV per token, {cost.flops_per_token / 1e6:,.0f} MFLOP per token "
            f"+ {cost.attention_flops_per_context_token:,} FLOP per context token")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", default="1,4,8,16", help="concurrent streams, comma-separated")
    p.add_argument("--requests", type=int, default=16, help="chat requests per run (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--engines", default="one,batched,hf", help="any of one,batched,hf")
    p.add_argument("--quick", action="store_true", help="smoke run: 1,4 streams, 4 requests, 8 new tokens")
    p.add_argument("--model", default="embedded")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--system-tokens", type=int, default=0,
                   help="a system prompt of about this many tokens (a policy manual), cached before the clock starts")
    p.add_argument("--cold", action="store_true", help="with --system-tokens: start from an empty cache")
    p.add_argument("--budget-mb", type=int, default=None, help="KV budget (default 512 MiB on CPU)")
    p.add_argument("--max-batch", type=int, default=16, help="requests decoded together by the batched engine")
    p.add_argument("--json", default=None, help="also write the rows (and the model's weight bytes) to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.streams, args.requests, args.max_new_tokens = "1,4", 4, 8
    from engine.model.loader import load_model

    runner = ModelRunner(load_model(args.model, device=args.device, dtype=args.dtype))
    streams = [int(s) for s in args.streams.split(",") if s.strip()]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    title = f"{runner.name} on {runner.device} ({str(runner.dtype).replace('torch.', '')})"
    budget = None if args.budget_mb is None else args.budget_mb * 2**20
    shape = f", a {args.system_tokens:,}-token system prompt ({'cold' if args.cold else 'cached'})" \
        if args.system_tokens else ""
    limits = machine_limits()
    print(machine_header(limits))
    print(describe_cost(runner_cost(runner)))
    print(f"{title}: {args.requests} chat requests, {args.max_new_tokens} new tokens, streams {streams}{shape}",
          flush=True)
    rows = run_bench(runner, streams, args.requests, args.max_new_tokens, engines,
                     log=lambda s: print(s, flush=True), peer_model=args.model, device=args.device, dtype=args.dtype,
                     system_tokens=args.system_tokens, warm=not args.cold, budget_bytes=budget,
                     max_batch=args.max_batch, limits=limits)
    print()
    print(format_table(rows, title))
    if args.json:
        write_json(args.json, runner, title, rows)
    return 0 if all(r.identical == r.requests for r in rows if r.engine != "hf") else 1


if __name__ == "__main__":
    sys.exit(main())
