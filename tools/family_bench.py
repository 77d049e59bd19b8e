"""Speed per model family, in process, behind a shared prefix (issue 59): one table, a row a family.

    python -m tools.family_bench                          # every family of the registry, the embedded shape
    python -m tools.family_bench --families llama,gemma3 --layers 8 --dtype bfloat16
    python -m tools.family_bench --layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 128 \\
        --system-tokens 64 --max-new-tokens 4 --streams 2 --families llama,gemma2   # a smoke run (seconds)

Each family of ``engine.model.families`` (or those ``--families`` names, by ``model_type``) is built
with random weights, seeded, from transformers' own config class at one common shape (default the
embedded model's: hidden 576, 30 layers, 9 heads, 3 KV heads, intermediate 1536, head 64; tied
embeddings on the embedded tokenizer's 49,152 tokens: nothing is downloaded) with the family's own
extras at their defaults: q/k norms, soft-caps, its pattern of sliding layers, the window cut to
``--window`` tokens (less than the prompt, so it bites). Then, through ``ModelRunner`` and ``Engine``:

- its plan (``ExecutionPlan.summary``): every family of the registry should say ``layers=exact``;
- one chat request behind the cached system prompt (a policy manual of about ``--system-tokens``,
  ``tools.serve_bench.policy_manual``), prefilled with reuse and without, back to back, on the
  engine's scratch pool (``analysis.prefill_timing.timer_for``, one pair; its no-reuse side is
  ``analysis.no_reuse.no_reuse_prefill``), and whether both sides' last logits are equal bit for bit;
- output tokens/s of chat requests (``--max-new-tokens``, greedy, past EOS) through closed-loop
  streams (``tools.serve_bench.run_engine``, the prefix cached first): ``--alone`` requests on one
  stream, then ``--streams`` requests on as many streams, and whether the requests run both ways
  gave the same tokens.

Random weights time the same work as trained ones of their shape; their answers are noise. Each
family's model is dropped before the next is built. Exit status 1 where a plan is not exact or a
batched answer differs from its lone run.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from dataclasses import dataclass

import torch

from engine.engine import Engine
from engine.model import families
from engine.model.compute_thread import in_fresh_thread
from engine.model.runner import ModelRunner
from engine.types import GenerationRequest, SamplingParams
from tools.gpu_check import SHAPES
from tools.measure import machine_header, offline_env
from tools.serve_bench import chat_requests, default_budget, policy_manual, run_engine

EMBEDDED = SHAPES["embedded"]


@dataclass(frozen=True)
class Shape:
    """The one shape every family is built at."""

    hidden: int = EMBEDDED["hidden_size"]
    layers: int = EMBEDDED["num_hidden_layers"]
    heads: int = EMBEDDED["num_attention_heads"]
    kv_heads: int = EMBEDDED["num_key_value_heads"]
    intermediate: int = EMBEDDED["intermediate_size"]

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def describe(self) -> str:
        return (f"hidden {self.hidden}, {self.layers} layers, {self.heads} heads, {self.kv_heads} KV heads, "
                f"head {self.head_dim}, intermediate {self.intermediate}")


@dataclass(frozen=True)
class FamilyRow:
    family: str  # the recipe's name
    plan: str  # ExecutionPlan.summary()
    window: str  # "256 on 15/30 layers", or "-"
    reuse_ms: float | None
    full_ms: float | None
    reuse_identical: bool | None  # both prefill sides' last logits equal bit for bit
    alone_tokens_per_s: float
    streams_tokens_per_s: float
    same_answers: str  # "2/2": requests whose batched answer equals their lone one

    @property
    def exact(self) -> bool:
        return self.plan.startswith("layers=exact ")


def build_family(model_type: str, shape: Shape, tokenizer, window: int, dtype: torch.dtype, seed: int = 0):
    """A random-weight ``model_type`` causal LM of ``shape`` on ``tokenizer``'s vocabulary, with the
    family's own defaults (window cut to ``window`` where its recipe has one), in eval mode; and its
    windows in words. On a thread that then exits (no OpenMP pool left on the caller's)."""
    import transformers as tf

    from engine.model.decoder_parts import DecoderParts

    recipe = families.REGISTRY[model_type]
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    kw = dict(vocab_size=len(tokenizer), hidden_size=shape.hidden, intermediate_size=shape.intermediate,
              num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
              head_dim=shape.head_dim, max_position_embeddings=8192, tie_word_embeddings=True,
              bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=eos)
    if recipe.sliding_window:
        kw["sliding_window"] = window  # kept only where the family's config uses a window (Qwen's do not)

    def build():
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(recipe.model_types[0], **kw))
        model = model.to(dtype).eval()
        parts = DecoderParts.of(model)
        windows = [] if isinstance(parts, str) else [p.window for p in parts.layers if p.window]
        return model, (f"{windows[0]} on {len(windows)}/{shape.layers} layers" if windows else "-")

    return in_fresh_thread(build)


def _timed_prefill(engine: Engine, request: GenerationRequest):
    """One pair of prefills of ``request`` behind its cached prefix: with reuse and without."""
    from analysis.prefill_timing import timer_for

    ids = engine.runner.text.encode_chat(request.messages)
    key = engine.cache_key(ids, request)
    return timer_for(engine).time_pairs(key, engine.matched_len(key), pairs=1)


def bench_family(model_type: str, shape: Shape, tokenizer, args, log=lambda s: print(s, flush=True)) -> FamilyRow:
    """One family's row (module docstring); its model and engines are let go before it returns."""
    from engine.model.loader import LoadedModel

    dtype = getattr(torch, args.dtype)
    model, window = build_family(model_type, shape, tokenizer, args.window, dtype)
    runner = ModelRunner(LoadedModel(model, tokenizer, f"random-{model_type}", torch.device("cpu"), dtype))
    name = families.REGISTRY[model_type].name
    try:
        log(f"{name}: plan {runner.plan.summary()}, windows {window}")
        system = policy_manual(runner.text.encode, args.system_tokens)
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
        requests = [dataclasses.replace(r, sampling=sampling)
                    for r in chat_requests(max(args.streams, args.alone), args.max_new_tokens, system)]
        warm = GenerationRequest(messages=({"role": "system", "content": system}, {"role": "user", "content": "Hello"}),
                                 sampling=SamplingParams(max_new_tokens=1))
        budget = default_budget(runner)
        engine = Engine(runner, budget_bytes=budget)
        try:
            engine.run(warm)
            timing = _timed_prefill(engine, requests[0])
        finally:
            engine.close()
        alone = requests[: args.alone]
        wall1, _, outs1, _, _ = run_engine(runner, alone, 1, 1, [], budget, warm)
        together = requests[: args.streams]
        wall_n, _, outs_n, _, _ = run_engine(runner, together, args.streams, 16, [], budget, warm)
        same = sum(a == b for a, b in zip(outs1, outs_n, strict=False))
        return FamilyRow(name, runner.plan.summary(), window, timing.reuse_ms, timing.full_ms,
                         None if timing.logits is None else timing.logits.identical,
                         sum(map(len, outs1)) / wall1, sum(map(len, outs_n)) / wall_n,
                         f"{same}/{min(len(outs1), len(outs_n))}")
    finally:
        runner.close()
        del model, runner
        gc.collect()


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def format_table(rows: list[FamilyRow], title: str, streams: int) -> str:
    lines = [title, "",
             "| family | plan | sliding window | prefill ms, reuse / none (x) | reuse logits bit-equal "
             f"| tokens/s, 1 stream | tokens/s, {streams} streams | batched = alone |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        speedup = f" ({r.full_ms / r.reuse_ms:.1f}x)" if r.reuse_ms and r.full_ms else ""
        equal = "-" if r.reuse_identical is None else ("yes" if r.reuse_identical else "NO")
        lines.append(f"| {r.family} | {r.plan} | {r.window} | {_ms(r.reuse_ms)} / {_ms(r.full_ms)}{speedup} | "
                     f"{equal} | {r.alone_tokens_per_s:.1f} | {r.streams_tokens_per_s:.1f} | {r.same_answers} |")
    return "\n".join(lines)


def family_types(names: str) -> list[str]:
    """``--families``: model types of the registry (default: each family's first), in registry order."""
    if not names.strip():
        return [r.model_types[0] for r in families.FAMILIES]
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in families.REGISTRY]
    if unknown:
        raise SystemExit(f"error: {', '.join(unknown)} not in the registry (model types: "
                         f"{', '.join(sorted(families.REGISTRY))})")
    return [families.REGISTRY[n].model_types[0] for n in wanted]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default="", help="model types, comma-separated (default: the whole registry)")
    p.add_argument("--layers", type=int, default=Shape.layers)
    p.add_argument("--hidden", type=int, default=Shape.hidden)
    p.add_argument("--heads", type=int, default=Shape.heads)
    p.add_argument("--kv-heads", type=int, default=Shape.kv_heads)
    p.add_argument("--intermediate", type=int, default=Shape.intermediate)
    p.add_argument("--window", type=int, default=256, help="the sliding window of the families with one (tokens)")
    p.add_argument("--system-tokens", type=int, default=1000, help="the shared system prompt, cached first")
    p.add_argument("--streams", type=int, default=8, help="concurrent streams (and requests) of the batched run")
    p.add_argument("--alone", type=int, default=2, help="requests run one after another on one stream")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = p.parse_args(argv)
    offline_env()
    from engine.model.loader import load_tokenizer

    types = family_types(args.families)
    shape = Shape(args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate)
    tokenizer = load_tokenizer()
    title = (f"Family bench: random weights at one shape ({shape.describe()}; tied embeddings, vocabulary "
             f"{len(tokenizer):,}), {args.dtype} on cpu; a ~{args.system_tokens:,}-token system prompt cached, "
             f"{args.max_new_tokens} new tokens a request, {args.alone} requests on 1 stream, {args.streams} on "
             f"{args.streams}; sliding windows of {args.window} tokens")
    print(machine_header())
    print(title, flush=True)
    t0 = time.perf_counter()
    rows = [bench_family(t, shape, tokenizer, args) for t in types]
    print()
    print(format_table(rows, title, args.streams))
    print(f"\n{len(rows)} families in {time.perf_counter() - t0:,.0f} s")
    bad = [r.family for r in rows if not r.exact or r.same_answers.split("/")[0] != r.same_answers.split("/")[1]]
    if bad:
        print(f"\nnot exact, or a batched answer differs from its lone run: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
