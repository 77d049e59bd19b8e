"""The Routing tab: what routing does to reuse, on a simulated fleet (no model, no router).

Owns the tab's layout, its limits and its one handler: a generated chat workload
(``analysis.replay.fleet_trace``) routed over N replicas under every policy
(``analysis.replay.fleet_sim``), one simulation at a time, a few seconds at most. Nothing of a
visitor's is used or kept: the workload is generated from the settings alone. The measured fleet
(vLLM's router in front of real replicas) is the command line's (docs/FLEET.md).
"""

from __future__ import annotations

import gradio as gr

from analysis.replay.fleet_policies import POLICIES
from analysis.replay.fleet_sim import simulate_fleet
from analysis.replay.fleet_trace import ChatWorkload, chat_workload
from components.panels.common import warn
from components.views.routing_table import routing_markdown
from engine.types import EngineError

REPLICAS = (2, 64)
REQUESTS = (200, 4000)
BUDGET_TOKENS = (2_000, 200_000)
BLOCK_TOKENS = 16

INTRO = (
    "**Where a request lands decides what it can reuse.** A fleet runs several replicas of a model, each with its "
    "own prefix cache, behind a router: a prompt sent to a replica that never saw its system prompt computes it "
    "again. Here the same generated chat workload (8 system prompts, the popular ones asked far more often, many "
    "users, chats of several turns) goes through each routing policy of vLLM's router, SGLang's router and llm-d. "
    "It is a **simulation**: no model runs, each replica's cache is counted in 16-token blocks with the least "
    "recently used evicted first, so it takes a second or two. On the trace the real routing lab sends through "
    "vLLM's router to real replicas of this app, it came within half a point for round robin (61.5% against "
    "61.9% measured) and cache-aware routing (87.1% against 87.0%); see docs/FLEET.md."
)


def _bounded(value: object, lo: int, hi: int, name: str) -> int:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise EngineError(f"{name} must be a number from {lo:,} to {hi:,}.") from None
    if number != number:
        raise EngineError(f"{name} must be a number from {lo:,} to {hi:,}.")
    return int(min(max(number, lo), hi))


def simulate(replicas: object, requests: object, budget_tokens: object) -> tuple[list, object]:
    """Every policy's run on one generated workload, and the pooled reference. Raises EngineError."""
    n = _bounded(replicas, *REPLICAS, "Replicas")
    count = _bounded(requests, *REQUESTS, "Requests")
    budget = _bounded(budget_tokens, *BUDGET_TOKENS, "Cache per replica")
    workload = chat_workload(ChatWorkload(requests=count, system_prompts=8, system_tokens=(300, 2000),
                                          users=max(20, count // 6), requests_per_s=20.0, seed=7), BLOCK_TOKENS)
    runs = [simulate_fleet(workload, n, policy, budget, BLOCK_TOKENS) for policy in POLICIES]
    pooled = simulate_fleet(workload, 1, "round_robin", budget * n, BLOCK_TOKENS)
    return runs, pooled


def build_routing_panel() -> None:
    gr.Markdown(INTRO)
    with gr.Row():
        replicas = gr.Slider(*REPLICAS, value=8, step=1, label="replicas")
        requests = gr.Slider(*REQUESTS, value=2000, step=100, label="requests")
        budget = gr.Slider(*BUDGET_TOKENS, value=20_000, step=1_000, label="cache per replica (tokens)")
    run = gr.Button("Simulate the fleet", variant="primary")
    table = gr.Markdown("*Press **Simulate the fleet**: every policy on the same workload, side by side.*")

    def on_run(n, count, tokens):
        try:
            runs, pooled = simulate(n, count, tokens)
        except EngineError as exc:
            warn(exc)
            return gr.skip()
        return routing_markdown(runs, pooled)

    run.click(on_run, [replicas, requests, budget], table, api_visibility="private", show_progress="minimal",
              concurrency_limit=1, concurrency_id="routing-simulation")  # one at a time: a few seconds of CPU
