"""The routing lab: the built-in trace through vLLM's router under each policy in turn, one table.

Usage: python -m tools.routing_lab [--replicas 3] [--policies round_robin,consistent_hash,power_of_two,cache_aware,kv_aware]
       [--model PATH] [--users 8] [--turns 3] [--concurrency 4] [--max-tokens 16] [--budget-mb 64]
       [--json FILE]     # the report for the Fleet tab: app.py --backend ROUTER --fleet ... --routing-lab FILE

For each policy a fresh fleet (``tools.fleet``): the replicas start again, so every policy meets
empty caches, and the router starts with that policy. The trace (``tools.fleet.trace``) is replayed
through the router, users of a round ``--concurrency`` at a time. Per policy: requests answered,
the fleet-wide cached-token share (``usage.prompt_tokens_details.cached_tokens`` over prompt
tokens), time to first token p50/p95 as the client saw it, output tokens per second over the
replay, how many requests each replica got (its ``/metrics``) and the tokens held on more than one
replica at the end (from each replica's KV events). The measured columns are our
replicas and the real router, on loopback; beside them (``--no-predict`` leaves them out) what the
fleet simulator predicts for the same trace, fleet size, budget and policy (``tools.fleet_sim``:
no model, no router, token-level caches; see docs/FLEET.md, "The simulator").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from analysis.replay.fleet_policies import POLICIES as SIMULATED
from components.views.routing_lab_report import lab_caption, lab_table, to_json
from server.remote.fleet import Fleet as Followed
from server.remote.fleet import duplication
from tools.fleet import POLICIES, Fleet, metrics_of
from tools.fleet.trace import built_in_trace, replay, summarize
from tools.fleet_sim import predict_builtin


def run_policy(policy: str, args: argparse.Namespace) -> dict:
    fleet = Fleet(args.replicas, policy, model=args.model, budget_mb=args.budget_mb, threads=args.threads)
    with fleet:
        # the dashboard's own follower of each replica's KV events (for the duplication at the end)
        followed = Followed([r.url for r in fleet.members])
        try:
            found = followed.follow()
            before = [metrics_of(r.url) for r in fleet.members]
            t0 = time.monotonic()
            results = replay(fleet.url, fleet.model_name, built_in_trace(args.users, args.turns, seed=args.seed),
                             max_tokens=args.max_tokens, concurrency=args.concurrency, deadline_s=args.deadline_s)
            row = summarize(results, time.monotonic() - t0)
            after = [metrics_of(r.url) for r in fleet.members]
            if all(source is not None for source in found):  # tokens held more than once, from the events
                time.sleep(1.0)  # the last batches
                d = duplication([r.blocks for r in followed.replicas])
                row["held_tokens"], row["duplicate_tokens"] = d.tokens_held, d.duplicate_copy_tokens
        finally:
            followed.close()
    row["per_replica"] = [int(a.get("radix_requests_total", 0) - b.get("radix_requests_total", 0))
                          for a, b in zip(after, before, strict=True)]
    row["policy"] = policy
    return row


def report_of(rows: list[dict], predicted: dict | None, args: argparse.Namespace) -> dict:
    """The lab's report (``components.views.routing_lab_report``: the Fleet tab reads it)."""
    from tools.measure import machine_header

    return {"replicas": args.replicas, "model": args.model or "SmolLM2-135M-Instruct (embedded)",
            "users": args.users, "turns": args.turns, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
            "machine": machine_header().splitlines()[0].removeprefix("CPU: "), "date": time.strftime("%Y-%m-%d"),
            "rows": rows,
            "predicted": None if predicted is None else {
                name: {"hit_rate": run.hit_rate, "per_replica": list(run.per_replica)}
                for name, run in predicted.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.routing_lab", description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--policies", default="round_robin,consistent_hash,power_of_two,cache_aware,kv_aware",
                   help=f"comma-separated, from {', '.join(POLICIES)}")
    p.add_argument("--model", default=None, help="the replicas' --model (default: the embedded SmolLM2-135M)")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=4, help="users of a round sent at once (default 4)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--budget-mb", type=float, default=64.0)
    p.add_argument("--threads", type=int, default=None, help="torch threads per replica (default: cores / replicas)")
    p.add_argument("--deadline-s", type=float, default=900.0, help="each replay's limit (turns past it are not sent)")
    p.add_argument("--no-predict", action="store_true", help="leave out the simulator's prediction")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write the report here, for the Fleet tab (app.py --routing-lab FILE)")
    args = p.parse_args(argv)
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    unknown = [x for x in policies if x not in POLICIES]
    if unknown:
        p.error(f"unknown policies: {', '.join(unknown)}")
    rows = []
    for policy in policies:
        print(f"{policy}: starting {args.replicas} fresh replicas and the router ...", flush=True)
        rows.append(run_policy(policy, args))
        r = rows[-1]
        print(f"  {r['answered']}/{r['requests']} answered, {r['hit_rate']:.1%} of prompt tokens cached, "
              f"{r['wall_s']:.1f} s", flush=True)
    predicted = None
    if not args.no_predict:
        try:  # the measurements took minutes: a prediction that fails must not lose them
            runs, what = predict_builtin([x for x in policies if x in SIMULATED], args.replicas, args.budget_mb,
                                         args.users, args.turns, args.seed, args.concurrency, args.model,
                                         args.max_tokens)
        except Exception as exc:
            print(f"no simulated columns: {type(exc).__name__}: {exc}")
        else:
            predicted = {name: run for name, run in runs.items() if name in policies}
            print(what)
    report = report_of(rows, predicted, args)
    print(lab_caption(report))
    print(lab_table(report))
    if args.json:
        Path(args.json).write_text(to_json(report))
        print(f"report written to {args.json} (python app.py --backend ROUTER --fleet ... --routing-lab {args.json})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
