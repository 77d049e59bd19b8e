"""``GET /metrics``: the engine's numbers in Prometheus text format (``prometheus_client``).

Owns: one registry per app (never the global one, so tests can build several apps), the
metric names, and reading the engine at scrape time:

- counters mirrored from ``engine.stats()`` running totals: prefix-cache queries and hits
  in tokens (as vLLM's ``vllm:prefix_cache_queries_total`` / ``..._hits_total``, under this
  project's ``radix_`` prefix), requests, evicted tokens;
- gauges: requests running and waiting, cache bytes, budget and tokens now;
- histograms of time to first token (from arrival, as vLLM counts it, so queueing shows;
  a request cancelled before its first token has none and is not observed), time in the
  queue (arrival to admission, as vLLM's ``request_queue_time_seconds``) and prefill time,
  observed from each finished request's metrics (``engine.recent()``, read by request id at each scrape, so the page's
  requests and the API's count alike; a scrape that comes after more than the history's
  length of requests misses the oldest of them).

A value the engine cannot know (a remote backend's memory) is left out, not guessed. In remote
mode, with the backend's KV events followed, its blocks per medium (``radix_backend_kv_blocks``)
and the events applied (``radix_backend_kv_events_total``) are what its events said.
Who may scrape it is ``server.exposure``'s rule (on a public deployment, the operator only).
Knows nothing about the UI or the API's requests.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.routing import BaseRoute, Route

from engine.api import FiguresAPI
from server.exposure import NOT_HERE, ServerReadRule

PREFIX = "radix"
TTFT_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                  80.0)
PREFILL_BUCKETS_S = TTFT_BUCKETS_S

# Field names the engine's stats may use for running and waiting requests (a batching
# scheduler reports both; a one-at-a-time engine only its queue depth).
RUNNING_FIELDS = ("num_running", "running_requests", "running")
WAITING_FIELDS = ("num_waiting", "waiting_requests", "waiting", "queue_depth")


def _first(obj: object, names: tuple[str, ...]) -> float | None:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None


class _StatsCollector(Collector):
    """Counters and gauges read from ``engine.stats()`` when scraped."""

    def __init__(self, get_engine: Callable[[], FiguresAPI | None]) -> None:
        self.get_engine = get_engine

    def collect(self) -> Iterator[Metric]:
        engine = self.get_engine()
        if engine is None:
            return
        stats = engine.stats()
        counters = (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prompt_tokens"),
            ("prefix_cache_hits", "Prompt tokens served from the prefix cache.", "cached_tokens"),
            ("requests", "Requests finished.", "requests"),
            ("evicted_tokens", "Tokens evicted from the prefix cache.", "evicted_tokens"),
            ("tier_loaded_tokens", "Tokens loaded back from the second tier instead of recomputed.",
             "tier_loaded_tokens"),
            ("tier_spilled_tokens", "Tokens written to the second tier.", "tier_spilled_tokens"),
            ("tier_read_bytes", "Bytes read back from the second tier.", "tier_bytes_read"),
            ("tier_written_bytes", "Bytes written to the second tier.", "tier_bytes_written"),
        )
        for name, doc, field in counters:
            value = _first(stats, (field,))
            if value is not None:
                yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        gauges = (
            ("num_requests_running", "Requests running now.", RUNNING_FIELDS),
            ("num_requests_waiting", "Requests waiting for the model.", WAITING_FIELDS),
            ("cache_bytes", "Bytes of KV held in the pool: the tree's and running requests' own.", ("cache_bytes",)),
            ("kv_tree_bytes", "Bytes of KV held by the radix tree (cached prefixes).", ("tree_bytes",)),
            ("kv_running_bytes", "Bytes of KV held by running requests themselves (not shared).", ("running_bytes",)),
            ("tier_bytes", "Bytes of KV kept in the second tier (disk or host memory).", ("tier_bytes",)),
            ("tier_budget_bytes", "The second tier's budget in bytes.", ("tier_budget_bytes",)),
            ("kv_shared_tokens", "Cached tokens read by more than one running request now.", ("shared_tokens",)),
            ("cache_budget_bytes", "The prefix cache's budget in bytes.", ("budget_bytes",)),
            ("cache_tokens", "Tokens held by the prefix cache.", ("cached_tokens_now",)),
        )
        for name, doc, fields in gauges:
            value = _first(stats, fields)
            if value is not None:
                yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        yield from _backend_kv(engine)
        if stats.kv_events_dropped_batches is not None:  # this engine's own publisher (``--kv-events-config``)
            yield CounterMetricFamily(f"{PREFIX}_kv_events_dropped_batches", "KV-event batches dropped because the "
                                      "sending thread was behind (subscribers see a gap).",
                                      value=stats.kv_events_dropped_batches)


def _backend_kv(engine: FiguresAPI) -> Iterator[Metric]:
    """Remote mode, while the backend's KV events are followed (``RemoteEngine.kv_event_figures``):
    the blocks it holds per medium, and the events and blocks counted since this app started."""
    figures = engine.kv_event_figures()
    if not figures:
        return
    blocks = GaugeMetricFamily(f"{PREFIX}_backend_kv_blocks", "Blocks the backend holds now, by its KV events.",
                               labels=["medium"])
    stored = CounterMetricFamily(f"{PREFIX}_backend_kv_blocks_stored", "Blocks the backend stored (KV events).",
                                 labels=["medium"])
    evicted = CounterMetricFamily(f"{PREFIX}_backend_kv_blocks_evicted",
                                  "Blocks the backend removed or cleared (KV events).", labels=["medium"])
    for medium, c in figures["media"].items():
        blocks.add_metric([medium], c["held"])
        stored.add_metric([medium], c["stored"])
        evicted.add_metric([medium], c["evicted"])
    yield from (blocks, stored, evicted)
    yield CounterMetricFamily(f"{PREFIX}_backend_kv_events", "KV events applied from the backend (live or replayed).",
                              value=figures["events"])
    yield CounterMetricFamily(f"{PREFIX}_backend_kv_event_gaps", "Times the backend's event sequence skipped ahead "
                              "(filled from its replay endpoint).", value=figures["gaps"])
    yield CounterMetricFamily(f"{PREFIX}_backend_kv_batches_rejected", "Event batches from the backend not applied "
                              "(malformed, or failed to apply); the subscriber goes on.",
                              value=figures.get("rejected", 0))


class EngineMetrics:
    """The registry for one app and the histograms fed from finished requests."""

    def __init__(self, get_engine: Callable[[], FiguresAPI | None]) -> None:
        self.get_engine = get_engine
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_StatsCollector(get_engine))
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "Time to first token per request, from arrival (queueing included).",
                              buckets=TTFT_BUCKETS_S, registry=self.registry)
        self.queue = Histogram(f"{PREFIX}_request_queue_time_seconds",
                               "Time per request from arrival to admission by the scheduler.",
                               buckets=TTFT_BUCKETS_S, registry=self.registry)
        self.prefill = Histogram(f"{PREFIX}_prefill_seconds", "Prefill time per request (match, copy, forward).",
                                 buckets=PREFILL_BUCKETS_S, registry=self.registry)
        self.generated = Counter(f"{PREFIX}_generation_tokens", "Tokens generated.", registry=self.registry)
        self._seen: set[int] = set()  # request ids in the history at the last scrape
        self._lock = threading.Lock()

    def sync(self) -> None:
        """Observe every request finished since the last scrape."""
        engine = self.get_engine()
        if engine is None:
            return
        with self._lock:
            history = engine.recent()
            for m in history:  # requests may finish out of id order: compare sets, not a high-water mark
                if m.request_id in self._seen:
                    continue
                if m.ttft_ms is not None:  # None: cancelled before its first token
                    self.ttft.observe(m.ttft_ms / 1000)
                if m.queue_ms is not None:
                    self.queue.observe(max(0.0, m.queue_ms) / 1000)
                if m.prefill_ms is not None:
                    self.prefill.observe(m.prefill_ms / 1000)
                self.generated.inc(m.output_tokens)
            self._seen = {m.request_id for m in history}

    def text(self) -> bytes:
        self.sync()
        return generate_latest(self.registry)


def metrics_routes(metrics: EngineMetrics, rule: ServerReadRule | None = None) -> list[BaseRoute]:
    """``GET /metrics``, for whoever ``rule`` (``server.exposure``) lets read server-wide figures;
    None: everyone (a private deployment)."""
    async def scrape(request: Request) -> Response:
        from starlette.concurrency import run_in_threadpool

        if rule is not None and not rule.allows(request.headers):
            return JSONResponse({"detail": NOT_HERE}, status_code=404)
        return Response(await run_in_threadpool(metrics.text), media_type=CONTENT_TYPE_LATEST)

    return [Route("/metrics", scrape, methods=["GET"])]
