"""Record a real server's KV event stream into a small msgpack file (tests/server/remote/fixtures/).

A raw subscriber (pyzmq only, no decoding of ours) follows the server's events while this
sends token-id prompts to its ``/v1/completions``; the file holds what came on the wire::

    {"server": "vllm 0.32.0+cpu", "block_size": 32, "prompts": [[ids...], ...],
     "salts": [str | None, ...], "batches": [[seq, payload bytes], ...]}

so the fast tests decode real payloads and check that the blocks' chains rebuild the prompts.

Usage: python -m tools.record_kv_events --backend http://127.0.0.1:PORT --scenario basic OUT.msgpack
Scenarios: ``basic`` (a shared system prefix, three questions, one salted), ``evict`` (long
distinct prompts past a small ``--num-gpu-blocks-override``), ``clear`` (then
``POST /reset_prefix_cache``, which needs the server's ``VLLM_SERVER_DEV_MODE=1``).
"""

from __future__ import annotations

import argparse
import random
import threading
import time

import httpx
import msgspec
import zmq

from server.remote.kv_events import discover


def scenario(name: str, rng: random.Random) -> tuple[list[list[int]], list[str | None]]:
    """Prompts (token ids of the embedded model's vocabulary, away from special tokens) and salts."""
    def ids(n: int) -> list[int]:
        return [rng.randrange(300, 40000) for _ in range(n)]
    if name == "basic":
        system = ids(100)
        prompts = [system + ids(20), system + ids(45), system + ids(30), system + ids(12)]
        return prompts, [None, None, None, "fixture-salt"]
    if name == "evict":
        return [ids(1400) for _ in range(5)], [None] * 5
    if name == "clear":
        return [ids(70), ids(70)], [None, None]
    raise SystemExit(f"unknown scenario {name}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", required=True)
    p.add_argument("--scenario", default="basic")
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("out")
    args = p.parse_args()
    http = httpx.Client(base_url=args.backend, timeout=300)
    source = discover(lambda path: http.get(path).json(), args.backend)
    assert source is not None, "the backend publishes no KV events"
    model = http.get("/v1/models").json()["data"][0]["id"]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
    sub.connect(source.endpoint)
    batches: list[list] = []
    stop = threading.Event()

    def listen() -> None:
        while not stop.is_set():
            if sub.poll(200):
                _, seq, payload = sub.recv_multipart()
                batches.append([int.from_bytes(seq, "big", signed=True), payload])

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    time.sleep(0.5)
    prompts, salts = scenario(args.scenario, random.Random(30))
    for ids, salt in zip(prompts, salts, strict=True):
        body = {"model": model, "prompt": ids, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
        if salt:
            body["cache_salt"] = salt
        r = http.post("/v1/completions", json=body)
        r.raise_for_status()
    if args.scenario == "clear":
        http.post("/reset_prefix_cache").raise_for_status()
        http.post("/v1/completions", json={"model": model, "prompt": prompts[0], "max_tokens": 2}).raise_for_status()
    time.sleep(1.0)
    stop.set()
    t.join()
    sub.close(linger=0)
    ctx.term()
    version = http.get("/version").json().get("version", "?") if args.backend else "?"
    data = {"server": f"vllm {version}", "block_size": 32, "prompts": prompts, "salts": salts, "batches": batches}
    with open(args.out, "wb") as f:
        f.write(msgspec.msgpack.encode(data))
    print(f"{args.out}: {len(batches)} batches, {sum(len(b[1]) for b in batches):,} payload bytes")


if __name__ == "__main__":
    main()
