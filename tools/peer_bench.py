"""Peer benchmark: any OpenAI-compatible server, as a user drives it, beside vLLM.

    python -m tools.peer_bench --url http://127.0.0.1:8000            # a server that is already up
    python -m tools.peer_bench --ours --vllm --dtype bfloat16         # start both, one at a time
    python -m tools.peer_bench --ours --vllm --system-tokens 6000 --streams 16
    python -m tools.peer_bench --ours --ours-fast --vllm --dtype float32  # the exact forward's cost (issue 44)

The workload is ``tools.serve_bench``'s long-prefix one, sent over HTTP: every request is
a chat turn with the same policy-manual system prompt of about ``--system-tokens`` tokens
(``serve_bench.policy_manual``) and its own question (``serve_bench.chat_requests``),
``--max-tokens`` new tokens (exactly that many: ``ignore_eos``, which vLLM's own serving benchmark
sends too, so that servers whose answers end at different places still do the same work;
``--stop-at-eos`` lets answers end), temperature 0, streamed over ``/v1/chat/completions`` with
``stream_options.include_usage``. For each number of streams ``c``, ``c`` client threads
take the ``--requests`` requests one after another (a closed loop). One request with the
system prompt is sent first, off the clock, so the prefix is cached on every server, as
in a running service.

Printed per server and stream count: output tokens/s (the servers' ``completion_tokens``
over the wall clock, all streams together), time to first token p50/p95 (from sending
to the first chunk with text), the decode rate a stream sees once its answer has started
(the tokens after the first over the time from the first text to the last) and the cached
prompt tokens per request (``usage.prompt_tokens_details.cached_tokens``). With two servers,
their ratio.

Servers started here are also held against the memory-bandwidth ceiling: one stream's decode
step reads every weight and the context's KV, so a plain read's speed, measured in the same run,
bounds its decode rate (printed as a share of that bound, and the wall-time rate beside it,
whose first token is a prefill the ceiling does not bound). With the FMA rate measured too
(``tools.measure.machine_limits``, as ``main`` does), every row of such a server gets its step's
limit: the longer of the bytes a step of that many streams reads at the read bandwidth and its
FLOPs at the FMA rate, as a tokens/s ceiling, and the row's share of it. The CPU, its ISA flags
and ``RADIX_ISA`` come first.

``--ours`` starts this app (``python app.py`` on a free port, ``--dtype``, no second
tier, and waits for its start-up growth-curve measurement to finish so it does not run
during the benchmark); ``--vllm`` starts vLLM from the virtual environment
``$RADIX_VLLM_VENV`` (default ``.venv-vllm``, made by ``tools/install_vllm.sh``) on the
app's converted model folder with the flags that work on a CPU (``--block-size 32``,
``--enforce-eager``, prefix caching, both cores). One server runs at a time; each is
stopped (its whole process group) before the next starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tools.measure import (
    DTYPE_BYTES,
    ModelCost,
    bytes_per_token,
    decode_limit,
    machine_header,
    machine_limits,
    percentile,
    read_bandwidth,
    run_clients,
)
from tools.serve_bench import SYSTEM, chat_requests, policy_manual

REPO = Path(__file__).resolve().parent.parent
VLLM_MODEL_NAME = "SmolLM2-135M-Instruct"
GRADIO_CHECK = "When localhost is not accessible"  # gradio's launch() gave up on its own page
FAST_SUFFIX = " fast"  # this app with RADIX_EXACT=0 (--ours-fast): its fast paths, bits by batch (issue 44)


# ------------------------------------------------------------------ results
@dataclass(frozen=True)
class Result:
    """One request as the client saw it."""

    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    text: str
    last_s: float = 0.0  # when the last text came (from the request's start); 0 where unknown

    @property
    def decode_s(self) -> float:
        """From the first text to the last: the decode steps after the first token."""
        return max(0.0, self.last_s - self.ttft_s)


@dataclass(frozen=True)
class Row:
    server: str
    streams: int
    results: tuple[Result, ...]
    wall_s: float
    system_tokens: int = 0  # the workload's system prompt length (its label in the table)
    bandwidth: tuple[float, ...] = ()  # a plain read's bytes/s just before and after this row (one stream)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.results)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def ttft_ms(self, q: float) -> float:
        return percentile([r.ttft_s * 1000 for r in self.results], q)

    @property
    def decode_tokens_per_s(self) -> float:
        """One stream's decode rate: the tokens after each request's first, over the time from its
        first text to its last (what a reader sees once the answer starts; a step of one stream
        reads every weight, so this is the figure the memory-bandwidth ceiling bounds)."""
        timed = [r for r in self.results if r.output_tokens > 1 and r.decode_s > 0]
        spent = sum(r.decode_s for r in timed)
        return sum(r.output_tokens - 1 for r in timed) / spent if spent > 0 else 0.0

    @property
    def cached_per_request(self) -> float:
        return sum(r.cached_tokens for r in self.results) / max(1, len(self.results))

    @property
    def prompt_per_request(self) -> float:
        return sum(r.prompt_tokens for r in self.results) / max(1, len(self.results))


def parse_sse(lines: Iterator[str], t0: float) -> Result:
    """The stream of one chat completion: its text, first-text time and final usage."""
    text, first, last, usage = [], None, None, None
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        body = json.loads(data)
        if "error" in body:
            raise RuntimeError(f"the server reported an error: {body['error']}")
        for choice in body.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                last = time.perf_counter()
                if first is None:
                    first = last
                text.append(piece)
        if body.get("usage"):
            usage = body["usage"]
    if usage is None:
        raise RuntimeError("the stream ended without usage (stream_options.include_usage)")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    end = time.perf_counter()
    return Result(int(usage["completion_tokens"]), int(usage["prompt_tokens"]), int(cached),
                  (first or end) - t0, "".join(text), (last or end) - t0)


def chat_once(client: httpx.Client, url: str, model: str, messages: Sequence[dict], max_tokens: int,
              ignore_eos: bool = False) -> Result:
    body = {"model": model, "messages": list(messages), "max_tokens": max_tokens, "temperature": 0,
            **({"ignore_eos": True} if ignore_eos else {}),
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    with client.stream("POST", url.rstrip("/") + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
        return parse_sse(resp.iter_lines(), t0)


def run_streams(url: str, model: str, conversations: Sequence[Sequence[dict]], streams: int, max_tokens: int,
                server: str = "", system_tokens: int = 0, ignore_eos: bool = False) -> Row:
    """``streams`` closed-loop clients over ``conversations``; one ``Row``."""
    results: list[Result | None] = [None] * len(conversations)
    errors: list[BaseException] = []
    nxt = iter(range(len(conversations)))
    lock = threading.Lock()

    def client(http: httpx.Client) -> None:
        with http:
            while True:
                with lock:
                    i = next(nxt, None)
                if i is None or errors:
                    return
                try:
                    results[i] = chat_once(http, url, model, conversations[i], max_tokens, ignore_eos)
                except BaseException as exc:  # reported once, after the others stop
                    errors.append(exc)
                    return

    wall = run_clients(client, streams, daemon=True, prepare=lambda: httpx.Client(timeout=httpx.Timeout(600.0)))
    if errors:
        raise errors[0]
    return Row(server, streams, tuple(r for r in results if r is not None), wall, system_tokens)


def served_model(url: str) -> str:
    resp = httpx.get(url.rstrip("/") + "/v1/models", timeout=30)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def bench_server(url: str, server: str, conversations: Sequence[Sequence[dict]], streams: Sequence[int],
                 max_tokens: int, log=print, system_tokens: int = 0, ignore_eos: bool = False,
                 bracket: bool = False) -> list[Row]:
    """The warm-up request (off the clock), then one row per stream count; with ``bracket`` (a
    server started on this machine), a one-stream row between two plain reads of memory, so that
    its ceiling is measured in the same minute as it (this VM's bandwidth drifts by a third)."""
    model = served_model(url)
    with httpx.Client(timeout=httpx.Timeout(600.0)) as http:
        warm = [conversations[0][0], {"role": "user", "content": "Hello"}]
        chat_once(http, url, model, warm, 1)
    rows = []
    for c in streams:
        before = read_bandwidth() if bracket and c == 1 else None
        row = run_streams(url, model, conversations, c, max_tokens, server, system_tokens, ignore_eos)
        if before is not None:
            row = dataclasses.replace(row, bandwidth=(before, read_bandwidth()))
        rows.append(row)
        log(format_row(row))
    return rows


def bench_workloads(url: str, server: str, workloads: Sequence[tuple[int, Sequence[int], Sequence]], max_tokens: int,
                    log=print, ignore_eos: bool = False, bracket: bool = False) -> list[Row]:
    """``bench_server`` for each (system tokens, streams, conversations) workload, on one server start."""
    rows = []
    for system_tokens, streams, conversations in workloads:
        rows += bench_server(url, server, conversations, streams, max_tokens, log, system_tokens, ignore_eos,
                             bracket)
    return rows


# ------------------------------------------------------------------ servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ours_command(port: int, dtype: str) -> list[str]:
    return [sys.executable, str(REPO / "app.py"), "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--disk-cache-mb", "0"]


def vllm_command(venv: Path, port: int, dtype: str) -> list[str]:
    from engine.model.loader import converted_cache_dir

    return [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(converted_cache_dir()), "--served-model-name", VLLM_MODEL_NAME,
            "--host", "127.0.0.1", "--port", str(port), "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--max-model-len", "8192", "--dtype", dtype, "--block-size", "32", "--enforce-eager"]


def vllm_env(cache_dir: str) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
            "VLLM_CACHE_ROOT": cache_dir, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


@contextmanager
def started(name: str, cmd: list[str], env: dict[str, str], port: int, ready_line: str | None = None,
            timeout_s: float = 600.0) -> Iterator[str]:
    """Run ``cmd`` in a process group of its own until the block ends; yields its URL once
    ``/v1/models`` answers (and ``ready_line`` appeared in its output, if given)."""
    url = f"http://127.0.0.1:{port}"
    log_file = tempfile.NamedTemporaryFile("a+", prefix=f"peer-bench-{name}-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                            start_new_session=True)
    t0 = time.perf_counter()
    retries = 2
    try:
        up = False
        while time.perf_counter() - t0 < timeout_s:
            if proc.poll() is not None:
                if retries > 0 and GRADIO_CHECK in Path(log_file.name).read_text():
                    # Gradio's start-up check of its own page timed out (3 s) on a loaded machine: again.
                    retries -= 1
                    print(f"{name}: Gradio's start-up check timed out; starting it again", flush=True)
                    log_file.truncate(0)
                    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                            start_new_session=True)
                    continue
                raise RuntimeError(f"{name} exited with {proc.returncode}; log: {log_file.name}\n"
                                   + Path(log_file.name).read_text()[-3000:])
            if not up:
                try:
                    up = httpx.get(url + "/v1/models", timeout=5).status_code == 200
                except httpx.HTTPError:
                    pass
            if up and (ready_line is None or ready_line in Path(log_file.name).read_text()):
                break
            time.sleep(1.0)
        else:
            raise RuntimeError(f"{name} not ready after {timeout_s:.0f} s; log: {log_file.name}")
        print(f"{name} ready in {time.perf_counter() - t0:.0f} s at {url} (log {log_file.name})", flush=True)
        yield url
    finally:
        stop_group(proc)
        log_file.close()


def stop_group(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM to the process group we started, then SIGKILL if it lingers."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
    try:  # children that outlived the leader (vLLM's engine core)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ------------------------------------------------------------------ report
def folder_cost(folder: Path, dtype: str) -> ModelCost:
    """A model folder's decode cost (``ModelCost``) in ``dtype``: its stored tensors (a tied
    embedding is stored once; every parameter a token multiplies by, the embedding as the head) and
    its config's KV and attention sizes."""
    weights, kv = bytes_per_token(folder, dtype, 1)
    cfg = json.loads((Path(folder) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    params = weights // DTYPE_BYTES[dtype]
    return ModelCost(weights, kv, 2 * params, 4 * cfg["num_hidden_layers"] * heads * head_dim)


def limit_lines(rows: list[Row], dtype: str, bandwidth: float, flops_per_s: float, max_tokens: int,
                folder: Path) -> list[str]:
    """Every row of a server started here against its step's limit (``tools.measure.decode_limit``:
    ``streams`` rows a step, each over the mean prompt plus half the answer)."""
    from tools.measure import MachineLimits

    cost, limits = folder_cost(folder, dtype), MachineLimits(bandwidth, flops_per_s)
    lines = ["", f"Each step's limit ({limits.describe().replace('best of 3', 'best of 3, mean of the run')}; "
                 f"{cost.weight_bytes / 1e6:,.0f} MB of weights, {cost.kv_bytes_per_token:,} bytes of KV per token):"]
    for r in rows:
        if not r.results or dtype not in r.server:
            continue
        context = int(r.prompt_per_request + (max_tokens - 1) / 2)
        limit = decode_limit(cost, r.streams, context, limits, r.system_tokens)  # the system prompt's KV once
        lines.append(f"- {r.server}, {r.streams} stream(s), {r.system_tokens:,} system tokens: {r.tokens_per_s:.1f} "
                     f"tokens/s = {r.tokens_per_s / limit:.0%} of the limit {limit:.1f} at {context:,} tokens of "
                     "context")
    return lines


def ceiling_lines(rows: list[Row], dtype: str, bandwidth: Sequence[float], max_tokens: int,
                  folder: Path | None = None) -> list[str]:
    """Each one-stream row of a server started here against the memory-bandwidth ceiling: one
    decode step must read every weight and the context's KV (``tools.measure.bytes_per_token``),
    so one stream cannot outrun ``bandwidth / bytes``; the bandwidth is a plain read measured
    just before and after the row where it was (``Row.bandwidth``, their mean), else in this run
    (before and after the servers, their mean)."""
    if folder is None:
        from engine.model.hub import converted_cache_dir

        folder = converted_cache_dir()
    bw = sum(bandwidth) / len(bandwidth)
    lines = ["", f"Memory-bandwidth ceiling: a plain read here ran at "
                 f"{' and '.join(f'{b / 1e9:.1f}' for b in bandwidth)} GB/s (before and after the servers)."]
    for r in rows:
        if r.streams != 1 or not r.results or dtype not in r.server:
            continue
        context = int(r.prompt_per_request + (max_tokens - 1) / 2)
        weights, kv = bytes_per_token(folder, dtype, context)
        own = sum(r.bandwidth) / len(r.bandwidth) if r.bandwidth else bw
        ceiling = own / (weights + kv)
        read = (f"; the read ran at {' and '.join(f'{b / 1e9:.1f}' for b in r.bandwidth)} GB/s just before and "
                f"after this row") if r.bandwidth else ""
        decode = r.decode_tokens_per_s
        lines.append(f"- {r.server}, one stream, {r.system_tokens:,} system tokens: decoding at {decode:.1f} tokens/s "
                     f"= {decode / ceiling:.0%} of {ceiling:.1f} ({weights / 1e6:,.0f} MB of weights and "
                     f"{kv / 1e6:,.0f} MB of KV at {context:,} tokens per step{read}); {r.tokens_per_s:.1f} "
                     f"tokens/s in wall time, the first token's prefill included ({r.tokens_per_s / ceiling:.0%})")
    return lines


def format_row(r: Row) -> str:
    return (f"| {r.server} | {r.system_tokens:,} | {r.streams} | {r.tokens_per_s:.1f} | {r.output_tokens:,} in "
            f"{r.wall_s:.2f} s | {r.ttft_ms(0.5):.0f} | {r.ttft_ms(0.95):.0f} | {r.decode_tokens_per_s:.1f} | "
            f"{r.cached_per_request:,.0f} / {r.prompt_per_request:,.0f} |")


def format_table(rows: list[Row], title: str) -> str:
    lines = [title, "", "| server | system tokens | streams | output tokens/s | output tokens in wall time "
                        "| TTFT p50 ms | TTFT p95 ms | decode tokens/s a stream | cached / prompt tokens |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [format_row(r) for r in rows]
    servers = list(dict.fromkeys(r.server for r in rows))
    pairs = ratio_pairs(servers)
    if pairs:
        by = {(r.server, r.system_tokens, r.streams): r for r in rows}
        lines += ["", "| system tokens | streams | " + " | ".join(f"{a} / {b} (tokens/s)" for a, b in pairs) + " |",
                  "|---:|---:|" + "---:|" * len(pairs)]
        for t, c in dict.fromkeys((r.system_tokens, r.streams) for r in rows):
            cells = []
            for a, b in pairs:
                ok = (a, t, c) in by and (b, t, c) in by and by[(b, t, c)].tokens_per_s > 0
                cells.append(f"{by[(a, t, c)].tokens_per_s / by[(b, t, c)].tokens_per_s:.2f}x" if ok else "-")
            lines.append(f"| {t:,} | {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_pairs(servers: Sequence[str]) -> list[tuple[str, str]]:
    """The ratios the table ends with: each server against the last one named (vLLM, when it runs), and
    this app's exact forward against its fast paths (``--ours-fast``) where both ran."""
    if len(servers) < 2:
        return []
    pairs = [(a, servers[-1]) for a in servers[:-1]]
    fast = [s for s in servers if s.endswith(FAST_SUFFIX)]
    for f in fast:
        exact = f.removesuffix(FAST_SUFFIX)
        if exact in servers and (exact, f) not in pairs:
            pairs.append((exact, f))
    return pairs


def conversations_for(system_tokens: int, n_requests: int, max_tokens: int) -> list[tuple[dict, ...]]:
    """The workload's chat turns (the same ones ``tools.serve_bench`` runs in process)."""
    system = SYSTEM
    if system_tokens:
        from engine.model.loader import load_tokenizer

        tok = load_tokenizer()
        system = policy_manual(lambda text: tok.encode(text, add_special_tokens=False), system_tokens)
    return [r.messages for r in chat_requests(n_requests, max_tokens, system)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", action="append", default=[], help="a running server (repeatable); its name is the URL")
    p.add_argument("--ours", action="store_true", help="start this app (python app.py) and measure it")
    p.add_argument("--ours-fast", action="store_true",
                   help="also start this app with RADIX_EXACT=0 (its fast paths, whose bits depend on the batch) "
                        "and measure it beside the exact default")
    p.add_argument("--vllm", action="store_true", help="start vLLM from $RADIX_VLLM_VENV and measure it")
    p.add_argument("--dtype", default="bfloat16", help="float32 or bfloat16, for the servers started here")
    p.add_argument("--streams", default="1,8,16", help="concurrent streams, comma-separated")
    p.add_argument("--requests", type=int, default=16, help="chat requests per stream count (default 16)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--stop-at-eos", action="store_true",
                   help="let answers end at the end-of-sequence token (default: every request generates exactly "
                        "--max-tokens, with vLLM's ignore_eos, so that every server does the same work)")
    p.add_argument("--system-tokens", type=int, default=2300, help="system prompt length (0: the short one)")
    p.add_argument("--also", action="append", default=[], metavar="TOKENS:STREAMS",
                   help="another workload on the same server start, e.g. 6000:16 (repeatable)")
    p.add_argument("--vllm-venv", default=os.environ.get("RADIX_VLLM_VENV", str(REPO / ".venv-vllm")))
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a started server may take")
    args = p.parse_args(argv)
    def stream_list(text: str) -> list[int]:
        try:
            streams = [int(s) for s in text.split(",") if s.strip()]
        except ValueError:
            streams = []
        if not streams or min(streams) < 1:
            p.error(f"streams must be whole numbers >= 1, got {text!r}")
        return streams

    args.streams = stream_list(args.streams)
    also = []
    for spec in args.also:
        tokens, _, streams = spec.partition(":")
        if not tokens.strip().isdigit():
            p.error(f"--also takes TOKENS:STREAMS, e.g. 6000:16; got {spec!r}")
        also.append((int(tokens), stream_list(streams or ",".join(map(str, args.streams)))))
    args.also = also
    if args.requests < 1 or args.max_tokens < 1:
        p.error("--requests and --max-tokens must be at least 1")
    if not (args.url or args.ours or args.ours_fast or args.vllm):
        p.error("name a server: --url URL, --ours, --ours-fast and/or --vllm")
    if args.vllm and not (Path(args.vllm_venv) / "bin" / "python").exists():
        p.error(f"no vLLM venv at {args.vllm_venv}: run tools/install_vllm.sh or set RADIX_VLLM_VENV")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workloads = [(t, st, conversations_for(t, args.requests, args.max_tokens))
                 for t, st in [(args.system_tokens, args.streams), *args.also]]
    ignore_eos = not args.stop_at_eos
    title = (f"Peer benchmark: {args.requests} chat requests behind a shared system prompt, "
             f"{'up to ' if args.stop_at_eos else ''}{args.max_tokens} new tokens"
             f"{'' if args.stop_at_eos else ' each (ignore_eos)'}, streamed; workloads (system tokens: streams) "
             + ", ".join(f"{t:,}: {','.join(map(str, st))}" for t, st, _ in workloads))
    print(title, flush=True)
    log = lambda s: print(s, flush=True)  # noqa: E731
    rows: list[Row] = []
    limits = machine_limits() if args.ours or args.ours_fast or args.vllm else None
    print(machine_header(limits), flush=True)
    bandwidth = [limits.read_bytes_per_s] if limits else []
    flops = [limits.flops_per_s] if limits else []
    for url in args.url:
        rows += bench_workloads(url, url, workloads, args.max_tokens, log, ignore_eos)
    variants = ([(f"ours {args.dtype}", {})] if args.ours else []) + (
        [(f"ours {args.dtype}{FAST_SUFFIX}", {"RADIX_EXACT": "0"})] if args.ours_fast else [])
    for name, extra in variants:
        port = free_port()
        env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", **extra}
        with started("ours", ours_command(port, args.dtype), env, port, "Growth curve", args.start_timeout) as url:
            rows += bench_workloads(url, name, workloads, args.max_tokens, log, ignore_eos, True)
    if args.vllm:
        port = free_port()
        with tempfile.TemporaryDirectory(prefix="peer-bench-vllm-") as cache, \
                started("vllm", vllm_command(Path(args.vllm_venv), port, args.dtype), vllm_env(cache), port, None,
                        args.start_timeout) as url:
            rows += bench_workloads(url, f"vLLM {args.dtype}", workloads, args.max_tokens, log, ignore_eos, True)
    print()
    print(format_table(rows, title))
    if bandwidth:
        after = machine_limits()  # the same measures as before the servers
        bandwidth.append(after.read_bytes_per_s)
        flops.append(after.flops_per_s)
        print("\n".join(ceiling_lines(rows, args.dtype, bandwidth, args.max_tokens)))
        from engine.model.hub import converted_cache_dir

        print("\n".join(limit_lines(rows, args.dtype, sum(bandwidth) / len(bandwidth), sum(flops) / len(flops),
                                    args.max_tokens, converted_cache_dir())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
