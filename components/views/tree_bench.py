"""Big radix trees shaped like real traffic, and a benchmark of the tree figures on them.

Owns ``traffic_snapshot``: a real ``RadixTree`` (no tensors, values ``None``) fed
with simulated chat traffic (a few dozen system prompts behind one chat-template
header, many chats per prompt, starter questions that many chats share, answers
that are the same for the same prompt as under greedy decoding, follow-ups over
several turns, regenerated and edited turns that branch), then read out as the
``TreeSnapshot`` the engine would hand a viewer: other visitors' nodes hidden,
optionally with the coarse fields a public server gives them (zero hits, times
and locks, sizes rounded). Fans then mix leaves with children that carry whole
subtrees, as they do in a cache that served a few thousand requests.

Run ``python -m components.views.tree_bench [--nodes 2000,5000] [--repeats 3]`` to print
how long each figure takes to build (both views, chains collapsed or not, a
highlighted path, hidden nodes). Tests use the generator; they time nothing.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time
from dataclasses import dataclass, replace

from engine.kvcache.radix_tree import RadixTree
from engine.snapshot_view import may_see, node_infos, with_text
from engine.types import PUBLIC, CacheKey, RequestMetrics, TreeSnapshot

HEADER = (1, 9690, 198)  # "<|im_start|>system\n": every system prompt starts with it
BYTES_PER_TOKEN = 46_080  # the embedded model's KV per token in fp32
COARSE_TOKENS = 16  # a public server rounds other visitors' sizes to this


@dataclass
class Traffic:
    """The tree after the traffic, and the viewer's last request (to highlight)."""

    tree: RadixTree
    now: float
    last_prompt: tuple[int, ...]
    last_output: tuple[int, ...]
    last_cached: int
    viewer: str


def simulate_traffic(num_nodes: int, seed: int = 0, num_prompts: int = 36, num_visitors: int = 40,
                     isolation: bool = True) -> Traffic:
    """Run chats into a radix tree until it holds about ``num_nodes`` nodes.

    With ``isolation`` each visitor's chats live in their own namespace (the
    system prompts, shipped with the app, stay shared); without it everyone
    shares, so identical starter questions share one node and its answer.
    """
    rng = random.Random(seed)
    clock = [0.0]
    tree = RadixTree(clock=lambda: clock[0])
    fresh = iter(range(20_000, 10**9))  # token ids never used before

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(next(fresh) for _ in range(n))

    families = [tokens(rng.randint(10, 40)) for _ in range(max(1, num_prompts // 4))]
    prompts = [HEADER + rng.choice(families) + tokens(rng.randint(20, 200)) for _ in range(num_prompts)]
    starters = [[tokens(rng.randint(8, 30)) for _ in range(4)] for _ in range(num_prompts)]
    weights = [1 / (i + 1) for i in range(num_prompts)]  # a few prompts get most of the traffic
    last: dict = {}

    def answer(ids: tuple[int, ...]) -> tuple[int, ...]:
        r = random.Random(hash(ids))  # greedy: the same prompt always gets the same answer
        return tuple(r.randrange(1000, 19_000) for _ in range(r.randint(15, 90)))

    def send(visitor: str, ids: tuple[int, ...], public_len: int) -> tuple[int, ...]:
        clock[0] += rng.uniform(0.5, 3.0)
        key = CacheKey(ids, visitor if isolation else PUBLIC, public_len)
        cached = tree.match(key).length
        out = answer(ids)
        tree.insert(CacheKey(ids + out, key.namespace, public_len), [None] * (len(ids) + len(out)))
        last[visitor] = (ids, out, cached)
        return ids + out

    def chat(visitor: str, ids: tuple[int, ...], public_len: int, turns: int, p: int) -> None:
        for turn in range(turns):
            branch = rng.random() < 0.15 and turn > 0  # regenerate or edit: a sibling continuation
            if branch:
                chat(visitor, ids, public_len, rng.randint(1, max(1, turns - turn)), p)
            starter = turn == 0 and rng.random() < 0.5
            user = rng.choice(starters[p]) if starter else tokens(rng.randint(6, 60))
            ids = send(visitor, ids + user, public_len)

    while True:
        for _ in range(20):
            p = rng.choices(range(num_prompts), weights)[0]
            visitor = f"v{rng.randrange(num_visitors)}"
            turns = min(8, 1 + int(rng.expovariate(0.6)))
            chat(visitor, prompts[p], len(prompts[p]), turns, p)
        if len(tree.nodes()) >= num_nodes:
            break
    for node in rng.sample(tree.nodes(), 3):  # a few running requests hold their path
        while node is not None and node is not tree.root:
            node.lock_ref += 1
            node = node.parent
    viewer = max(last, key=lambda v: len(last[v][0]))
    ids, out, cached = last[viewer]
    return Traffic(tree, clock[0], ids, out, cached, viewer)


def traffic_snapshot(traffic: Traffic, viewer: str | None = None, coarse_hidden: bool = False) -> TreeSnapshot:
    """The snapshot ``viewer`` would get (``None``: sees everything), nodes built as the cache builds
    them (``engine.snapshot_view.node_infos``), text a made-up word per token.

    Other visitors' nodes stay hidden node by node (the engine folds them into one coarse node per
    subtree, ``for_viewer``; node by node is the figures' worst case, and what they must draw too).
    ``coarse_hidden``: hidden nodes carry no hits, times or locks, and sizes rounded up.
    """
    infos = []
    for n in with_text(node_infos(traffic.tree, traffic.now, BYTES_PER_TOKEN), _words, 48):
        if may_see(viewer, n.namespace):
            infos.append(n)
            continue
        num_tokens, depth = n.num_tokens, n.depth_tokens
        if coarse_hidden:
            num_tokens = -(-num_tokens // COARSE_TOKENS) * COARSE_TOKENS
            depth = -(-depth // COARSE_TOKENS) * COARSE_TOKENS
            n = replace(n, hits=0, last_access_s_ago=0.0, lock_ref=0)
        infos.append(replace(n, num_tokens=num_tokens, depth_tokens=depth, num_bytes=num_tokens * BYTES_PER_TOKEN,
                             namespace="other", hidden=True, token_ids=(), text=""))
    total = traffic.tree.num_tokens
    return TreeSnapshot(tuple(infos), total, total * BYTES_PER_TOKEN, 2 * total * BYTES_PER_TOKEN, 2 * total,
                        0, BYTES_PER_TOKEN)


def _words(ids) -> str:
    return " ".join(f"w{t % 997}" for t in ids)


def last_request(traffic: Traffic) -> RequestMetrics:
    """The viewer's last request as metrics (only what the tree view reads is real)."""
    prompt, output = traffic.last_prompt, traffic.last_output
    return RequestMetrics(
        request_id=1, tag="bench", namespace=traffic.viewer, prompt_tokens=len(prompt),
        cached_tokens=traffic.last_cached, computed_tokens=len(prompt) - traffic.last_cached, prefill_ms=0.0,
        baseline_prefill_ms=None, ttft_ms=0.0, queue_ms=0.0, decode_tokens_per_s=None, output_tokens=len(output),
        finish_reason="length", cache_bytes=0, cache_budget_bytes=0, evicted_tokens=0, inserted_tokens=0,
        matched_path=[], prompt_ids=list(prompt), output_ids=list(output), output_text="")


def main(argv: list[str] | None = None) -> None:
    from components.views.tree_figures import tree_figure
    from components.views.tree_marks import request_path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="2000,5000", help="comma-separated tree sizes")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shared", action="store_true", help="no visitor isolation: everyone shares one namespace")
    args = p.parse_args(argv)
    print("Figure build times (median and max of --repeats, after one warm-up build); json = Figure.to_json(),"
          " which Gradio runs next.\n")
    print(f"{'nodes':>6}  {'snapshot':<15} {'view':<7} {'chains':<9} {'marks':>6} {'build ms':>9} {'max ms':>7}"
          f" {'json ms':>8}")
    worst = 0.0
    for num in (int(x) for x in args.nodes.split(",")):
        traffic = simulate_traffic(num, args.seed, isolation=not args.shared)
        metrics = last_request(traffic)
        cases = {"all visible": traffic_snapshot(traffic),
                 "viewer": traffic_snapshot(traffic, traffic.viewer),
                 "viewer, coarse": traffic_snapshot(traffic, traffic.viewer, coarse_hidden=True)}
        for label, snap in cases.items():
            path = request_path(snap, metrics)
            for view in ("tree", "icicle"):
                for collapse in (True, False):
                    build = functools.partial(tree_figure, snap, path, view=view, collapse_chains=collapse, height=600)
                    fig = build()
                    times = []
                    for _ in range(args.repeats):
                        t0 = time.perf_counter()
                        fig = build()
                        times.append((time.perf_counter() - t0) * 1000)
                    t0 = time.perf_counter()
                    fig.to_json()
                    json_ms = (time.perf_counter() - t0) * 1000
                    marks = len(fig.data[-2].x) if view == "icicle" else len(fig.data[3].x)
                    worst = max(worst, statistics.median(times))
                    print(f"{len(snap.nodes):>6}  {label:<15} {view:<7} {'collapsed' if collapse else 'each':<9} "
                          f"{marks:>6} {statistics.median(times):>9.0f} {max(times):>7.0f} {json_ms:>8.0f}")
    print(f"\nslowest median build: {worst:.0f} ms (goal: at most 300 ms for 5,000 nodes)")


if __name__ == "__main__":
    main()
