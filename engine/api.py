"""The engine interface: what the dashboard, the HTTP server and the lab may call, and its contract.

Owns: ``EngineAPI``, the one written interface over an engine, and ``Capabilities``, what an
engine can do beyond it. ``EngineAPI`` composes five narrow parts, so a caller (or a test double)
names only what it uses: ``ServingAPI`` (requests, keys, ``info``, ``healthy``), ``TextAPI``
(tokenizer and chat template), ``FiguresAPI`` (stats, snapshots, logs), ``ControlAPI``
(clear, budget, spawn, close) and ``PrefillAPI`` (prefills outside the scheduler, for the
analysis's timings and warm start: ``scratch_prefill``, ``cache_prefill``, ``matched_len``). Two engines implement all of it: ``engine.engine.Engine`` (the model
and the radix cache in this process) and ``server.remote.engine.RemoteEngine`` (another server
over HTTP, with a shadow tree of what this dashboard sent). Callers never test which one they
hold: they ask ``engine.capabilities``. Knows nothing about either implementation, the UI or HTTP.

Contract, for both implementations:

- ``submit`` validates before anything touches a cache: bad input raises ``EngineError`` (a
  message for a person), a full inbox ``EngineBusy``, a shut-down engine ``EngineFault``. The
  handle it returns yields ``GenerationEvent``s; the last one has ``done`` and ``metrics``.
  ``cancel()`` on the handle (or closing its iterator) ends the request; its KV stays consistent.
- Log-probabilities (``GenerationRequest.logprobs``, ``prompt_logprobs``) come on the events as
  ``TokenLogprob``s, computed only for requests that ask; an engine that cannot give them
  refuses the request with ``EngineError``, never drops them (the remote engine passes the
  chosen tokens' through from its backend, ``logprobs`` 0, and refuses alternatives and the prompt's).
  ``token_texts(ids)`` is each token on its own as they show it: its text and its bytes.
- ``prompt_ids`` tokenizes and validates exactly as ``submit`` will (same errors, same ids), so
  a caller that shows the tokens first may pass them on as ``prompt_ids`` (tokenized once).
- ``snapshot(viewer)`` and ``stats(viewer)``: with isolation on and a ``viewer`` namespace,
  only what that visitor may see (others' nodes as coarse shape, by ``engine.snapshot_view``);
  otherwise everything. Neither changes the cache. ``version()`` is a cheap counter that changes
  whenever what they return could have (bar the clock): panels compare it instead of building
  stats to learn that nothing changed.
- ``clear_cache(namespace)`` frees what nobody is reading (one namespace, or all); it never
  breaks a running request. ``set_budget`` raises ``EngineError`` where
  ``capabilities.settable_budget`` is False.
- ``healthy()`` says whether the engine takes requests now (locally: not closed and its worker
  running; remotely: the backend's own ``GET /health`` answered 200, or ``/v1/models`` where it
  serves no ``/health``). It never blocks for long (remote: a short timeout, the answer kept a moment).
- ``persist_cache()`` writes the cache to the second tier (0 where ``capabilities.second_tier``
  is False); ``backend_metrics()`` is the remote server's own metrics ({} for a local engine).
- ``spawn`` raises ``EngineError`` where ``capabilities.private_engines`` is False; ``step_log``
  is empty where ``capabilities.scheduler_steps`` is False. Prefill timing is the analysis's
  (``analysis.prefill_timing.timer_for``, None where ``capabilities.prefill_timing`` is False;
  the no-reuse figure of a finished request, ``analysis.no_reuse``), through ``PrefillAPI`` only:
  ``scratch_prefill`` and ``cache_prefill`` raise ``EngineError`` where
  ``capabilities.scratch_prefill`` is False (remote: the backend's prefill cannot be run apart).
- The engine owns cache keys. ``key_for(request, visitor, sub=None)`` tokenizes once (as
  ``prompt_ids``) and keys the prompt for a ``Visitor`` by the engine's own
  ``engine.cache_keys.KeyRules`` (its isolation, its secret, the shipped blocks): a
  ``KeyedPrompt`` with the key (namespace and shareable length), ``store`` and ``matched_len``,
  the tokens the engine would reuse if it ran now (at most all but the last). Locally that is
  the radix cache's memory match (the second tier may add more when it runs, and another
  request may change it meanwhile); remotely it is what the remote engine knows: its shadow
  tree of what this dashboard sent, not the server's own cache. ``keyed.request(base)`` is the
  request to submit. ``namespace_for(visitor, sub)`` is the namespace alone; ``share_blocks``
  registers the page's shipped blocks (texts the engine tokenizes). The page and the HTTP API
  both key through these, so they cannot disagree.
- ``cache_key(ids, request)`` is the request's key as the engine caches it: the namespace and
  shareable length set on the request (by ``key_for``, or the lab's own variants), the length
  clamped to ``ids``.
- The engine keeps no one else's state: the analysis (``analysis.per_engine``: the prefill
  timer, the request-order demo) and the page (``components.panels.engine_state``) keep their
  per-engine objects on their side, and the engine imports neither.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

from engine.cache_keys import KeyedPrompt, Visitor
from engine.handle import RequestHandle
from engine.types import (
    CacheKey,
    EngineInfo,
    EngineStats,
    FleetView,
    GenerationEvent,
    GenerationRequest,
    RequestMetrics,
    StepRecord,
    TreeSnapshot,
)


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do beyond the common interface; panels read these, never the class."""

    local_cache: bool  # the KV cache lives in this process: its bytes, budget and gauges are real
    settable_budget: bool  # set_budget works (and a person may change the budget from the page)
    prefill_timing: bool  # analysis.prefill_timing.timer_for can time prefill with and without reuse
    private_engines: bool  # spawn() gives a small engine of its own on the same model (request-order demo)
    scheduler_steps: bool  # step_log() shows this process's forwards (the Scheduler tab)
    remote: bool = False  # a client of another server (``info().backend`` names it)
    second_tier: bool = False  # evicted KV goes to disk or host memory; persist_cache() writes it for a restart
    logprobs: bool = False  # requests may ask for log-probabilities (GenerationRequest.logprobs, prompt_logprobs)
    gpu_calls: bool = False  # each forward runs in a ZeroGPU call (engine.zerogpu): a step may wait for a GPU
    scratch_prefill: bool = False  # PrefillAPI's prefills run here (analysis.no_reuse times a request's other side)


LOCAL = Capabilities(local_cache=True, settable_budget=True, prefill_timing=True, private_engines=True,
                     scheduler_steps=True, logprobs=True, scratch_prefill=True)
REMOTE = Capabilities(local_cache=False, settable_budget=False, prefill_timing=False, private_engines=False,
                      scheduler_steps=False, remote=True, logprobs=True)  # the chosen tokens' only (logprobs 0)


@runtime_checkable
class ServingAPI(Protocol):
    """Serving: take requests, key them, answer them; what the HTTP API and the chat path need.
    A test double or a thin client may implement only this."""

    isolation: bool  # visitors are kept apart (namespaces; fair share; others' nodes coarse)
    max_prompt_tokens: int
    max_new_tokens_cap: int
    max_queue: int  # requests that may wait (local) or be in flight (remote) before EngineBusy

    @property
    def capabilities(self) -> Capabilities: ...

    # requests
    def submit(self, request: GenerationRequest) -> RequestHandle: ...
    def generate(self, request: GenerationRequest) -> Iterator[GenerationEvent]: ...
    def run(self, request: GenerationRequest) -> RequestMetrics: ...
    def prompt_ids(self, request: GenerationRequest) -> list[int]: ...
    def cache_key(self, ids: Sequence[int], request: GenerationRequest) -> CacheKey: ...

    # keys (the engine owns them: the page and the API hand it a request and a visitor)
    def key_for(self, request: GenerationRequest, visitor: Visitor, sub: str | None = None) -> KeyedPrompt: ...
    def namespace_for(self, visitor: Visitor, sub: str | None = None) -> str: ...
    def share_blocks(self, texts: Sequence[str]) -> int: ...

    def info(self) -> EngineInfo: ...
    def healthy(self) -> bool: ...


@runtime_checkable
class TextAPI(Protocol):
    """Text: the model's tokenizer and chat template, as the engine uses them."""

    def encode(self, text: str) -> list[int]: ...
    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def token_pieces(self, ids: Sequence[int]) -> list[str]: ...
    def token_texts(self, ids: Sequence[int]) -> list[tuple[str, bytes]]: ...
    @property
    def tokenizer(self) -> Any: ...
    @property
    def special_token_ids(self) -> frozenset[int]: ...


@runtime_checkable
class FiguresAPI(Protocol):
    """State, as plain data, for the panels and ``/metrics``. Reads only: nothing here changes the cache."""

    def recent(self, n: int | None = None, namespace: str | None = None) -> list[RequestMetrics]: ...
    def stats(self, viewer: str | None = None) -> EngineStats: ...
    def snapshot(self, viewer: str | None = None) -> TreeSnapshot: ...
    def version(self) -> int: ...
    def step_log(self, n: int | None = None) -> list[StepRecord]: ...
    def backend_metrics(self) -> dict[str, float]: ...

    def kv_event_figures(self) -> dict:
        """A remote engine's followed KV events (blocks per medium, the subscriber's counters,
        ``active`` once they describe the server's cache); ``{}`` when none are followed."""
        ...

    def fleet_view(self, viewer: str | None = None) -> FleetView | None:
        """A remote engine in front of a router with ``--fleet``: every replica's real tree (as
        ``viewer`` may see it), where this dashboard's requests landed, the fleet's duplication
        (``server.remote.fleet``); None for an engine without a fleet (the local one)."""
        ...


@runtime_checkable
class ControlAPI(Protocol):
    """Controls: what a person, the lab or a test changes about the engine as a whole."""

    def clear_cache(self, namespace: str | None = None) -> int: ...
    def set_budget(self, budget_bytes: int) -> int: ...
    def check_invariants(self) -> None: ...
    def spawn(self, budget_bytes: int, max_batch: int = 1, max_queue: int = 64) -> EngineAPI: ...
    def close(self) -> None:
        """Stop once the requests already submitted are done; its memory and files are let go."""
        ...
    def shutdown(self, timeout_s: float = 10.0) -> None:
        """The process is ending (SIGTERM): cancel what is in flight, then stop every thread the
        engine runs, within about ``timeout_s``; never raises."""
        ...
    def configure_scheduler(self, **changes: Any) -> None: ...
    def persist_cache(self) -> int | None: ...


class ScratchPrefill(NamedTuple):
    """What ``PrefillAPI.scratch_prefill`` measured."""

    forward_ms: float  # its compute calls' forwards, summed (copying the cached prefix in is not counted)
    reused_tokens: int  # tokens copied from the cache (0: none; fewer than asked if some were evicted)
    last_logits: Any  # the last token's float32 logits [vocab], on the CPU (a ``torch.Tensor`` locally)


class CachedPrefill(NamedTuple):
    """What ``PrefillAPI.cache_prefill`` did."""

    cached_tokens: int  # reused from the cache
    prefill_ms: float  # match, copy and forward
    inserted_tokens: int  # new tokens the prompt added to the cache


@runtime_checkable
class PrefillAPI(Protocol):
    """Prefills outside the scheduler, for the analysis (``analysis/``: a request's no-reuse figure,
    the paired timing, the warm start, the growth curve). Each compute call runs between the
    scheduler's steps, so other visitors' streams keep flowing. Where ``capabilities.scratch_prefill``
    is False (remote) the two prefills raise ``EngineError``."""

    def matched_len(self, key: CacheKey) -> int:
        """Tokens of ``key.ids`` the cache holds now for ``key``'s namespace. Reads only: no hit,
        no access time, no lock."""
        ...

    def scratch_prefill(self, key: CacheKey, reuse_tokens: int = 0, block_tokens: int = 512,
                        before_block: Callable[[], None] | None = None) -> ScratchPrefill:
        """The one primitive of the no-reuse timing: prefill ``key.ids`` on a scratch pool of its
        own that neither reads nor writes the cache, ``block_tokens`` per compute-thread call.
        With ``reuse_tokens`` > 0 it first copies up to that many (at most all but the last) of the
        cached prefix into the scratch pool, read without counting a hit or touching access
        times, and computes the rest (the reuse side of a paired timing); with 0 it computes
        every token (the no-reuse side). ``before_block`` is called before each call, on the
        caller's thread: what it raises ends the prefill (the scratch pool is let go) and comes
        out here, so a caller waits or cancels there. Only the forwards are timed."""
        ...

    def cache_prefill(self, key: CacheKey) -> CachedPrefill:
        """Prefill ``key.ids`` in one compute call, reusing the longest cached prefix (a hit), and
        cache the prompt: the warm start's and the growth curve's way to put a prefix in the cache
        without a request."""
        ...


@runtime_checkable
class EngineAPI(ServingAPI, TextAPI, FiguresAPI, ControlAPI, PrefillAPI, Protocol):
    """The interface every full engine implements (see the module's docstring for the contract):
    serving, text, figures, controls and prefills apart. Callers that need only a part name that
    part."""
