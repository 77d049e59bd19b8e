"""What every engine facade shares, torch-free: the local engine and the remote one both build on it.

Owns: ``FacadeBase`` (validating and tokenizing a request, keying it for a visitor
(``key_for``, by the engine's ``engine.cache_keys.KeyRules``: its secret and the shipped blocks
the page shares), ``generate``/``run`` over ``submit``, the text side for the UI and the lab,
the request records and ``stats``), ``RunningTotals`` (the sums over finished requests) and
``engine_stats``,
the one place an ``EngineStats`` is built: from running totals and the cache's figures now,
whether the cache is this process's (``engine.engine.Engine``), a remote server's
(``server.remote.engine.RemoteEngine``) or one viewer's view of either.

Knows nothing about torch, the model, the pool or the scheduler: a subclass says what its
cache holds (``_cache_figures``), how much of a key it holds now (``_matched_len``), how a
viewer sees it (``_view``) and what waits (``_waiting``). So remote mode, which builds on this
module, loads none of the local core.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from engine import validation
from engine.cache_keys import KeyedPrompt, KeyRules, Visitor
from engine.handle import RequestHandle, request_key
from engine.snapshot_view import is_own
from engine.text.codec import TextCodec
from engine.types import (
    CacheKey,
    EngineError,
    EngineStats,
    FleetView,
    GenerationEvent,
    GenerationRequest,
    RequestMetrics,
    TreeSnapshot,
)

# The secret cache-key names are made with: one per process (never sent to a client), so a
# visitor's namespace is the same on every engine of this process, as the page's always was.
_KEY_SECRET = secrets.token_bytes(16)

__all__ = ["FacadeBase", "RunningTotals", "engine_stats"]


@dataclasses.dataclass
class RunningTotals:
    """Sums over finished requests: an engine's since it started, or one viewer's own."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    prefill_ms: float = 0.0

    def add(self, m: RequestMetrics) -> None:
        self.requests += 1
        self.prompt_tokens += m.prompt_tokens
        self.cached_tokens += m.cached_tokens
        self.computed_tokens += m.computed_tokens
        self.prefill_ms += m.prefill_ms

    @classmethod
    def over(cls, records: Iterable[RequestMetrics]) -> RunningTotals:
        totals = cls()
        for m in records:
            totals.add(m)
        return totals


def engine_stats(totals: RunningTotals, **cache: Any) -> EngineStats:
    """The one place ``EngineStats`` is built: ``totals`` and the cache's figures now
    (``cache_bytes``, ``budget_bytes``, ``cached_tokens_now``, ``num_nodes``, ``evicted_tokens``,
    ``queue_depth`` and any of the optional fields)."""
    return EngineStats(**dataclasses.asdict(totals), **cache)


def view_figures(view: TreeSnapshot) -> dict[str, int]:
    """The cache's figures as a snapshot gives them (second-tier nodes are not in the pool)."""
    resident = [n for n in view.nodes if not n.spilled]
    return dict(cache_bytes=view.num_bytes, budget_bytes=view.budget_bytes, cached_tokens_now=view.num_tokens,
                num_nodes=len(resident), evicted_tokens=view.evicted_tokens,
                locked_tokens=sum(n.num_tokens for n in resident if n.lock_ref > 0))


class FacadeBase:
    """What the local engine and ``server.remote.engine.RemoteEngine`` share: validating and
    tokenizing a request (``prompt_ids``), ``generate``/``run`` over ``submit``, the text side
    for the UI and the lab (tokenize, render, detokenize), and ``stats``.

    Reads ``self.text`` (the ``TextCodec``: the runner's locally, one built from a tokenizer
    alone remotely), ``self.max_prompt_tokens`` and ``self.isolation``; subclasses provide
    ``submit``, ``_cache_figures``, ``_view`` and ``_waiting``. The request records
    (``history``, running totals, ``recent``) are kept the same way by both, under the lock
    ``_start_records`` is given."""

    text: TextCodec
    max_prompt_tokens: int
    isolation: bool

    def kv_event_figures(self) -> dict:
        """``{}``: this engine follows no server's KV events (a remote engine overrides it)."""
        return {}

    def fleet_view(self, viewer: str | None = None) -> FleetView | None:
        """None: no fleet behind this engine (a remote engine with ``--fleet`` overrides it)."""
        return None

    def _start_records(self, history_size: int, lock: Any) -> None:
        self._records_lock = lock
        self.history: deque[RequestMetrics] = deque(maxlen=history_size)
        self._totals = RunningTotals()
        self._key_secret = _KEY_SECRET
        self._shipped: tuple[tuple[int, ...], ...] = ()

    def _add_record(self, m: RequestMetrics) -> RequestMetrics:
        """Count a finished request in the totals and keep it in the history (caller holds the lock)."""
        self._totals.add(m)
        self.history.append(m)
        return m

    # ------------------------------------------------------------- stats
    def stats(self, viewer: str | None = None) -> EngineStats:
        """Running totals and the cache's state. In isolation mode, with ``viewer`` (a
        namespace), only what that visitor may see: totals over their own requests (their
        namespace and its sub-namespaces), and the cache's figures as their ``snapshot``
        gives them (others' tokens coarse)."""
        if viewer is not None and self.isolation:
            mine = RunningTotals.over(m for m in self.recent() if is_own(viewer, m.namespace))
            return engine_stats(mine, **view_figures(self._view(viewer)), queue_depth=self._waiting())
        figures = self._cache_figures()
        with self._records_lock:
            totals = dataclasses.replace(self._totals)
        return engine_stats(totals, **figures)

    def _cache_figures(self) -> dict[str, Any]:
        """The cache's figures now: every ``EngineStats`` field beyond the running totals."""
        raise NotImplementedError

    def _view(self, viewer: str | None) -> TreeSnapshot:
        """The tree as ``viewer`` may see it (None: all of it); text may be left out."""
        raise NotImplementedError

    def _waiting(self) -> int:
        """Requests submitted to this process and not started yet: what ``queue_depth`` means."""
        raise NotImplementedError

    # ------------------------------------------------------------- records
    def recent(self, n: int | None = None, namespace: str | None = None) -> list[RequestMetrics]:
        with self._records_lock:
            items = list(self.history)
        if namespace is not None:
            items = [m for m in items if m.namespace == namespace]
        return items[-n:] if n else items

    # ------------------------------------------------------------- keys
    def _key_rules(self) -> KeyRules:
        """This engine's keying now (``isolation`` is read each time: a test may flip it)."""
        return KeyRules(bool(self.isolation), self._key_secret, self._shipped)

    def share_blocks(self, texts: Sequence[str]) -> int:
        """Register shipped blocks (the page's presets, each as the text the chat template renders
        it to) that every page visitor may share; replaces the ones before. Returns how many."""
        blocks = []
        for text in texts:
            ids = tuple(self.text.encode(text))
            # A block's last token may merge with the text that follows it ("\n\n" + "Input"):
            # drop it, so that the rest is a token prefix of every prompt that holds the block.
            if len(ids) > 1:
                blocks.append(ids[:-1])
        self._shipped = tuple(blocks)
        return len(blocks)

    def namespace_for(self, visitor: Visitor, sub: str | None = None) -> str:
        """The namespace ``visitor``'s requests run in (with ``sub``: one inside it)."""
        return self._key_rules().namespace(visitor, sub)

    def key_for(self, request: GenerationRequest, visitor: Visitor, sub: str | None = None) -> KeyedPrompt:
        """Tokenize ``request`` once (as ``prompt_ids``: same errors) and key it for ``visitor``:
        the namespace, the shareable length, whether to store it, and the tokens this engine
        would reuse of it now (``_matched_len``; never the last one, which is always computed)."""
        ids = self.prompt_ids(request)
        rules = self._key_rules()
        key = rules.key(ids, visitor, sub)
        return KeyedPrompt(key, min(self._matched_len(key), len(ids) - 1), rules.store(visitor))

    def _matched_len(self, key: CacheKey) -> int:
        """Tokens of ``key.ids`` this engine's cache holds now for ``key``'s namespace."""
        raise NotImplementedError

    def matched_len(self, key: CacheKey) -> int:
        """``PrefillAPI.matched_len``: ``_matched_len``, a read that changes nothing."""
        return self._matched_len(key)

    # ------------------------------------------------------------- requests
    def cache_key(self, ids: Sequence[int], request: GenerationRequest) -> CacheKey:
        """The request's namespace and shareable length are set by server code
        (``engine.cache_keys.KeyRules`` for the page and the API; the ordering lab uses one
        namespace per variant), clamped here to ``ids``."""
        return request_key(ids, request)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        raise NotImplementedError

    def generate(self, request: GenerationRequest) -> Iterator[GenerationEvent]:
        yield from self.submit(request)

    def run(self, request: GenerationRequest) -> RequestMetrics:
        """Run a request to the end; return its metrics."""
        last = None
        for event in self.generate(request):
            last = event
        assert last is not None and last.metrics is not None
        return last.metrics

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """The request's token ids, validated: EngineError (for a person) before anything runs."""
        given = [request.messages is not None, request.prompt is not None, request.prompt_ids is not None]
        if sum(given) != 1:
            raise EngineError("give exactly one of messages, prompt or prompt_ids")
        text = self.text
        if request.messages is not None:
            messages = validation.check_messages(request.messages)
            validation.check_text_tokens([m["content"] for m in messages], self.max_prompt_tokens,
                                         text.max_token_chars, text.encode)
            try:
                ids = text.encode_chat(messages)
            except Exception as exc:  # a chat template may refuse a role order (jinja raises)
                raise EngineError(f"This model's chat template refused the messages: {exc}"[:300]) from None
        elif request.prompt is not None:
            if not isinstance(request.prompt, str):
                raise EngineError("The prompt must be text.")
            if not request.prompt.strip():
                raise EngineError(validation.EMPTY_PROMPT)
            validation.check_text_tokens([request.prompt], self.max_prompt_tokens, text.max_token_chars,
                                         text.encode)
            ids = text.encode(request.prompt)
        else:
            ids = validation.check_prompt_ids(request.prompt_ids, text.vocab_size)
        if not ids:
            raise EngineError("The prompt is empty: type something first.")
        if len(ids) > self.max_prompt_tokens:
            raise EngineError(f"The prompt is {len(ids):,} tokens long; the limit is "
                              f"{self.max_prompt_tokens:,} tokens. Shorten it and try again.")
        return ids

    # ------------------------------------------------------------- text
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as is (no chat template, no BOS)."""
        return self.text.encode(text)

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages``, as text."""
        return self.text.render_chat(messages, add_generation_prompt=add_generation_prompt)

    def decode(self, ids: Sequence[int]) -> str:
        return self.text.decode(ids)

    def token_pieces(self, ids: Sequence[int]) -> list[str]:
        """One display string per token; their concatenation is ``decode(ids)``."""
        return self.text.token_pieces(ids)

    def token_texts(self, ids: Sequence[int]) -> list[tuple[str, bytes]]:
        """Each token on its own, as logprobs show it: (its text decoded alone, its UTF-8 bytes)."""
        return self.text.token_texts(ids)

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer, for tools that simulate without the model."""
        return self.text.tokenizer

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self.text.special_token_ids
