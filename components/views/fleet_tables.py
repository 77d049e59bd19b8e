"""The Fleet tab's words and tables (``engine.types.FleetView`` -> Markdown). Pure: no Gradio.

Owns how a replica is named on the page ("replica 0", its port), its summary table, the
per-request table (landed where, cached there, the most any replica had, the gap) and the
duplication line, and the honest note on how a request's replica is inferred.
"""

from __future__ import annotations

import time
from urllib.parse import urlsplit

from components.views.format import fmt_bytes, fmt_pct
from engine.types import FleetRequest, FleetView, ReplicaView

RULE_WORDS = {
    "gained": "its tree grew by the request's blocks",
    "counted": "its /metrics counters grew by exactly this prompt and its cached tokens",
    "reported": "the only replica that held what the answer says was cached",
    "ambiguous": "could not tell",
    "no events": "no replica publishes events",
}

ATTRIBUTION_NOTE = (
    "**Where a request landed** is inferred, not told: the router names no replica in its answer. The replica whose "
    "tree (from its KV events) grew by the request's blocks ran it; where none grew (the answer added no whole "
    "block) the one whose `/metrics` counters grew by exactly this prompt and its cached tokens; failing that, the "
    "one whose blocks match the reported `cached_tokens`. Two requests in flight at once can defeat all three "
    "(shown as *?*). **Most any replica had** is each replica's match of the prompt in whole blocks just before it "
    "was sent: what a perfect router would have reused; **reuse missed** is how many more tokens that was than what "
    "the replica it landed on had (computed again for nothing). Our replicas report `cached_tokens` to the token, their "
    "events in whole blocks (32 tokens), so *cached (reported)* can exceed *cached there (blocks)* by up to a block."
)


def replica_name(i: int, url: str) -> str:
    return f"replica {i} (:{urlsplit(url).port})"


STATE_WORDS = {
    "live": "live",
    "down": "down",
    "stale": "events stopped",
    "stopped": "not followed",
    "none": "no events",
}


def _since(r: ReplicaView) -> str:
    return f" since {time.strftime('%H:%M:%S', time.localtime(r.since))}" if r.since else ""


def replica_title(i: int, r: ReplicaView) -> str:
    """One line over a replica's small tree: what it holds, or why its tree here is not to be trusted."""
    name = f"**{replica_name(i, r.url)}**"
    if r.state == "none" or (r.state == "live" and not r.events_alive):
        return f"{name}: no KV events found at its /kv_event_sources"
    if r.state == "down":
        return (f"{name}: **down**{_since(r)} (its /health does not answer; the router's health checks drop it). "
                f"The tree below is what it held then ({r.tokens_held:,} tokens), not what it holds now.")
    if r.state == "stale":
        return (f"{name}: **its KV events stopped**{_since(r)}: it computed prompts since its last event, so the "
                f"tree below ({r.tokens_held:,} tokens) is out of date: what it holds now is unknown, not empty.")
    if r.state == "stopped":
        return f"{name}: **not followed** (the event subscriber ended): what it holds is unknown."
    hit = fmt_pct(r.hit_rate) if r.hit_rate is not None else "–"
    return (f"{name}: {r.tokens_held:,} tokens in {r.blocks_held} blocks · "
            f"hit rate {hit} · {r.requests_landed} of yours landed here")


def replicas_table(view: FleetView) -> str:
    rows = ["| replica | state | blocks held | tokens held | hit rate (its /metrics) | running now | "
            "requests landed (yours) |", "|---|---|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(view.replicas):
        hit = fmt_pct(r.hit_rate) if r.hit_rate is not None else "unknown"
        running = f"{r.running:.0f}" if r.running is not None else "unknown"
        state = STATE_WORDS.get(r.state, r.state) + _since(r)
        known = r.state == "live" and r.events_alive
        blocks, tokens = (f"{r.blocks_held:,}", f"{r.tokens_held:,}") if known else (
            f"({r.blocks_held:,})", f"({r.tokens_held:,}, last known)")
        rows.append(f"| {replica_name(i, r.url)} | {state} | {blocks} | {tokens} | {hit} | {running} | "
                    f"{r.requests_landed} |")
    return "\n".join(rows)


def _request_row(q: FleetRequest, names: list[str]) -> str:
    landed = names[q.landed] if q.landed is not None else "?"
    reported = f"{q.cached_reported:,}" if q.cached_reported is not None else "not reported"
    there = f"{q.cached_on_landed:,}" if q.cached_on_landed is not None else "–"
    best = f"{q.best_before:,}" + (f" ({names[q.best_replica]})" if q.best_replica is not None else "")
    gap = q.best_before - q.cached_on_landed if q.cached_on_landed is not None else None
    gap_cell = "–" if gap is None else ("0" if gap <= 0 else f"**{gap:,}**")
    return (f"| {q.request_id} | {q.prompt_tokens:,} | {landed} | {RULE_WORDS.get(q.rule, q.rule)} | {reported} | "
            f"{there} | {best} | {gap_cell} |")


def requests_table(view: FleetView, last: int = 12) -> str:
    """The last requests, newest first."""
    if not view.requests:
        return "_No request yet: send one from the Chat or Few-shot tab (it goes through the router)._"
    names = [f"replica {i}" for i in range(len(view.replicas))]
    rows = ["| request | prompt tokens | landed on | how we know | cached (reported) | cached there (blocks) | "
            "most any replica had | reuse missed |", "|---:|---:|---|---|---:|---:|---|---:|"]
    rows += [_request_row(q, names) for q in reversed(view.requests[-last:])]
    return "\n".join(rows)


def duplication_line(view: FleetView) -> str:
    """How much of what the fleet holds is held more than once, and what that costs."""
    if not view.tokens_held:
        return "**Duplication:** nothing cached on any replica yet."
    share = view.duplicate_copy_tokens / view.tokens_held
    cost = (f" = **{fmt_bytes(view.duplicate_bytes)}** of KV ({view.kv_bytes_per_token:,.0f} bytes per token, from "
            "the replicas' /metrics)" if view.duplicate_bytes is not None
            else " (bytes unknown: the replicas do not say their KV bytes per token; tokens only)")
    return (f"**Duplication:** the replicas hold {view.tokens_held:,} tokens, {view.tokens_distinct:,} distinct; "
            f"{view.tokens_on_several:,} tokens are held on more than one replica, so **{view.duplicate_copy_tokens:,} "
            f"tokens** ({fmt_pct(share)} of what the fleet holds) are extra copies{cost}.")
