"""The Fleet tab's words and tables (``engine.types.FleetView`` -> Markdown). Pure: no Gradio.

Owns how a replica is named on the page ("replica 0", its port), its summary table, the
per-request table (landed where, cached there, the most any replica had, the gap) and the
duplication line, and the honest note on how a request's replica is inferred.

Every figure is declared (``engine.visibility``): a replica's blocks, tokens, hit rate and running
count and the fleet's duplication are everyone's (coarse or withheld on a public deployment:
they are the operator's, ``server/exposure.py``); the requests that landed where are the viewer's
own only when counted over the requests listed for them (``landed_of``).
"""

from __future__ import annotations

import time
from urllib.parse import urlsplit

from components.views.format import fmt_figure, fmt_pct
from engine.types import FleetRequest, FleetView, ReplicaView
from engine.visibility import Audience, Unit, everyone, own

PRIVATE = Audience(public=False)

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


def landed_of(view: FleetView) -> list[int]:
    """Per replica, how many of the requests listed in ``view`` (the viewer's own in isolation
    mode: ``EngineAPI.fleet_view(viewer)``) landed there."""
    counts = [0] * len(view.replicas)
    for q in view.requests:
        if q.landed is not None and 0 <= q.landed < len(counts):
            counts[q.landed] += 1
    return counts


def _held(r: ReplicaView, audience: Audience) -> tuple[str, str]:
    tokens = fmt_figure(everyone(r.tokens_held, Unit.TOKENS), audience)
    blocks = everyone(r.blocks_held, Unit.TOKENS)  # a block count is tokens by another name: withheld publicly
    return tokens, "some" if audience.public else fmt_figure(blocks, audience)


def replica_title(i: int, r: ReplicaView, audience: Audience = PRIVATE, yours: int | None = None) -> str:
    """One line over a replica's small tree: what it holds, or why its tree here is not to be trusted.
    ``yours``: the viewer's requests that landed there (``landed_of``); None: everyone's count."""
    name = f"**{replica_name(i, r.url)}**"
    tokens, blocks = _held(r, audience)
    if r.state == "none" or (r.state == "live" and not r.events_alive):
        return f"{name}: no KV events found at its /kv_event_sources"
    if r.state == "down":
        return (f"{name}: **down**{_since(r)} (its /health does not answer; the router's health checks drop it). "
                f"The tree below is what it held then ({tokens} tokens), not what it holds now.")
    if r.state == "stale":
        return (f"{name}: **its KV events stopped**{_since(r)}: it computed prompts since its last event, so the "
                f"tree below ({tokens} tokens) is out of date: what it holds now is unknown, not empty.")
    if r.state == "stopped":
        return f"{name}: **not followed** (the event subscriber ended): what it holds is unknown."
    hit = _hit(everyone(r.hit_rate), audience, "–")
    landed = (f"{fmt_figure(own(yours, Unit.COUNT), audience)} of yours landed here" if yours is not None else
              f"{fmt_figure(everyone(r.requests_landed, Unit.COUNT), audience)} from this page landed here")
    return f"{name}: {tokens} tokens in {blocks} blocks · hit rate {hit} · {landed}"


def _hit(rate, audience: Audience, unknown: str) -> str:
    shown = audience.show(rate)
    if shown.withheld:
        return "not shown"
    return fmt_pct(shown.value) if shown.value is not None else unknown


def replicas_table(view: FleetView, audience: Audience = PRIVATE, yours: list[int] | None = None) -> str:
    """The replicas, one row each; ``yours``: the viewer's requests landed per replica (``landed_of``)."""
    landed_head = "requests landed (yours)" if yours is not None else "requests landed (from this page)"
    rows = [f"| replica | state | blocks held | tokens held | hit rate (its /metrics) | running now | {landed_head} |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(view.replicas):
        hit = _hit(everyone(r.hit_rate), audience, "unknown")
        now = everyone(r.running, Unit.COUNT)
        running = fmt_figure(everyone(round(now.value), Unit.COUNT), audience) if now.value is not None else "unknown"
        state = STATE_WORDS.get(r.state, r.state) + _since(r)
        known = r.state == "live" and r.events_alive
        tokens, blocks = _held(r, audience)
        blocks, tokens = (blocks, tokens) if known else (f"({blocks})", f"({tokens}, last known)")
        landed = (fmt_figure(own(yours[i], Unit.COUNT), audience) if yours is not None
                  else fmt_figure(everyone(r.requests_landed, Unit.COUNT), audience))
        rows.append(f"| {replica_name(i, r.url)} | {state} | {blocks} | {tokens} | {hit} | {running} | {landed} |")
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


def duplication_line(view: FleetView, audience: Audience = PRIVATE) -> str:
    """How much of what the fleet holds is held more than once, and what that costs (everyone's)."""
    held, copies = everyone(view.tokens_held, Unit.TOKENS), everyone(view.duplicate_copy_tokens, Unit.TOKENS)
    if not held.value:
        return "**Duplication:** nothing cached on any replica yet."
    if audience.public:  # what every visitor's prompts made of the fleet: the operator's figures
        return (f"**Duplication:** the replicas hold {fmt_figure(held, audience)} tokens, "
                f"{fmt_figure(copies, audience)} of them extra copies (everyone's, in 256-token steps on a public "
                "page).")
    share = copies.value / held.value
    cost_bytes = everyone(view.duplicate_bytes, Unit.BYTES)
    cost = (f" = **{fmt_figure(cost_bytes, audience)}** of KV ({view.kv_bytes_per_token:,.0f} bytes per token, from "
            "the replicas' /metrics)" if cost_bytes.value is not None
            else " (bytes unknown: the replicas do not say their KV bytes per token; tokens only)")
    return (f"**Duplication:** the replicas hold {fmt_figure(held, audience)} tokens, "
            f"{fmt_figure(everyone(view.tokens_distinct, Unit.TOKENS), audience)} distinct; "
            f"{fmt_figure(everyone(view.tokens_on_several, Unit.TOKENS), audience)} tokens are held on more than one "
            f"replica, so **{fmt_figure(copies, audience)} tokens** ({fmt_pct(share)} of what the fleet holds) are "
            f"extra copies{cost}.")
