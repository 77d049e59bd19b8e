"""The model-free replay: a log through the tokenizer and the simulated cache, into a report.

A SIMULATION of hits, tokens and cost, labelled as such wherever it is shown: no
model runs, so there are no timings. It keeps:

- the token ids the engine would see: the model's tokenizer and chat template,
  rendered by ``engine.text.codec.TextCodec.render_chat`` as the engine renders it, in batches (the fast
  tokenizer's batch call is where a simulation spends most of its time);
- the engine's budget in tokens: budget bytes / KV bytes per token, read from the
  model's config without loading weights (``model_geometry``);
- the engine's cache rules (``analysis.replay.sim_cache.SimCache``), plus an optional TTL;
- optionally the engine's second tier (``tier_bytes``, the engine's ``--disk-cache-mb``):
  evicted prefixes kept in whole 64-token chunks under that byte budget, loaded back
  by a later request instead of recomputed.

``simulate_lines`` streams a log (any iterable of lines) through all of that
and ``ReplayStats`` and returns the ``ReplayReport``. Knows nothing about
progress bars, signals or the UI: it takes callbacks.

Outside the engine's public modules it reaches only into ``engine.model.loader`` (the KV
geometry, in ``model_geometry``, imported there so loading this module loads no torch).
"""

from __future__ import annotations

import functools
import itertools
import re
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from analysis.lab.cost_estimate import PricingRules
from analysis.replay.log_formats import LogLineError, LogOrder, LogRecord, SkippedLine, read_log
from analysis.replay.replay_stats import ReplayReport, ReplayStats
from analysis.replay.sim_cache import ServeResult, SimCache, tree_snapshot
from engine.kvcache.chunks import CHUNK_TOKENS
from engine.text.codec import TextCodec
from engine.validation import valid_text


# ------------------------------------------------------------------ the model, without weights
@dataclass(frozen=True)
class ModelGeometry:
    name: str
    kv_bytes_per_token: int
    max_context: int
    dtype: str


def model_geometry(model: str = "embedded", dtype: str = "auto", device: str = "auto") -> ModelGeometry:
    """KV bytes per token and context length from the model's config alone (no weights)."""
    import torch
    from transformers import AutoConfig

    from engine.model.loader import (
        EMBEDDED_HUB_ID,
        EMBEDDED_MODEL,
        converted_cache_dir,
        embedded_gguf_path,
        resolve_device,
        resolve_dtype,
    )

    if model in (EMBEDDED_MODEL, "", None):
        cached, gguf = converted_cache_dir(), embedded_gguf_path()
        if (cached / "config.json").exists():
            cfg = AutoConfig.from_pretrained(cached)
        elif gguf is not None:
            cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        else:
            cfg = AutoConfig.from_pretrained(EMBEDDED_HUB_ID)
        name = "SmolLM2-135M-Instruct (embedded)"
    else:
        cfg, name = AutoConfig.from_pretrained(model), model
    text = cfg.get_text_config(decoder=True)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    torch_dtype = resolve_dtype(dtype, resolve_device(device))
    elem = torch.empty((), dtype=torch_dtype).element_size()
    context = int(getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None) or 2048)
    return ModelGeometry(name, 2 * int(text.num_hidden_layers) * kv_heads * head_dim * elem, context,
                         str(torch_dtype).removeprefix("torch."))


# ------------------------------------------------------------------ tokenizing, in batches
@dataclass(frozen=True, slots=True)
class EncodedRequest:
    record: LogRecord
    ids: tuple[int, ...]  # the prompt, as the engine would tokenize it
    inserted: tuple[int, ...]  # what it leaves in the cache: prompt + logged response
    text: str  # the prompt text (chat template applied)


class PromptEncoder:
    """Renders and tokenizes log records in batches.

    Chat prompts repeat long stretches (a system prompt in every request), so the
    text is cut at the tokenizer's added tokens (``<|im_start|>`` ...), which the
    tokenizer splits out before anything else, and each stretch is tokenized once
    and remembered (least recently used first out, ``memo_tokens`` at most). The
    first ``VERIFY_TEXTS`` texts are also tokenized whole: if any differs, the
    memo is switched off for good and every text is tokenized whole.
    """

    VERIFY_TEXTS = 64

    def __init__(self, tokenizer: Any, max_context: int, memo_tokens: int = 1_000_000) -> None:
        self.tokenizer = tokenizer
        self.max_context = max_context
        self._text = TextCodec(tokenizer)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._fast = getattr(backend, "encode_batch_fast", None)
        self._splitter = _added_token_splitter(backend)
        self._memo: OrderedDict[str, array] = OrderedDict()
        self._memo_tokens, self._memo_limit = 0, memo_tokens
        self._verified = 0

    def render(self, record: LogRecord) -> str:
        if record.messages is None:
            return valid_text(record.prompt or "")
        return valid_text(self._text.render_chat(record.messages))

    def _whole(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        if self._fast is not None:
            return [e.ids for e in self._fast(list(texts), add_special_tokens=False)]
        return [list(x) for x in self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]]

    def encode_texts(self, texts: Sequence[str]) -> list[list[int]]:
        if self._splitter is None:
            return self._whole(texts)
        pieces = [[p for p in self._splitter.split(t) if p] for t in texts]
        missing = list(dict.fromkeys(p for ps in pieces for p in ps if p not in self._memo))
        for piece, ids in zip(missing, self._whole(missing), strict=True):
            self._remember(piece, array("i", ids))
        out = []
        for ps in pieces:
            ids: list[int] = []
            for p in ps:
                got = self._memo.get(p)
                if got is None:  # pushed out by this very batch: tokenize it again
                    got = array("i", self._whole([p])[0])
                else:
                    self._memo.move_to_end(p)
                ids.extend(got)
            out.append(ids)
        if self._verified < self.VERIFY_TEXTS:
            check = list(texts[:self.VERIFY_TEXTS - self._verified])
            self._verified += len(check)
            if self._whole(check) != out[:len(check)]:
                self._splitter = None  # this tokenizer does not split that way: tokenize whole texts
                self._memo.clear()
                return self._whole(texts)
        return out

    def _remember(self, piece: str, ids: array) -> None:
        self._memo[piece] = ids
        self._memo_tokens += len(ids)
        while self._memo_tokens > self._memo_limit and len(self._memo) > 1:
            _, old = self._memo.popitem(last=False)
            self._memo_tokens -= len(old)

    def encode(self, records: Sequence[LogRecord]) -> list[EncodedRequest | SkippedLine]:
        rendered: list[str | SkippedLine] = []
        for r in records:
            try:
                rendered.append(self.render(r))
            except Exception as exc:  # a chat template may refuse a role order (jinja raises)
                rendered.append(SkippedLine(r.line, f"the chat template refused the messages: {exc}"[:300]))
        texts = [t for t in rendered if isinstance(t, str)]
        responses = [valid_text(r.response) for r, t in zip(records, rendered, strict=True)
                     if isinstance(t, str) and r.response]
        ids_all = self.encode_texts(texts + responses)
        prompt_ids, response_ids = iter(ids_all[:len(texts)]), iter(ids_all[len(texts):])
        out: list[EncodedRequest | SkippedLine] = []
        for r, t in zip(records, rendered, strict=True):
            if isinstance(t, SkippedLine):
                out.append(t)
                continue
            ids = tuple(next(prompt_ids))
            reply = tuple(next(response_ids)) if r.response else ()
            if not ids:
                out.append(SkippedLine(r.line, "the prompt has no tokens"))
            elif len(ids) > self.max_context:
                out.append(SkippedLine(r.line, f"the prompt is {len(ids):,} tokens long; the model's context is "
                                               f"{self.max_context:,} (the engine would refuse it)"))
            else:
                out.append(EncodedRequest(r, ids, ids + reply, t))
        return out




def _added_token_splitter(backend: Any) -> re.Pattern | None:
    """A regex that cuts text at the tokenizer's added tokens, when they match verbatim
    (no whitespace stripping, not normalized); None otherwise."""
    try:
        added = list(backend.get_added_tokens_decoder().values())
    except AttributeError:
        return None
    if not added or any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in added):
        return None
    contents = sorted({t.content for t in added}, key=len, reverse=True)
    return re.compile("(" + "|".join(re.escape(c) for c in contents) + ")")


# ------------------------------------------------------------------ the run
def simulate_lines(lines: Iterable[str], tokenizer: Any, geometry: ModelGeometry, budget_tokens: int | None,
                   ttl_s: float | None = None, strict: bool = False, pricing: PricingRules = PricingRules(),
                   log_name: str = "", chunk: int = 256, tier_bytes: int = 0,
                   on_progress: Callable[[ReplayStats], None] | None = None,
                   should_stop: Callable[[], bool] = lambda: False,
                   on_request: Callable[[EncodedRequest, ServeResult, str], None] | None = None,
                   eviction_policy: str = "lru") -> ReplayReport:
    """Replay ``lines`` through the simulated cache, with a second tier of ``tier_bytes`` when
    that is > 0, evicting by the engine's ``eviction_policy``; ``should_stop`` is asked after each
    chunk (a stopped run still returns the report of what it replayed)."""
    started = time.perf_counter()
    encoder = PromptEncoder(tokenizer, geometry.max_context)
    decode = functools.partial(tokenizer.decode, skip_special_tokens=False)
    stats = ReplayStats(budget_tokens, decode, lambda text: len(encoder.encode_texts([text])[0]) if text else 0,
                        getattr(tokenizer, "all_special_ids", ()) or (), ttl_s, pricing)
    chunk_bytes = geometry.kv_bytes_per_token * CHUNK_TOKENS
    cache = SimCache(budget_tokens, ttl_s=ttl_s, tier_chunks=tier_bytes // chunk_bytes if tier_bytes > 0 else None,
                     policy=eviction_policy)
    order = LogOrder()
    records = read_log(lines, on_skip=stats.skip, strict=strict, order=order)
    stopped, now = False, 0.0
    for batch in _batched(records, chunk):
        for item in encoder.encode(batch):
            if isinstance(item, SkippedLine):
                if strict:
                    raise LogLineError(f"line {item.line}: {item.reason}")
                stats.skip(item)
                continue
            # The log's clock: its timestamps, kept strictly increasing so that LRU order is
            # replay order (a log without timestamps advances a microsecond per request).
            stamp = item.record.timestamp
            now = max(stamp, now + 1e-6) if stamp is not None else now + 1e-6
            served = cache.serve(item.ids, item.inserted, item.record.session, now)
            kind = stats.observe(item.record, item.ids, item.inserted, served.cached_tokens, item.text, now,
                                 tier_tokens=served.tier_tokens)
            if on_request is not None:
                on_request(item, served, kind)
        if on_progress is not None:
            on_progress(stats)
        if should_stop():
            stopped = True
            break
    notes = [f"Simulation: the tokenizer and the pure radix tree with a cache budget of "
             f"{_budget(budget_tokens, geometry)} and LRU eviction, as the engine would have; no model ran, so "
             "there are no timings."]
    if tier_bytes > 0:
        notes.append(f"Second tier: {tier_bytes / 2**20:,.0f} MiB = {tier_bytes // chunk_bytes:,} chunks of "
                     f"{CHUNK_TOKENS} tokens; evicted prefixes are kept in whole chunks and loaded back instead of "
                     "recomputed, as the engine's --disk-cache-mb does.")
    if ttl_s is not None:
        notes.append(f"Time-to-live {ttl_s:,.0f} s on the log's timestamps" +
                     ("." if order.timed else ": the log has no timestamps, so nothing expired."))
    if order.late:
        notes.append(f"{order.late:,} requests were more than {order.window:,} requests out of timestamp order "
                     "and were replayed where they stood.")
    return stats.finish("simulation", geometry.name, log_name, geometry.kv_bytes_per_token,
                        tree_snapshot(cache, decode, geometry.kv_bytes_per_token), stopped,
                        time.perf_counter() - started, order.late, cache.evicted_tokens, cache.expired_tokens,
                        cache.peak_tokens, notes, tier_bytes if tier_bytes > 0 else None)


def _budget(budget_tokens: int | None, geometry: ModelGeometry) -> str:
    if budget_tokens is None:
        return "no limit"
    return (f"{budget_tokens:,} tokens = {budget_tokens * geometry.kv_bytes_per_token / 2**20:,.0f} MiB at "
            f"{geometry.kv_bytes_per_token:,} bytes per token, {geometry.dtype}")


def _batched(items: Iterable, n: int) -> Iterator[list]:
    it = iter(items)
    while batch := list(itertools.islice(it, n)):
        yield batch
