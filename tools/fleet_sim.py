"""The fleet simulator's command line: routing policies over fleets of replicas, by simulation.

Usage: python -m tools.fleet_sim [--replicas 8,16,32,64] [--requests 100000] [--policies all]
       [--budget-tokens 250000] [--block-tokens 16] [--seed 0] [--rate 100]
       python -m tools.fleet_sim --trace builtin [--replicas 3] [--budget-mb 64]
       python -m tools.fleet_sim --trace LOG.jsonl --replicas 4,8 [--block-tokens 16]

``--trace synthetic`` (default): a GENERATED chat workload (``analysis.replay.fleet_trace``) of
``--requests`` requests, routed over each fleet size under each policy; one table row per (size,
policy): hit rate, the run's ceiling (most any replica held), duplication, imbalance, seconds; and
per size a reference row, one cache with the whole fleet's memory (``--no-pooled``: without it).

``--trace builtin``: the trace the real routing lab sends (``tools/fleet/trace.py``: the same
system prompts, users, turns and seeded order), rendered with the embedded SmolLM2 tokenizer and
chat template (offline), each answer a fixed 16-token stand-in (the real answers are the model's),
routed token by token (``--block-tokens 1``, as our replicas' tree) over 3 replicas whose budget is
``--budget-mb`` over the model's KV bytes per token; printed beside the real lab's measured figures.

``--trace PATH``: a replay log (any format ``analysis.replay.log_formats`` reads), tokenized with
the embedded tokenizer. Nothing here runs a model or a router: see ``tools.routing_lab`` for that.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from analysis.replay.fleet_policies import POLICIES
from analysis.replay.fleet_sim import FleetRun, LoadModel, SimRequest, simulate_fleet
from analysis.replay.fleet_trace import ChatWorkload, chat_workload, requests_from_ids, requests_from_log

# The real routing lab's figures: docs/FLEET.md, "What was measured" (python -m tools.routing_lab, the
# embedded model, 3 replicas, --budget-mb 64, 8 users x 3 turns, 4 at a time, 16 new tokens, vllm-router
# 0.1.17). Cached share of prompt tokens, requests per replica.
REAL_LAB = {
    "round_robin": (0.617, (8, 8, 8)),
    "consistent_hash": (0.871, (0, 0, 24)),
    "power_of_two": (0.626, (9, 8, 7)),
    "cache_aware": (0.870, (9, 9, 6)),
    "kv_aware": (0.791, (10, 3, 11)),
}
STAND_IN_ANSWER = "The desk will be glad to help you with that; please ask there when you arrive."
ANSWER_TOKENS = 16  # the lab's --max-tokens
POOLED = "(one pooled cache)"


def table(runs: list[FleetRun]) -> str:
    lines = ["| replicas | policy | hit rate | ceiling | duplication | shared blocks | imbalance | seconds |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        if r.per_replica is None:  # a reference row: one cache, nothing to route, copy or balance
            lines.append(f"| {r.replicas} | {r.policy} | {r.hit_rate:.1%} | - | - | - | - | {r.seconds:.1f} |")
            continue
        d = r.duplication
        shared = d.shared_blocks / d.distinct_blocks if d.distinct_blocks else 0.0
        lines.append(f"| {r.replicas} | {r.policy} | {r.hit_rate:.1%} | {r.ceiling_rate:.1%} | {d.share:.1%} | "
                     f"{shared:.1%} | {r.imbalance:.2f} | {r.seconds:.1f} |")
    return "\n".join(lines)


def builtin_requests(users: int = 8, turns: int = 3, seed: int = 0, concurrency: int = 4, model: str | None = None,
                     max_tokens: int = ANSWER_TOKENS) -> list[SimRequest]:
    """The routing lab's trace as token ids (token-level blocks), with ``model``'s tokenizer and
    chat template (None: the embedded model's). Each answer is ``STAND_IN_ANSWER`` cut to
    ``max_tokens``. Arrival: rounds a minute apart, within a round ``concurrency`` users at a time,
    a second apart (the lab waits for each round's answers)."""
    from engine.model.hub import load_tokenizer
    from engine.text.codec import TextCodec
    from tools.fleet.trace import SYSTEM_PROMPTS, built_in_trace

    codec = TextCodec(load_tokenizer(model) if model else load_tokenizer())
    history: dict[int, list[dict]] = {}
    items = []
    for r, round_ in enumerate(built_in_trace(users, turns, seed=seed)):
        for i, turn in enumerate(round_):
            messages = history.setdefault(turn.user, [{"role": "system", "content": SYSTEM_PROMPTS[turn.system]}])
            messages.append({"role": "user", "content": turn.question})
            prompt = codec.encode(codec.render_chat(messages))
            messages.append({"role": "assistant", "content": STAND_IN_ANSWER})
            after = codec.encode(codec.render_chat(messages, add_generation_prompt=False))
            answer = after[len(prompt):len(prompt) + max_tokens]
            items.append((prompt, answer, f"user-{turn.user}", r * 60.0 + (i // max(1, concurrency)) * 1.0))
    return requests_from_ids(items, block_tokens=1)


def predict_builtin(policies: list[str], replicas: int = 3, budget_mb: float = 64.0, users: int = 8, turns: int = 3,
                    seed: int = 0, concurrency: int = 4, model: str | None = None,
                    max_tokens: int = ANSWER_TOKENS) -> tuple[dict[str, FleetRun], str]:
    """What the simulator predicts for the routing lab's trace and fleet: one run per policy, and a
    line saying what was simulated."""
    from analysis.replay.simulate import model_geometry

    geometry = model_geometry(model or "embedded")
    budget_tokens = int(budget_mb * 2**20) // geometry.kv_bytes_per_token
    requests = builtin_requests(users, turns, seed, concurrency, model, max_tokens)
    load = LoadModel(prefill_tokens_per_s=2_000.0, decode_tokens_per_s=20.0)  # a small model on shared CPUs
    runs = {name: simulate_fleet(requests, replicas, name, budget_tokens, block_tokens=1, load=load, seed=seed)
            for name in policies}
    what = (f"simulated: {len(requests)} requests, {sum(r.prompt_tokens for r in requests):,} prompt tokens; "
            f"{replicas} replicas of {budget_tokens:,} tokens ({budget_mb:g} MiB at {geometry.kv_bytes_per_token:,} "
            f"bytes per token, {geometry.name}); token-level blocks")
    return runs, what


def run_builtin(args: argparse.Namespace) -> int:
    replicas = args.replica_counts[0] if args.replicas_given else 3
    runs, what = predict_builtin(args.policy_list, replicas, args.budget_mb, seed=args.seed)
    print(what)
    rows = ["| policy | simulated hit rate | ceiling | requests per replica | real lab (docs/FLEET.md) | real per replica |",
            "|---|---:|---:|---|---:|---|"]
    for name, run in runs.items():
        real = REAL_LAB.get(name)
        real_cells = f"{real[0]:.1%} | {' / '.join(map(str, real[1]))}" if real and replicas == 3 else "- | -"
        rows.append(f"| {name} | {run.hit_rate:.1%} | {run.ceiling_rate:.1%} | "
                    f"{' / '.join(map(str, run.per_replica or []))} | {real_cells} |")
    print("\n".join(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.fleet_sim", description=__doc__.splitlines()[0])
    p.add_argument("--trace", default="synthetic", help="synthetic (default), builtin, or a replay log's path")
    p.add_argument("--replicas", default=None, help="fleet sizes, comma-separated (default 8,16,32,64; builtin: 3)")
    p.add_argument("--requests", type=int, default=100_000, help="synthetic: how many requests")
    p.add_argument("--policies", default="all", help=f"comma-separated from {', '.join(POLICIES)}, or all")
    p.add_argument("--budget-tokens", type=int, default=250_000, help="each replica's cache, in tokens")
    p.add_argument("--budget-mb", type=float, default=64.0, help="builtin: each replica's cache, as the lab's")
    p.add_argument("--block-tokens", type=int, default=16, help="the cache's block (builtin: 1, token-level)")
    p.add_argument("--rate", type=float, default=100.0, help="synthetic: requests per second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-pooled", action="store_true",
                   help="leave out each size's reference row: one cache with the whole fleet's memory")
    args = p.parse_args(argv)
    args.replicas_given = args.replicas is not None
    try:
        args.replica_counts = [int(x) for x in (args.replicas or "8,16,32,64").split(",") if x.strip()]
    except ValueError:
        p.error("--replicas takes whole numbers, comma-separated")
    if not args.replica_counts or min(args.replica_counts) < 1:
        p.error("--replicas needs at least one fleet size >= 1")
    args.policy_list = list(POLICIES) if args.policies == "all" else [x.strip() for x in args.policies.split(",") if x.strip()]
    unknown = [x for x in args.policy_list if x not in POLICIES]
    if unknown:
        p.error(f"unknown policies: {', '.join(unknown)}")
    if args.trace == "builtin":
        return run_builtin(args)
    if args.trace == "synthetic":
        requests = chat_workload(ChatWorkload(requests=args.requests, requests_per_s=args.rate, seed=args.seed),
                                 args.block_tokens)
        what = f"{len(requests):,} generated chat requests"
    else:
        from engine.model.hub import load_tokenizer

        with Path(args.trace).open(encoding="utf-8") as fh:
            requests = requests_from_log(fh, load_tokenizer(), args.block_tokens)
        what = f"{len(requests):,} requests from {args.trace}"
    print(f"{what}, {sum(r.prompt_tokens for r in requests) / max(1, len(requests)):,.0f} prompt tokens on average; "
          f"{args.budget_tokens:,} tokens per replica in blocks of {args.block_tokens}", flush=True)
    unbounded = simulate_fleet(requests, 1, "round_robin", None, args.block_tokens)
    print(f"reuse if nothing were ever evicted (one unbounded cache, a bound for every policy): "
          f"{unbounded.hit_rate:.1%}", flush=True)
    runs = []
    for n in args.replica_counts:
        for name in args.policy_list:
            runs.append(simulate_fleet(requests, n, name, args.budget_tokens, args.block_tokens, seed=args.seed))
            r = runs[-1]
            print(f"  {n} x {name}: hit {r.hit_rate:.1%}, {r.seconds:.1f} s", file=sys.stderr, flush=True)
        if not args.no_pooled:
            runs.append(pooled(requests, n, args.budget_tokens, args.block_tokens))
    print(table(runs))
    return 0


def pooled(requests: list[SimRequest], replicas: int, budget_tokens: int, block_tokens: int) -> FleetRun:
    """The reference for a fleet of ``replicas``: one cache with all their memory (no split, no copies)."""
    run = simulate_fleet(requests, 1, "round_robin", replicas * budget_tokens, block_tokens)
    run.policy, run.replicas, run.per_replica = POOLED, replicas, None
    return run


if __name__ == "__main__":
    sys.exit(main())
