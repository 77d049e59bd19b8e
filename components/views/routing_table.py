"""The Routing tab's words and table (``analysis.replay.fleet_sim.FleetRun`` -> Markdown). Pure: no Gradio.

Owns what each routing policy is called and how it decides, in one line each, and the table of a
simulated fleet: hit rate, the most any replica held (the run's ceiling), duplication, imbalance,
beside one pooled cache with the whole fleet's memory.
"""

from __future__ import annotations

from components.views.format import fmt_pct

# Every figure here is the viewer's own (a simulated fleet over the visitor's own workload): engine.visibility.
FIGURES_WHOSE = "own"

POLICY_WORDS = {
    "round_robin": "each replica in turn: spreads load, ignores the caches",
    "random": "a replica at random",
    "consistent_hash": "a hash of the user picks the replica: a user's turns land together",
    "power_of_two": "two replicas at random, the less busy one",
    "cache_aware": "the replica whose tree (the router's guess of its cache) matches most, unless the load is uneven "
                   "(vLLM's and SGLang's router)",
    "kv_aware": "the replica whose KV events show the longest cached prefix (llm-d, Dynamo)",
    "oracle": "the replica holding the most of this prompt, load ignored: a greedy upper bound",
}


def routing_markdown(runs: list, pooled=None) -> str:
    """One row per policy, best hit rate first, then the pooled reference."""
    if not runs:
        return ""
    first = runs[0]
    lines = [f"**{first.replicas} replicas**, {first.requests:,} requests, "
             f"{first.prompt_tokens // max(1, first.requests):,} prompt tokens each on average, "
             f"{first.budget_tokens:,} tokens of cache per replica:", "",
             "| policy | how it picks | prompt tokens from cache | most any replica held | memory on duplicates "
             "| busiest replica vs mean |", "|---|---|---:|---:|---:|---:|"]
    for run in sorted(runs, key=lambda r: -r.hit_rate):
        lines.append(f"| **{run.policy}** | {POLICY_WORDS.get(run.policy, '')} | {fmt_pct(run.hit_rate)} | "
                     f"{fmt_pct(run.ceiling_rate)} | {fmt_pct(run.duplication.share)} | {run.imbalance:.2f}x |")
    if pooled is not None:
        lines.append(f"| *one cache, all the memory* | not a fleet: the same memory in one place | "
                     f"{fmt_pct(pooled.hit_rate)} | | | |")
    best, worst = max(runs, key=lambda r: r.hit_rate), min(runs, key=lambda r: r.hit_rate)
    lines += ["", f"Routing alone moves the share of prompt tokens served from a cache from "
                  f"{fmt_pct(worst.hit_rate)} ({worst.policy}) to {fmt_pct(best.hit_rate)} ({best.policy}), on the same "
                  "replicas and the same memory. Policies that ignore the caches hold the same system prompts on every "
                  "replica (memory on duplicates); policies that chase the cache pile users onto few replicas "
                  "(busiest vs mean)."]
    return "\n".join(lines)
