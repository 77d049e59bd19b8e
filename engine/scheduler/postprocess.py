"""After a forward: what its logits become, and how requests finish.

Owns: the KV lengths a forward wrote, its step record, progress events, sampling the
next token (first from the prefill's logits) and, for requests that ask, the
log-probabilities of that token and of their prompt, streaming its text or stopping (eos,
``max_new_tokens``), handing a finished prompt's slots to the tree (``adopt``: later
arrivals hit it; they stay locked while the request runs), caching prompt plus reply at
the end, releasing slots, and failing requests with a
clear error. A finished request goes to the outbox (``SchedulerState.finished``) for
the engine to record; it never builds metrics. Knows nothing about order or admission.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.handle import END_OF_STREAM
from engine.kvcache.prefix_cache import PrefixCache
from engine.model import logprobs, sampling
from engine.model.runner import ModelRunner
from engine.scheduler.batch import Batch, Output
from engine.scheduler.request import Request, State
from engine.scheduler.state import SchedulerState
from engine.scheduler.telemetry import Telemetry
from engine.types import EngineError, EngineFault, GenerationEvent

log = logging.getLogger(__name__)


class Postprocess:
    def __init__(self, state: SchedulerState, runner: ModelRunner, cache: PrefixCache, telemetry: Telemetry) -> None:
        self.state, self.runner, self.cache, self.telemetry = state, runner, cache, telemetry

    def apply(self, batch: Batch, out: Output) -> None:
        """Everything ``batch``'s forward changed: KV lengths, the step log, then each row."""
        if out.error is not None:
            for r in batch.rows:
                self.fail(r, out.error)
            return
        if out.row_errors:  # out of memory, then run row by row: only the rows that failed alone fail
            for i, r in enumerate(batch.rows):
                if i in out.row_errors:
                    self.fail(r, out.row_errors[i])
            keep = [i for i in range(len(batch.rows)) if i not in out.row_errors]
            chunks = tuple(c for i, c in enumerate(batch.chunks) if i not in out.row_errors)
            decoding = tuple(r for i, r in enumerate(batch.decoding, start=len(batch.chunks))
                             if i not in out.row_errors)
            assert out.logits is not None
            batch, out = Batch(batch.kind, chunks, decoding), Output(out.logits[keep], out.duration_ms)
        rows = len(batch.rows)
        for c in batch.chunks:
            c.request.complete_chunk(c.start, c.num_tokens, out.duration_ms, rows)
        for r in batch.decoding:
            r.complete_decode(rows)
        self._log(batch, out.duration_ms)
        assert out.logits is not None
        for i, c in enumerate(batch.chunks):
            if out.every_position is not None:  # a lone chunk that scores its prompt (``Batch.every_position``)
                self._score_prompt(c.request, c.start, out.every_position)
            self._prefill_chunk_done(c.request, out.logits[i])
        for i, r in enumerate(batch.decoding, start=len(batch.chunks)):
            self._take_token(r, out.logits[i])

    def _log(self, batch: Batch, duration_ms: float) -> None:
        computed = sum(c.num_tokens for c in batch.chunks) + len(batch.decoding)
        cached = sum(c.request.kv.cached_tokens for c in batch.chunks if c.start == c.request.kv.cached_tokens)
        prefilling = tuple(c.request.request_id for c in batch.chunks)
        self.telemetry.log(batch.kind, batch.rows, computed=computed, cached=cached, duration_ms=duration_ms,
                           prefilling=prefilling, running=len(self.state.running), waiting=len(self.state.waiting))

    def _score_prompt(self, r: Request, start: int, rows: torch.Tensor) -> None:
        """Prompt log-probabilities from a chunk's rows: the row at position ``p`` scores prompt
        token ``p + 1``; the chunk's last row, at the prompt's end, scores the first new token
        instead (``_take_token``)::

            rows:    start   start+1 ...  start+n-1
            score:  ids[start+1] ...      ids[start+n] (or, past the prompt, the first new token)
        """
        ids = r.ids[start + 1:start + 1 + rows.shape[0]]
        assert r.req.prompt_logprobs is not None
        r.prompt_scored(start + 1, logprobs.logprobs_of(rows[:len(ids)], ids, r.req.prompt_logprobs))

    def _prefill_chunk_done(self, r: Request, logits: torch.Tensor) -> None:
        if r.prefilled < len(r.ids):
            r.emit(GenerationEvent(text="", phase="prefill", prompt_tokens=len(r.ids),
                                   cached_tokens=r.kv.cached_tokens, prefilled_tokens=r.prefilled))
            return
        if r.req.prompt_logprobs is not None:  # all of them at once, before any token
            r.emit(GenerationEvent(text="", phase="prefill", prompt_tokens=len(r.ids),
                                   cached_tokens=r.kv.cached_tokens, prefilled_tokens=len(r.ids),
                                   prompt_logprobs=r.take_prompt_logprobs()))
        # The prompt's slots pass to the tree, where later arrivals hit it; they stay locked
        # there until the request finishes.
        if r.req.store:
            r.adopted(self.cache.adopt(r.kv.slots, r.key))
        r.start_decode()
        if r.max_new_tokens <= 0:
            r.token_sampled(time.perf_counter())
            self.finish(r, "length")
            return
        self._take_token(r, logits)

    def _take_token(self, r: Request, logits: torch.Tensor) -> None:
        """Sample ``r``'s next token from its logits row; stream it or finish."""
        tok = sampling.sample(logits, r.req.sampling, r.answer.generator, r.answer.out_ids)
        now = time.perf_counter()
        r.token_sampled(now)
        self.telemetry.count_output(1, self.state.config.rate_window_s)
        if tok in self.runner.text.eos_ids and not r.req.sampling.ignore_eos:
            self.finish(r, "stop")
            return
        # Only for requests that ask: from the very row the token was sampled from.
        lp = None if r.req.logprobs is None else logprobs.token_logprob(logits, tok, r.req.logprobs)
        text = r.append_token(tok, now, self.runner.text.decode, lp)
        r.emit(GenerationEvent(text=text, token_id=tok, phase="decode", prompt_tokens=len(r.ids),
                               cached_tokens=r.kv.cached_tokens, prefilled_tokens=len(r.ids), logprob=lp))
        if len(r.answer.out_ids) >= r.max_new_tokens:
            self.finish(r, "length")

    # ------------------------------------------------------------ finishing
    def finish(self, r: Request, reason: str) -> None:
        """The answer is over: cache prompt plus reply (its slots pass to the tree), free the
        rest of its slots, done."""
        r.finish(reason)
        rs = r.kv.slots
        if rs is not None and r.req.store and r.state is State.DECODE and rs.length > len(r.ids):
            # Prompt plus reply, so the next chat turn reuses the answer too.
            r.adopted(self.cache.adopt(rs, r.reply_key()))
        self._release(r)
        self.complete(r)

    def complete(self, r: Request) -> None:
        """Done: slots back, the final text decoded whole, into the outbox."""
        self._leave(r)
        r.answer.settle_text(self.runner.text.decode)
        self.state.finished.append(r)

    def fail(self, r: Request, exc: BaseException) -> None:
        if not isinstance(exc, EngineError):
            log.error("request %s failed", r.request_id, exc_info=exc)
        self._leave(r)
        r.emit(as_engine_error(exc))
        r.emit(END_OF_STREAM)

    def _leave(self, r: Request) -> None:
        self._release(r)
        r.leave()
        if r in self.state.running:
            self.state.running.remove(r)

    def _release(self, r: Request) -> None:
        """Give back every pool slot the request holds (its cached part is unlocked)."""
        for rs in r.hand_back_slots():
            self.cache.release(rs)
            self.state.memory_short = False  # room came back


def as_engine_error(exc: BaseException) -> EngineError:
    """Bad input stays as it is; anything else is a fault of the server (``EngineFault``)."""
    if isinstance(exc, EngineError):
        return exc
    return EngineFault(f"The request failed: {type(exc).__name__}: {exc}"[:300])
