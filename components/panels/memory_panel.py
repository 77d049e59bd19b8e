"""Cache memory panel: bytes of KV in use against the budget, what the cache
holds, evictions, hit rate over time, and the two controls (budget, clear),
each confirming what it did with numbers.

In isolation mode (a public deployment) "clear" empties only the visitor's
own namespace, and the shared budget cannot be changed from the page.
"""

from __future__ import annotations

import gradio as gr

from analysis.lab.request_order_demo import MAX_DEMO_TOKENS, demo_pool_bytes
from analysis.no_reuse import no_reuse_for
from analysis.prefill_timing import timer_for
from components.panels.common import audience_of, history_refresh, playground_history, totals, warn
from components.panels.live import KEEP_ZOOM, LiveView, cache_figures
from components.session import own_namespace
from components.views.charts import hit_rate_figure, memory_gauge
from components.views.format import fmt_bytes, fmt_figure, fmt_ms, plural
from engine.api import EngineAPI, ServingAPI
from engine.snapshot_view import coarse_tokens
from engine.types import EngineError, RequestMetrics
from engine.visibility import Unit, everyone, own, shipped

MiB = 2**20
HISTORY = 200



def kv_event_rows(engine: EngineAPI) -> list[str]:
    """Remote mode with the server's KV events followed: its blocks held and evicted per medium,
    and how the events came (``RemoteEngine.kv_event_figures``); [] without events."""
    f = engine.kv_event_figures()
    if not f or not f["block_size"]:
        return ["| KV events | followed at " + f["endpoint"] + ", none received yet (the shadow tree is drawn) |"] \
            if f else []
    bs = f["block_size"]

    def n(blocks: int) -> str:  # under isolation, everyone's counts only in whole buckets (as others' tokens)
        return f"{blocks:,}" if not engine.isolation else f"about {coarse_tokens(blocks * bs) // bs:,}"
    rows = [f"| blocks in {medium} | **{n(c['held'])}** held now, {n(c['stored'])} stored, {n(c['evicted'])} "
            f"evicted since this dashboard started ({bs} tokens each; everyone's) |" for medium, c in f["media"].items()]
    checks = f["checks"]
    return rows + [
        f"| KV events | {f['events']:,} events in {f['batches']:,} batches from {f['endpoint']}, block size {bs}; "
        f"{f['replayed']:,} batches replayed, {f['gaps']} gaps, {f['restarts']} server restarts |",
        f"| cached tokens, events vs the server's count | {checks['agree']:,} requests agree, {checks['differ']:,} "
        "differ (the blocks a prompt walked when sent, against what the server reported) |"]
def outside_budget_row(engine: EngineAPI) -> str:
    """The KV the process holds beside the budget: the paired timings' scratch buffers, the no-reuse
    timing's scratch pool, the second
    tier's queue of spills not yet written and the request-order demo's pool, each with its bound.

    Each figure may be another visitor's (a timing's scratch buffer is exactly that visitor's
    prompt): everyone's, so on a public page only in ``HIDDEN_BUCKET_TOKENS`` buckets, as others'
    nodes are; the bounds ship with the deployment."""
    seen = audience_of(engine)
    bpt = engine.info().kv_bytes_per_token

    def held(figure) -> str:
        return fmt_figure(figure, seen)

    timer = timer_for(engine)
    scratch = (f"timing scratch buffers {held(everyone(timer.scratch_bytes, Unit.BYTES))} (at most "
               f"{held(shipped(timer.scratch_bound_bytes, Unit.BYTES))})" if timer is not None else "")
    cold = no_reuse_for(engine)
    no_reuse = (f"no-reuse timing's pool {held(everyone(cold.scratch_bytes, Unit.BYTES))} (at most "
                f"{held(shipped(cold.scratch_bound_bytes, Unit.BYTES))}, one at a time)" if cold is not None else "")
    demo = (f"request-order demo's pool {held(everyone(demo_pool_bytes(engine), Unit.BYTES))} (at most "
            f"{held(shipped(MAX_DEMO_TOKENS * bpt, Unit.BYTES))}, only while a comparison runs)")
    stats = engine.stats()
    spills = (f"spills waiting to be written {held(everyone(stats.tier_queued_bytes, Unit.BYTES))} (at most "
              f"{held(shipped(stats.tier_queue_bound_bytes, Unit.BYTES))})" if stats.tier_queue_bound_bytes else "")
    return f"| KV outside the budget, now | {'; '.join(p for p in (scratch, no_reuse, spills, demo) if p)} |"


def memory_markdown(engine: EngineAPI, mine: list[RequestMetrics] | None = None, viewer: str | None = None) -> str:
    """The cache's state (everyone's, as ``viewer`` may see it: coarse on a public page) and the hit
    rate over ``mine``: the playground's requests, lab runs left out (the visitor's own in isolation
    mode)."""
    s = cache_figures(engine, viewer)
    seen = audience_of(engine)
    history = mine if mine is not None else playground_history(engine)
    cached, prompt = totals(history)
    whose = "your" if engine.isolation else "the playground's"
    timed = [m for m in history if m.baseline_prefill_ms is not None]
    saved_ms = max(0.0, sum(m.baseline_prefill_ms - m.prefill_ms for m in timed))
    used_bytes, budget_bytes = seen.show(s.kv_bytes).value or 0, seen.show(s.budget).value or 0
    used = used_bytes / budget_bytes if budget_bytes else 0.0
    bpt = engine.info().kv_bytes_per_token
    everyone_note = " (everyone's)" if engine.isolation else ""
    rate_row = (f"| token hit rate, {whose} requests | **{cached / prompt if prompt else 0:.1%}** over "
                f"{plural(len(history), 'request')} ({cached:,} of {prompt:,} prompt tokens from the cache; lab runs "
                "not counted) |")
    backend = engine.info().backend
    tokens, nodes = fmt_figure(s.tokens, seen), fmt_figure(s.nodes, seen)
    if not engine.capabilities.local_cache:  # remote mode: the server's memory is its own
        events = kv_event_rows(engine)
        return "\n".join([
            "| cache (remote server) | |", "|---|---|",
            f"| server | {backend} |",
            *(events or [
                "| KV in use · budget · evictions | **unknown** from here (the server's; see its /metrics) |",
                f"| shadow tree (token ids sent) | {tokens} tokens in {nodes} nodes |"]),
            rate_row.replace("from the cache;", "reported cached by the server;"),
        ])
    full = engine.stats()  # the tier's figures are everyone's (in isolation mode it holds shipped content only)
    tier = [] if not full.tier_kind else [
        f"| second tier ({full.tier_kind}) | **{fmt_figure(everyone(full.tier_bytes, Unit.BYTES), seen)}** of "
        f"{fmt_figure(shipped(full.tier_budget_bytes, Unit.BYTES), seen)} in "
        f"{fmt_figure(everyone(full.tier_chunks), seen)} chunks of evicted KV"
        f"{' (shipped content only)' if engine.isolation else ''} |",
        f"| loads vs recomputes | {fmt_figure(everyone(full.tier_loaded_tokens, Unit.TOKENS), seen)} tokens loaded "
        f"back instead of recomputed ({fmt_figure(everyone(full.tier_bytes_read, Unit.BYTES), seen)} read); "
        f"{fmt_figure(everyone(full.tier_spilled_tokens, Unit.TOKENS), seen)} tokens written "
        f"({fmt_figure(everyone(full.tier_bytes_written, Unit.BYTES), seen)}) |"]
    held = [] if engine.isolation else [
        f"| held by the tree (cached prefixes) | {fmt_figure(s.tree_kv, seen)} |",
        f"| held by running requests (their own tokens) | {fmt_figure(s.running_kv, seen)}; cached prefixes are "
        f"read in place, not copied: **{fmt_figure(s.shared, seen)}** cached tokens are read by more than one "
        "request now |"]
    evicted = seen.show(s.evicted).value
    evicted_bytes = fmt_bytes(evicted * bpt) if evicted is not None else "–"
    return "\n".join([
        f"| cache right now{everyone_note} | |", "|---|---|",
        f"| KV in use | **{fmt_figure(s.kv_bytes, seen)}** of {fmt_figure(s.budget, seen)} ({used:.1%}): all the KV "
        "the engine holds |",
        *held,
        *tier,
        f"| tokens cached | **{tokens}** of {budget_bytes // max(bpt, 1):,} that fit |",
        f"| nodes | {nodes} |",
        f"| KV per token | {bpt:,} bytes |",
        outside_budget_row(engine),
        f"| tokens evicted or cleared so far | {fmt_figure(s.evicted, seen)} ({evicted_bytes}; the lab "
        "clears its own runs when they end, and “clear” counts too) |",
        rate_row,
        f"| prefill time saved | {fmt_ms(saved_ms)} over {plural(len(timed), 'request')} that measured prefill "
        "without reuse |",
    ])


def set_budget(engine: EngineAPI, max_mib: float, mib):
    """Apply a new budget (never above ``max_mib``, what the host sized memory for); says what it evicted."""
    if engine.isolation:
        gr.Warning("The cache budget is fixed on a shared deployment.")
        return gr.skip()
    try:
        mib = float(mib)
    except (TypeError, ValueError):
        gr.Warning("Type a budget in MiB, for example 256.")
        return gr.skip()
    mib = max(0.0, min(mib, max_mib))
    before = engine.stats()
    try:
        evicted = engine.set_budget(int(mib * MiB))
    except EngineError as exc:
        warn(exc)
        return gr.skip()
    after = engine.stats()
    seen = audience_of(engine)  # the operator's own page (a public deployment's budget is fixed)
    gr.Info(f"Budget now {fmt_bytes(after.budget_bytes)} (was {fmt_bytes(before.budget_bytes)}). "
            f"Evicted {fmt_figure(everyone(evicted, Unit.TOKENS), seen)} tokens; the cache holds "
            f"{fmt_figure(everyone(after.cached_tokens_now, Unit.TOKENS), seen)} tokens "
            f"({fmt_figure(everyone(after.cache_bytes, Unit.BYTES), seen)}).")
    return round(mib, 1)

def clear_cache(engine: EngineAPI, request: gr.Request | None = None):
    """Clear the visitor's own cached prompts (everything, when the cache is shared); says what it freed."""
    ns = own_namespace(request, engine)
    if engine.isolation and not ns:
        gr.Warning("No session: nothing of yours to clear.")
        return
    freed = engine.clear_cache(namespace=ns)
    after = engine.stats(ns)
    # What the visitor's own clear freed is theirs; what stays is everyone's (coarse on a public page).
    seen = audience_of(engine)
    left = everyone(after.cached_tokens_now, Unit.TOKENS)
    kept = f" {fmt_figure(left, seen)} tokens stay cached (in use or shared)." if left.value else ""
    gr.Info(f"Cleared {fmt_figure(own(freed, Unit.TOKENS), seen)} tokens "
            f"({fmt_figure(own(freed * engine.info().kv_bytes_per_token, Unit.BYTES), seen)} freed).{kept}")


def budget_note(engine: ServingAPI) -> str | None:
    """The budget box's note: what a shrink evicts, in the order the engine's policy says."""
    if engine.isolation:
        return "fixed on a shared public deployment"
    eviction = engine.info().eviction
    return f"shrinking evicts unlocked leaves, {eviction}" if eviction else None


def build_memory_panel(engine: EngineAPI, active: bool = False) -> LiveView:
    budget_mib = engine.stats().budget_bytes / MiB
    with gr.Row():
        with gr.Column(scale=2):
            gauge = gr.Plot(show_label=False)
        with gr.Column(scale=3):
            table = gr.Markdown(memory_markdown(engine, viewer="" if engine.isolation else None))
    hit_rate = gr.Plot(show_label=False, elem_id="hit-rate-plot", elem_classes=[KEEP_ZOOM])
    with gr.Row():
        new_budget = gr.Number(value=round(budget_mib, 1), label="Cache budget (MiB)", minimum=0,
                               maximum=round(budget_mib, 1), precision=1, interactive=not engine.isolation, scale=2,
                               info=budget_note(engine))
        apply = gr.Button("Apply budget", scale=1,
                          interactive=not engine.isolation and engine.capabilities.settable_budget)
        clear = gr.Button("Clear your cached prompts" if engine.isolation else "Clear the cache", variant="stop",
                          scale=1)
    seen = gr.State(None)

    def draw(mine: list[RequestMetrics], ns: str | None) -> tuple:
        title = "Your hit rate over time" if engine.isolation else "Hit rate over time (lab runs not counted)"
        figs = cache_figures(engine, ns)
        gauge_fig = (None if not engine.capabilities.local_cache else
                     memory_gauge(figs.kv_bytes, figs.budget, figs.tree_kv, audience_of(engine)))
        return gauge_fig, memory_markdown(engine, mine, ns), hit_rate_figure(mine[-HISTORY:], title=title,
                                                                             audience=audience_of(engine))

    refresh = history_refresh(engine, draw, 3)

    def redraw(request: gr.Request):
        return refresh(None, request)

    outputs = [gauge, table, hit_rate, seen]
    live = LiveView(gr.Timer(3.0, active=active), refresh, [seen], outputs)
    live.refresh_on(live.timer.tick)
    def apply_budget(mib):
        return set_budget(engine, budget_mib, mib)

    def clear_mine(request: gr.Request):
        clear_cache(engine, request)

    apply.click(apply_budget, new_budget, new_budget, api_visibility="private").then(
        redraw, None, outputs, api_visibility="private", show_progress="hidden")
    clear.click(clear_mine, None, None, api_visibility="private").then(
        redraw, None, outputs, api_visibility="private", show_progress="hidden")
    return live
