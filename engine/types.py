"""Plain data the engine hands out: requests, events, metrics, snapshots.

The UI, the replay CLI and the tests read only these; none of them ever sees a
tree node or a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The shared namespace: shipped content every visitor may hit (``CacheKey`` below).
PUBLIC = ""


@dataclass(frozen=True)
class CacheKey:
    """Token ids plus the namespace they are cached under (see module docstring)."""

    ids: tuple[int, ...]
    namespace: str = PUBLIC
    public_len: int = 0

    def ns_at(self, pos: int) -> str:
        return PUBLIC if pos < self.public_len else self.namespace

    def ns_end(self, pos: int) -> int:
        """First position after ``pos`` whose namespace differs from ``ns_at(pos)``."""
        if pos < self.public_len and self.namespace != PUBLIC:
            return min(self.public_len, len(self.ids))
        return len(self.ids)

    def prefix(self, n: int) -> CacheKey:
        return CacheKey(self.ids[:n], self.namespace, self.public_len)




class EngineError(ValueError):
    """Bad input or an impossible request; the message is meant for a person."""


class EngineBusy(EngineError):
    """The request queue is full."""


class EngineFault(EngineError):
    """The server failed (a bug, out of memory), not the request: the HTTP side answers
    500 ``server_error`` for it (503 for ``EngineBusy``), never 400."""


class OutOfMemoryFault(EngineFault):
    """A forward ran out of device memory. The scheduler then runs that forward's requests one
    by one, so only a request that fails alone fails."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    # Loop guards (deterministic, so reuse still cannot change an answer): a token that
    # would complete an n-gram already in the answer is never picked (0 = off), and
    # tokens already in the answer have their logits divided (>1) as in CTRL / HF.
    no_repeat_ngram_size: int = 0
    repetition_penalty: float = 1.0
    # Past the model's end-of-sequence token until max_new_tokens (vLLM's ``ignore_eos``): for
    # benchmarks, so that every server compared does the same amount of work.
    ignore_eos: bool = False


@dataclass(frozen=True)
class GenerationRequest:
    """Exactly one of ``messages`` (chat template applied, generation prompt
    added), ``prompt`` (raw text, tokenized as is) or ``prompt_ids``.

    ``namespace`` and ``public_len`` are set by the server, never by a visitor:
    the first ``public_len`` tokens are content shipped with the app and may be
    shared; the rest is cached under ``namespace`` only.
    """

    messages: tuple[dict, ...] | None = None
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # The caller will compare this prefill with a no-reuse one. The local engine ignores it (the
    # request packs like any other; ``analysis/no_reuse.py`` times the other side after the
    # answer); a remote engine sends the prompt again under a fresh cache salt.
    measure_baseline: bool = False
    namespace: str = PUBLIC
    public_len: int = 0
    tag: str = ""  # free label shown in the history (e.g. "chat", "few-shot")
    store: bool = True  # False: nothing of this request is kept in the cache (nobody could reuse it)
    # Log-probabilities (``TokenLogprob``), computed only for requests that ask: ``logprobs`` k
    # gives each generated token's with its k most likely alternatives (0 to 20); ``prompt_logprobs``
    # k gives every prompt token's from the second on (the prompt is then computed whole, reusing
    # no cached prefix: a cached token's logits were never computed by this request). None: off.
    logprobs: int | None = None
    prompt_logprobs: int | None = None


@dataclass
class RequestMetrics:
    request_id: int
    tag: str
    namespace: str
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    prefill_ms: float
    # The same prompt prefilled with no reuse: None as the local engine returns it (the analysis
    # fills it in, ``analysis/no_reuse.py``); the remote engine's own figure where it measured one.
    baseline_prefill_ms: float | None
    ttft_ms: float | None  # from arrival (queue_ms included); None: cancelled before its first token
    queue_ms: float  # arrival to admission
    decode_tokens_per_s: float | None
    output_tokens: int
    finish_reason: str  # "stop", "length" or "cancelled"
    cache_bytes: int
    cache_budget_bytes: int
    evicted_tokens: int  # running total for the engine
    inserted_tokens: int
    matched_path: list[int]
    prompt_ids: list[int]
    output_ids: list[int]
    output_text: str
    finished_at: float = 0.0
    # How the request ran under the batching scheduler: the largest and mean number of
    # requests in the decode forwards it took part in, how many prefill chunks its prompt
    # took, and whether any of its prefill chunks shared a forward with other requests
    # (then ``prefill_ms`` includes their work and reads high); ``measure_baseline`` does not change
    # that (the chat's card uses the paired timing, ``analysis/prefill_timing.py``, instead).
    batch_size_max: int = 1
    batch_size_mean: float = 1.0
    prefill_chunks: int = 1
    prefill_shared_step: bool = False
    # Of ``cached_tokens``, how many were loaded back from the second tier (disk or host memory)
    # instead of being found in the pool, and what loading them cost (inside ``prefill_ms``).
    tier_tokens: int = 0
    tier_load_ms: float = 0.0
    # One per streamed output token (``output_ids`` minus a final eos), where the request asked
    # for ``logprobs``; None otherwise. Prompt logprobs come only on the events (they can be long).
    output_logprobs: list[TokenLogprob] | None = None

    @property
    def speedup(self) -> float | None:
        if self.baseline_prefill_ms is None or self.prefill_ms <= 0:
            return None
        return self.baseline_prefill_ms / self.prefill_ms


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability where it stands: the log-softmax, in float32 over the whole
    vocabulary, of the very logits row the next token was sampled from (before the loop guards
    and the temperature: the model's own distribution), and the ``top`` most likely tokens of
    that row as ``(token_id, logprob)``, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class GenerationEvent:
    """One streamed step. ``text`` is the whole output so far; the last event
    has ``done`` set and carries the metrics."""

    text: str
    token_id: int | None = None
    done: bool = False
    metrics: RequestMetrics | None = None
    # Where the request is: "queued" (``queue_ahead`` requests before it), "prefill"
    # (``prefilled_tokens`` of ``prompt_tokens`` done, ``cached_tokens`` of them reused),
    # "decode" or "done". Progress events
    # carry no token (``token_id`` None) and the text so far.
    phase: str = "decode"
    queue_ahead: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    # With ``GenerationRequest.logprobs``: this token's (``token_id``'s) log-probability.
    logprob: TokenLogprob | None = None
    # With ``GenerationRequest.prompt_logprobs``: once, on the progress event that ends the prefill
    # (before any token), one entry per prompt token; the first is None (nothing comes before it).
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclass(frozen=True)
class StepRecord:
    """One forward the scheduler ran: prefill chunks and decode tokens of several requests
    packed together. Steps group forwards: a step runs the prefills that must run alone
    (``prompt_logprobs``: only a lone chunk keeps every position's logits), then one packed forward."""

    step_id: int
    kind: str  # "prefill", "decode" or "mixed" (prefill chunks packed with decodes)
    request_ids: tuple[int, ...]
    namespaces: tuple[str, ...]
    batch_size: int
    computed_tokens: int  # tokens run through the model
    cached_tokens: int  # prompt tokens served from the cache (on a request's first chunk)
    duration_ms: float
    finished_at: float  # time.time()
    running: int = 0  # requests admitted after this forward
    waiting: int = 0
    prefill_request_ids: tuple[int, ...] = ()  # those of ``request_ids`` that ran a prefill chunk


@dataclass(frozen=True)
class NodeInfo:
    node_id: int
    parent_id: int  # 0 is the root
    num_tokens: int
    depth_tokens: int  # tokens from the root to the end of this node
    num_bytes: int
    lock_ref: int
    hits: int
    last_access_s_ago: float
    namespace: str
    hidden: bool  # another visitor's private node: shape and size only
    token_ids: tuple[int, ...]
    text: str
    # In the second tier (disk or host memory), not in the pool: a stretch evicted whole chunks at
    # a time, loaded back by the next request that needs it. Never counted in the pool's tokens.
    spilled: bool = False


@dataclass(frozen=True)
class TreeSnapshot:
    nodes: tuple[NodeInfo, ...]
    num_tokens: int
    num_bytes: int
    budget_bytes: int
    capacity_tokens: int
    evicted_tokens: int
    bytes_per_token: int
    tier_kind: str = ""  # where ``spilled`` nodes' KV is: "disk", "host memory" or "" (no second tier)
    # remote mode: "events" (the server's own blocks, from its KV events), "shadow" (the ids this
    # dashboard sent; servers without events); "" for this process's own cache
    origin: str = ""


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    device: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_bytes_per_token: int
    max_context: int
    cache_enabled: bool
    isolation: bool
    linear_kernels: str = ""  # how the model's linear layers multiply ("" when unknown, e.g. remote)
    forward: str = ""  # what runs the scheduler's forward, in words ("" when unknown, e.g. remote)
    plan: str = ""  # the execution plan's summary line, "layers=... linear=... attention=..." ("" when unknown)
    attention: str = ""  # the attention kernel serving reads the pool with, in words ("" when unknown)
    isa: str = ""  # the instruction set our C kernels are built for, in words (RADIX_ISA; "" when none run)
    backend: str = ""  # remote mode: the server's URL (memory, budget and KV geometry unknown here)
    backend_model: str = ""  # remote mode: the model name the server serves
    cache_reported: bool | None = None  # remote mode: does the server report cached tokens (None: not yet known)
    eviction: str = ""  # the order the cache evicts in, in words (``EvictionPolicy.describe()``; "" when unknown)


@dataclass(frozen=True)
class EngineStats:
    requests: int
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    prefill_ms: float
    cache_bytes: int
    budget_bytes: int
    cached_tokens_now: int
    num_nodes: int
    evicted_tokens: int
    queue_depth: int  # requests submitted to this process and not started yet (0 remotely: sent at once)
    locked_tokens: int = 0  # cached tokens pinned by running requests right now
    running: int = 0  # requests admitted by the scheduler (prefill or decode)
    waiting: int = 0  # requests not admitted yet (same as queue_depth)
    tokens_per_s: float = 0.0  # output tokens per second, all requests, over the last seconds
    max_batch: int = 1
    running_bytes: int = 0  # pool bytes held by running requests themselves (their computed KV and room for it)
    tree_bytes: int = 0  # pool bytes held by the tree (cached KV, some of it read by running requests)
    shared_tokens: int = 0  # cached tokens read by more than one running request right now
    tier_bytes: int = 0  # the second tier: bytes kept (disk or host memory), its budget, chunks
    tier_budget_bytes: int = 0
    tier_chunks: int = 0
    tier_loaded_tokens: int = 0  # running totals: tokens loaded back instead of recomputed, tokens written
    tier_spilled_tokens: int = 0
    tier_bytes_read: int = 0
    tier_bytes_written: int = 0
    tier_queued_bytes: int = 0  # evicted KV handed to the tier, not yet written (outside the pool's budget)
    tier_queue_bound_bytes: int = 0  # the most that queue may hold
    tier_kind: str = ""  # "disk", "host memory" or "" (off)
    kv_events_dropped_batches: int | None = None  # our KV-event publisher's dropped batches (None: not publishing)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


# ---------------------------------------------------------------- a fleet behind a router (remote mode)
@dataclass(frozen=True)
class ReplicaView:
    """One replica of a fleet as its KV events and its ``/metrics`` describe it (``FleetView``)."""

    url: str
    snapshot: TreeSnapshot  # its blocks, as the tree tab draws a remote server's (origin "events")
    block_size: int  # 0: no block stored yet
    blocks_held: int
    tokens_held: int
    events_alive: bool  # its subscriber's thread runs (False: no events found at its /kv_event_sources)
    requests_landed: int  # this dashboard's requests attributed to it (``FleetRequest.landed``)
    hit_rate: float | None  # prefix-cache hits / queries from its /metrics (all its clients); None: unknown
    running: float | None  # requests running there now, from its /metrics; None: unknown
    # What its tree here is worth (server.remote.fleet.replica_state): "live"; "down" (its /health does not
    # answer: the tree is what it held then); "stale" (it computed prompts since its last event, which
    # stopped: the tree is out of date, unknown rather than empty); "stopped" (our subscriber ended);
    # "none" (it publishes no events). ``since``: wall time the state began (down, stale), else None.
    state: str = "live"
    since: float | None = None


@dataclass(frozen=True)
class FleetRequest:
    """Where one request of this dashboard landed, and what the fleet held for it when it was sent.
    Token counts are whole blocks of the prompt, at most all but its last token (as vLLM counts)."""

    request_id: int
    prompt_tokens: int
    landed: int | None  # replica index; None: the rule could not tell (``rule`` says why)
    rule: str  # "gained" / "reported" / "ambiguous" / "no events" (server.remote.fleet.attribute)
    cached_reported: int | None  # the answer's usage.prompt_tokens_details.cached_tokens
    cached_on_landed: int | None  # the landed replica's blocks of the prompt before it ran, by its events
    best_before: int  # the most any replica held before it ran: what a perfect router would have reused
    best_replica: int | None
    namespace: str = PUBLIC  # whose request (a viewer under isolation sees only their own)


@dataclass(frozen=True)
class FleetView:
    """Every replica side by side, the last requests' attribution and the fleet's duplication.
    ``duplicate_bytes`` is None where the replicas do not say their KV bytes per token."""

    replicas: tuple[ReplicaView, ...]
    requests: tuple[FleetRequest, ...]
    tokens_held: int  # summed over replicas (a block on two replicas counts twice)
    tokens_distinct: int  # counted once however many replicas hold them
    tokens_on_several: int  # distinct tokens held on more than one replica
    duplicate_copy_tokens: int  # copies beyond the first: tokens_held - tokens_distinct
    kv_bytes_per_token: float | None
    duplicate_bytes: int | None
