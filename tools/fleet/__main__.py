"""``python -m tools.fleet``: N replicas and vLLM's router in front, on loopback, until Ctrl+C.

Usage: python -m tools.fleet --replicas 3 --policy kv_aware [--engine ours|vllm] [--model PATH]
       [--base-port 8100] [--budget-mb 64]

Prints one line per replica (its URL and KV-event endpoint) and the router's URL, then waits.
Ctrl+C or SIGTERM stops the router and every replica (each in a process group of its own).
The router comes from ``RADIX_ROUTER_VENV`` (default ``.venv-router``; ``tools/install_router.sh``).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from tools.fleet.processes import POLICIES, Fleet


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.fleet", description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=3, help="how many replicas (default 3)")
    p.add_argument("--policy", choices=POLICIES, default="kv_aware", help="the router's policy (default kv_aware)")
    p.add_argument("--engine", choices=("ours", "vllm"), default="ours",
                   help="ours: app.py --replica; vllm: vLLM's CPU server from RADIX_VLLM_VENV (default ours)")
    p.add_argument("--model", default=None, help="the replicas' model (ours: any --model; vLLM: a folder; "
                                                 "default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--base-port", type=int, default=0,
                   help="router on this port, replicas on the next ones, events from +100 (default: free ports)")
    p.add_argument("--budget-mb", type=float, default=64.0,
                   help="each replica's KV budget in MiB (vLLM: rounded up to whole GiB; default 64)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per replica (default: cores / replicas)")
    p.add_argument("--log-dir", default=None, help="where the children's logs go (default: a new temp folder)")
    args = p.parse_args(argv)
    if args.replicas < 1:
        p.error("--replicas must be at least 1")
    if args.policy == "power_of_two" and args.replicas < 2:
        p.error("power_of_two needs at least 2 replicas")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background (SIG_IGN)
    fleet = Fleet(args.replicas, args.policy, engine=args.engine, model=args.model, base_port=args.base_port,
                  budget_mb=args.budget_mb, log_dir=args.log_dir, threads=args.threads)
    print(f"Starting {args.replicas} {args.engine} replicas and the router ({args.policy}); logs in {fleet.log_dir}",
          flush=True)
    try:
        fleet.start()
        for line in fleet.describe():
            print(line, flush=True)
        print(f"Send OpenAI requests to {fleet.url}/v1 (model {fleet.model_name!r}); Ctrl+C stops the fleet.",
              flush=True)
        while fleet.router is not None and fleet.router.alive():
            time.sleep(0.5)
        print("The router exited; stopping the replicas.", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        fleet.stop()
        print("Stopped.", flush=True)


if __name__ == "__main__":
    sys.exit(main())
