"""The dashboard in front of another server: the Engine facade over an OpenAI-compatible HTTP API.

Owns: the facade's surface (submit/run, stats, recent, snapshot, info, text methods), one
thread per request that streams it from the backend (``server.remote.client``: token ids
to ``/v1/completions``, time to first token measured here, cached tokens as the server
reports them), the "without reuse" measurement (the same prompt again under a fresh random
``cache_salt`` and with ``cache_prompt: false``, which no server serves from its cache;
none when it still reports cached tokens), and a *shadow* radix tree (``RadixTree`` with
``None`` values) of the token ids sent, so the tree view has something true to draw: what
this dashboard sent, coloured by what the server said it reused (bounded: past
``shadow_tokens`` the least recently sent leaves go; requests sent with ``store=False`` are
not drawn). The server's own cache may be block-granular and evicts on its own; the shadow
tree cannot see that, and its memory and budget are unknown here (reported as 0 with
``EngineInfo.backend`` set, and the panels say "unknown").

Namespaces become salts: a request's namespace (and an epoch that ``clear_cache`` bumps) is
turned into a ``cache_salt`` with a secret of this process, so visitors stay apart on the
backend too and a cleared namespace starts cold. ``PUBLIC`` sends no salt until cleared.
llama.cpp ignores ``cache_salt``: in front of it visitors share the server's slots.

Where the server publishes its KV events (vLLM, SGLang: ``--kv-events-config``), the tree
drawn is the server's own instead: ``follow_kv_events`` finds the endpoint (``GET
/kv_event_sources``) and a ``server.remote.kv_events.KVEventSubscriber`` keeps a
``server.remote.block_tree.BlockTree`` of the blocks it holds, evictions and media included
(``server.remote.block_view`` draws it, owners by the salted walks of this dashboard's
requests). Each request also records the cached prefix its ids walk down the real blocks when
sent (``cached_tokens_blocks``), next to what the server reported. The shadow tree is then kept
only as the fallback drawn while no events have come.

In front of a router (``--fleet``), ``follow_fleet`` follows every replica's events instead
(``server.remote.fleet.Fleet``): each request takes every replica's match when sent and is
attributed to the replica it landed on once done (off the request's thread), and
``fleet_view`` hands the Fleet tab the replicas' trees side by side.

Tokenizing is local, with the same model's tokenizer, so the ids sent are the ids drawn.
Log-probabilities are not passed through: a request that asks for them is refused with an
``EngineError`` (the API answers 400), never answered without them. Knows nothing about Gradio.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from engine import validation
from engine.api import REMOTE, CachedPrefill, Capabilities, EngineAPI, ScratchPrefill
from engine.facade import FacadeBase
from engine.handle import END_OF_STREAM, RequestHandle
from engine.kvcache.radix_tree import RadixTree
from engine.namespaces import secret_name
from engine.snapshot_view import for_viewer, node_infos, with_text
from engine.text.codec import TextCodec
from engine.types import (
    PUBLIC,
    CacheKey,
    EngineBusy,
    EngineError,
    EngineFault,
    EngineInfo,
    FleetView,
    GenerationEvent,
    GenerationRequest,
    RequestMetrics,
    StepRecord,
    TokenLogprob,
    TreeSnapshot,
)
from engine.visibility import new_request_id
from server.remote.block_tree import BlockTree
from server.remote.block_view import block_snapshot, owners
from server.remote.client import BackendClient, StreamResult
from server.remote.fleet import Fleet
from server.remote.kv_events import EventSource, KVEventSubscriber, discover, parse_override

log = logging.getLogger(__name__)

# The shadow tree keeps at most this many tokens, least recently sent evicted first: a long
# session must not grow it without bound, and a server's own cache rarely holds more (llama.cpp
# with 8 slots of 2,048 tokens holds 16,384). Node count, and so a snapshot's cost, stays bounded too.
DEFAULT_SHADOW_TOKENS = 65_536


@dataclass
class RemoteRequestMetrics(RequestMetrics):
    cached_tokens_reported: bool = True  # False: the server gave no count (cached_tokens reads 0)
    # The prompt's prefix held in the server's own blocks when it was sent, as its KV events
    # said (whole blocks, at most the prompt less its last token); None without events.
    cached_tokens_blocks: int | None = None


class RemoteEngine(FacadeBase):
    """``engine.api.EngineAPI`` over another server (``capabilities``: ``engine.api.REMOTE``)."""

    def __init__(self, base_url: str, model: str, tokenizer, *, api_key: str | None = None, isolation: bool = False,
                 max_queue: int = 32, max_prompt_tokens: int | None = None, max_new_tokens_cap: int = 512,
                 timeout_s: float = 300.0, history_size: int = 1000,
                 shadow_tokens: int = DEFAULT_SHADOW_TOKENS) -> None:
        self.client = BackendClient(base_url, model, api_key, timeout_s)
        self.text = TextCodec(tokenizer)
        self.isolation = isolation
        context = getattr(tokenizer, "model_max_length", 0)
        self.max_context = int(context) if isinstance(context, int) and 0 < context <= 1_000_000 else 8192
        self.max_prompt_tokens = min(max_prompt_tokens or self.max_context, self.max_context)
        self.max_new_tokens_cap = max_new_tokens_cap
        self.max_queue = max_queue
        self.tree = RadixTree()
        self.shadow_tokens = max(1, int(shadow_tokens))  # the shadow tree's bound (LRU beyond it)
        self.cache_reported: bool | None = None  # None until the first answer says
        self._secret = secrets.token_bytes(16)
        self._epochs: dict[str | None, int] = {}
        self._lock = threading.RLock()
        self._in_flight = 0
        self._version = 0  # bumped by every record and clear (the panels' change counter)
        self._start_records(history_size, self._lock)
        self.blocks = BlockTree()  # the server's own blocks, while its KV events flow
        self.events: KVEventSubscriber | None = None
        self._salts: dict[int, str | None] = {}  # request id -> the cache_salt it was sent with
        self.block_checks = {"agree": 0, "differ": 0}  # cached_tokens_blocks vs the server's count
        self._owners_memo: tuple = ((), {}, {})
        self.fleet: Fleet | None = None  # the replicas behind a router (follow_fleet)

    # ---------------------------------------------------------------- requests
    def submit(self, request: GenerationRequest) -> RequestHandle:
        ids = self.prompt_ids(request)
        request = dataclasses.replace(request, sampling=validation.check_sampling(request.sampling))
        validation.check_logprobs(request)
        if (request.logprobs or 0) > 0 or request.prompt_logprobs is not None:
            # Said, never dropped: a client comparing runs must not get an answer without them.
            raise EngineError("In remote mode only each chosen token's log-probability is passed through from the "
                              "backend (logprobs 0): no alternatives and no prompt logprobs. Ask the backend "
                              "server for them directly.")
        with self._lock:
            if self._in_flight >= self.max_queue:
                raise EngineBusy("The engine is busy: too many requests are waiting. Please try again in a moment.")
            self._in_flight += 1
        handle = RequestHandle(request, ids)
        threading.Thread(target=self._work, args=(handle,), name="remote-request", daemon=True).start()
        return handle

    def _work(self, handle: RequestHandle) -> None:
        try:
            for event in self._run(handle):
                handle.events.put(event)
        except EngineError as exc:
            handle.events.put(exc)
        except Exception as exc:  # never a traceback for a visitor; one line in the log
            log.exception("remote request failed")
            handle.events.put(EngineFault(f"The request to the backend failed: {type(exc).__name__}: {exc}"[:300]))
        finally:
            with self._lock:
                self._in_flight -= 1
            handle.events.put(END_OF_STREAM)

    def _salt(self, namespace: str) -> str | None:
        with self._lock:
            epoch = self._epochs.get(namespace, 0) + self._epochs.get(None, 0)
        if namespace == PUBLIC and epoch == 0:
            return None
        return secret_name("radix-", self._secret, f"{namespace}#{epoch}", 24)

    def _run(self, handle: RequestHandle) -> Iterator[GenerationEvent]:
        req, ids = handle.request, handle.ids
        # At least one: the backend computes the prompt's last token either way (its answer counts it).
        max_new = max(1, validation.new_token_limit(req.sampling.max_new_tokens, self.max_new_tokens_cap,
                                                    self.max_context - len(ids)))
        salt = self._salt(req.namespace)
        blocks_cached = self._blocks_cached(ids, salt)
        pending = self.fleet.before(ids, salt) if self.fleet is not None else None
        result = yield from self.client.stream(ids, req.sampling, max_new, salt, handle.cancelled,
                                               logprobs=req.logprobs)
        if pending is not None and self.fleet is not None:
            self.fleet.finished(pending)  # the replicas' counters now, before this session's next request
        if req.logprobs is not None and result.finish != "cancelled" and (
                result.logprobs is None or len(result.logprobs) != len(result.token_ids)):
            raise EngineError("The backend returned no log-probabilities for every token (it needs "
                              "'logprobs' on /v1/completions and 'return_token_ids'), so none can be shown.")
        baseline_ms = None
        if req.measure_baseline and not handle.cancelled.is_set():
            # Without reuse: the same prompt under a salt nobody has used, so no server has it cached.
            cold = self.client.stream(ids, req.sampling, 1, "cold-" + secrets.token_hex(12), handle.cancelled,
                                      cold=True)
            while True:
                try:
                    next(cold)
                except StopIteration as done:
                    reused = done.value.usage.cached_tokens if done.value.usage else None
                    # A "cold" run the server still served from its cache measures nothing: say so (None).
                    baseline_ms = done.value.ttft_ms if not reused else None
                    break
        metrics = self._record(req, ids, result, baseline_ms, salt, blocks_cached)
        if pending is not None and self.fleet is not None:  # attributed once its replica's events come
            threading.Thread(target=self.fleet.settle, name="fleet-attribution", daemon=True,
                             args=(pending, metrics.request_id, metrics.output_ids,
                                   metrics.cached_tokens if result.usage is not None
                                   and result.usage.cached_tokens is not None else None, req.namespace)).start()
        yield GenerationEvent(text=result.text, done=True, metrics=metrics)

    def _blocks_cached(self, ids: list[int], salt: str | None) -> int | None:
        """The prompt's prefix the server holds now, by its events (None: no events). Like vLLM,
        whole blocks only, and never the prompt's last token (it is always computed)."""
        if self.events is None or not self.events.synced:
            return None
        bs = self.blocks.block_size
        if not bs:  # nothing stored since the server started: nothing cached
            return 0
        return min(len(self.blocks.match(ids, salt)) * bs, (len(ids) - 1) // bs * bs)

    def _record(self, req: GenerationRequest, ids: list[int], res: StreamResult, baseline_ms: float | None,
                salt: str | None = None, blocks_cached: int | None = None) -> RequestMetrics:
        reported = res.usage is not None and res.usage.cached_tokens is not None
        cached = min(res.usage.cached_tokens, len(ids)) if reported else 0
        # The shadow tree holds what a server could have cached for the next request: the prompt
        # and the answer's tokens whose KV it computed (all of them when it stopped on its own).
        out_ids = list(res.token_ids) if res.token_ids else (self.text.encode(res.text) if res.text else [])
        kept = out_ids if res.finish == "stop" else out_ids[:-1]
        key = CacheKey(tuple(ids) + tuple(kept), req.namespace, 0)
        with self._lock:
            existing = len(key.ids)
            if req.store:  # store=False: nobody could reuse it (an unsalted API call), so nothing is drawn
                # Prompt first, then prompt plus answer, as the local engine inserts them (same node splits).
                existing = self.tree.insert(key.prefix(len(ids)), [None] * len(ids)).existing
                self.tree.insert(key, [None] * len(key.ids))
            path = self.tree.match(CacheKey(tuple(ids[:cached]), req.namespace, 0), touch=False).path if cached else []
            if self.tree.num_tokens > self.shadow_tokens:  # least recently sent first; the server evicts on its own
                self.tree.evict(self.tree.num_tokens - self.shadow_tokens)
            self.cache_reported = reported if self.cache_reported is None else (self.cache_reported and reported)
            rid = new_request_id()  # random: a visitor's ids count nobody else's requests
            self._version += 1
            self._salts[rid] = salt
            if len(self._salts) > 2 * self.history.maxlen:  # as long as the history, give or take
                for old in list(self._salts)[:len(self._salts) - self.history.maxlen]:  # oldest first
                    del self._salts[old]
            if blocks_cached is not None and reported:
                self.block_checks["agree" if blocks_cached == cached else "differ"] += 1
            m = RemoteRequestMetrics(
                request_id=rid, tag=req.tag, namespace=req.namespace, prompt_tokens=len(ids), cached_tokens=cached,
                computed_tokens=len(ids) - cached, prefill_ms=res.ttft_ms, baseline_prefill_ms=baseline_ms,
                ttft_ms=res.ttft_ms, queue_ms=0.0, decode_tokens_per_s=res.decode_tokens_per_s,
                output_tokens=(res.usage.completion_tokens if res.usage and res.usage.completion_tokens is not None
                               else len(out_ids)),
                finish_reason=res.finish, cache_bytes=0, cache_budget_bytes=0, evicted_tokens=0,
                inserted_tokens=len(key.ids) - existing, matched_path=list(path), prompt_ids=list(ids),
                output_ids=list(out_ids), output_text=res.text, finished_at=time.time(),
                cached_tokens_reported=reported, cached_tokens_blocks=blocks_cached,
                output_logprobs=(None if req.logprobs is None or res.logprobs is None else
                                 [TokenLogprob(t, lp) for t, lp in zip(res.token_ids, res.logprobs, strict=False)]))
            return self._add_record(m)

    # ------------------------------------------------------------- state
    def snapshot(self, viewer: str | None = None) -> TreeSnapshot:
        """The server's own blocks while its KV events flow (``origin`` "events"), else the shadow
        tree (``origin`` "shadow"); plain data, no bytes (the server's memory is unknown here). In
        isolation mode ``viewer`` sees others' nodes exactly as the local engine shows them
        (``engine.snapshot_view.for_viewer``: one coarse "others" node per subtree, no text,
        hits or times); of the server's blocks a visitor sees only those their own requests walk
        through (``server.remote.block_view``)."""
        view = self._view(viewer)
        return dataclasses.replace(view, nodes=with_text(view.nodes, self.decode, 256))

    def _matched_len(self, key: CacheKey) -> int:
        """What this dashboard knows: the shadow tree's match of what it sent under ``key``'s
        namespace. The server's own cache may hold less (it evicts on its own) or, block by
        block, differ; it says what it reused only in each answer's ``cached_tokens``."""
        with self._lock:
            return self.tree.match(key, touch=False).length

    def _view(self, viewer: str | None) -> TreeSnapshot:
        """The tree as ``viewer`` may see it, without text (the structure copied under the lock)."""
        if self.events_active:
            owner, hits = self._owners()
            full = block_snapshot(self.blocks, owner, hits)
        else:
            with self._lock:
                full = TreeSnapshot(tuple(node_infos(self.tree, time.monotonic(), 0)), self.tree.num_tokens, 0, 0, 0,
                                    0, 0, origin="shadow")
        return for_viewer(full, viewer) if viewer is not None and self.isolation else full

    def _owners(self):
        """Who owns each held block (``block_view.owners``), recomputed when the blocks or the
        history changed: every recorded request's prompt and answer, walked under its salt."""
        key = (self.blocks.version, self.version())
        if self._owners_memo[0] == key:
            return self._owners_memo[1], self._owners_memo[2]
        with self._lock:
            walks = [(m.namespace, list(m.prompt_ids) + list(m.output_ids), self._salts.get(m.request_id))
                     for m in self.recent()]
        owner, hits = owners(self.blocks, walks)  # oldest first: a later walk wins a shared block
        self._owners_memo = (key, owner, hits)
        return owner, hits

    # ------------------------------------------------------------- KV events
    def follow_kv_events(self, setting: str = "") -> EventSource | None:
        """Follow the server's KV events: ``setting`` "" asks ``GET /kv_event_sources``, "off"
        turns them off, an endpoint (``tcp://host:port[,tcp://host:replay_port][,topic=NAME]``)
        overrides. Returns the source followed (None: the shadow tree is drawn)."""
        try:
            choice = parse_override(setting)
        except ValueError as exc:
            raise EngineError(f"--backend-kv-events: {exc}") from None
        if choice is None:
            return None
        source = discover(self.client._get_json, self.base_url) if choice is True else choice
        if source is None:
            return None
        self.events = KVEventSubscriber(source, self.blocks).start()
        log.info("Following the backend's KV events at %s (replay %s, topic %r)", source.endpoint,
                 source.replay_endpoint or "none", source.topic)
        return source

    def follow_fleet(self, urls: list[str], api_key: str | None = None) -> list[EventSource | None]:
        """Follow the events of every replica behind the router (``--fleet URL,...``), each found
        through its own ``GET /kv_event_sources``; returns the sources (None: a replica without)."""
        self.fleet = Fleet(urls, api_key)
        return self.fleet.follow()

    def fleet_view(self, viewer: str | None = None) -> FleetView | None:
        """Every replica's tree (as ``viewer`` may see it, owners by this dashboard's walks, text
        decoded), where the last requests landed (under isolation, ``viewer``'s own only), the
        duplication; None without ``--fleet``."""
        if self.fleet is None:
            return None
        with self._lock:
            walks = [(m.namespace, list(m.prompt_ids) + list(m.output_ids), self._salts.get(m.request_id))
                     for m in self.recent()]

        def snapshot_of(tree: BlockTree) -> TreeSnapshot:
            owner, hits = owners(tree, walks)
            snap = block_snapshot(tree, owner, hits)
            if viewer is not None and self.isolation:
                snap = for_viewer(snap, viewer)
            return dataclasses.replace(snap, nodes=with_text(snap.nodes, self.decode, 256))

        private = viewer is not None and self.isolation  # a visitor lists only their own requests
        return self.fleet.view(snapshot_of, lambda q: not private or q.namespace == viewer)

    @property
    def events_active(self) -> bool:
        """True once the server's events have described its cache (the real tree is drawn)."""
        return self.events is not None and self.events.stats.batches > 0 and self.blocks.block_size > 0

    def kv_event_figures(self) -> dict:
        """Blocks held, stored and evicted per medium, the subscriber's counters (``{}`` when
        no events are followed)."""
        if self.events is None:
            return {}
        st = self.events.stats
        return {"endpoint": self.events.source.endpoint, "block_size": self.blocks.block_size,
                "media": self.blocks.counts(), "batches": st.batches, "events": st.events, "replayed": st.replayed,
                "gaps": st.gaps, "lost": st.lost, "restarts": st.restarts, "decode_errors": st.decode_errors,
                "rejected": st.rejected,
                "last_event_at": st.last_event_at, "checks": dict(self.block_checks), "alive": self.events.alive,
                "active": self.events_active}

    def _cache_figures(self) -> dict[str, object]:
        """The server's blocks (while its events flow) or the shadow tree, as ``stats`` reports them:
        its memory and budget are unknown here (0). ``queue_depth`` is what waits in this process to
        start: nothing (each request goes to the server at once); what the server runs or queues is
        ``running`` here, as one figure. A viewer's stats follow the local engine's rule
        (``engine.facade``): totals over their own requests, the figures their ``snapshot`` gives."""
        if self.events_active:
            view = self._view(None)
            with self._lock:
                return dict(cache_bytes=0, budget_bytes=0, cached_tokens_now=view.num_tokens,
                            num_nodes=len(view.nodes), evicted_tokens=view.evicted_tokens, queue_depth=0,
                            running=self._in_flight)
        with self._lock:
            return dict(cache_bytes=0, budget_bytes=0, cached_tokens_now=self.tree.num_tokens,
                        num_nodes=self.tree.num_nodes, evicted_tokens=0, queue_depth=0, running=self._in_flight)

    def _waiting(self) -> int:
        return 0  # each request goes to the server at once

    def step_log(self, n: int | None = None) -> list[StepRecord]:
        """The backend schedules its own forwards: there are none of this app's to show."""
        return []

    @property
    def capabilities(self) -> Capabilities:
        return REMOTE

    def version(self) -> int:
        with self._lock:
            return self._version + self.blocks.version + (sum(self.fleet.signature()) if self.fleet else 0)

    def info(self) -> EngineInfo:
        return EngineInfo(model_name=self.model, device="remote", dtype="unknown", num_layers=0, num_kv_heads=0,
                          head_dim=0, kv_bytes_per_token=0, max_context=self.max_context, cache_enabled=True,
                          isolation=self.isolation, backend=self.base_url, backend_model=self.model,
                          cache_reported=self.cache_reported)

    def clear_cache(self, namespace: str | None = None) -> int:
        """Forget a namespace here and start it cold on the server: its next requests carry a
        new salt (the server's old entries age out on its own). Returns shadow tokens dropped."""
        with self._lock:
            before = self.tree.num_tokens
            self._epochs[namespace] = self._epochs.get(namespace, 0) + 1
            self.tree.clear(namespace)
            self._version += 1
            return before - self.tree.num_tokens

    def set_budget(self, budget_bytes: int) -> int:
        raise EngineError("The backend sizes its own cache: its budget cannot be set from this dashboard.")

    def check_invariants(self) -> None:
        with self._lock:
            self.tree.check_invariants()
        self.blocks.check_invariants()

    def spawn(self, budget_bytes: int, max_batch: int = 1, max_queue: int = 64) -> EngineAPI:
        raise EngineError("Not available in remote mode: this demo runs a small engine of its own on the local "
                          "model.")

    def configure_scheduler(self, **changes) -> None:
        raise EngineError("The backend schedules its own requests: its scheduler cannot be set from here.")

    def scratch_prefill(self, key: CacheKey, reuse_tokens: int = 0, block_tokens: int = 512,
                        before_block: Callable[[], None] | None = None) -> ScratchPrefill:
        raise EngineError("Not available in remote mode: the backend's prefill cannot be run apart from its cache "
                          "(a request's no-reuse figure is measured under a fresh cache salt instead).")

    def cache_prefill(self, key: CacheKey) -> CachedPrefill:
        raise EngineError("Not available in remote mode: the backend caches what its requests leave.")

    def persist_cache(self) -> int | None:
        """The backend keeps its own cache: nothing is written here."""
        return None

    def backend_metrics(self) -> dict[str, float]:
        return self.client.metrics()

    def healthy(self) -> bool:
        """The backend answers its health check now (``BackendClient.healthy``)."""
        return self.client.healthy()

    def check_backend(self) -> None:
        self.client.check()
        if self.isolation and self.salts_ignored:
            log.warning("The backend at %s is llama.cpp, which ignores cache_salt: visitors share its slots, so one "
                        "visitor's prompt can show as cached tokens (and a faster first token) in another's. "
                        "Isolation holds in this dashboard's tree only.", self.base_url)

    @property
    def salts_ignored(self) -> bool:
        """True when the backend is known to ignore ``cache_salt`` (llama.cpp's server)."""
        return self.client.owned_by == "llamacpp"

    @property
    def model(self) -> str:
        return self.client.model

    @property
    def base_url(self) -> str:
        return self.client.base_url

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """``ControlAPI.shutdown``: nothing runs here but the clients, which ``close`` ends."""
        try:
            self.close()
        except Exception as exc:  # best effort: one line, never a traceback
            log.warning("while stopping: %s: %s", type(exc).__name__, exc)

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
        if self.fleet is not None:
            self.fleet.close()
        self.client.close()
