"""After a forward: what its logits become, and how requests finish.

Owns: the KV lengths a forward wrote, its step record, progress events, sampling the
next token (first from the prefill's logits), streaming its text or stopping (eos,
``max_new_tokens``), handing a finished prompt's slots to the tree (``adopt``: later
arrivals hit it; they stay locked while the request runs), caching prompt plus reply at
the end, releasing slots, the no-reuse baseline's turn, and failing requests with a
clear error. A finished request goes to the outbox (``SchedulerState.finished``) for
the engine to record; it never builds metrics. Knows nothing about order or admission.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.handle import END_OF_STREAM
from engine.kvcache.prefix_cache import PrefixCache
from engine.model import sampling
from engine.model.runner import ModelRunner
from engine.scheduler import baseline
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
        for c in batch.chunks:
            batch.slots_of(c.request).length = c.start + c.num_tokens
        for r in batch.decoding:
            batch.slots_of(r).length += 1
        self._log(batch, out.duration_ms)
        if batch.kind == "baseline":
            r = batch.chunks[0].request
            r.baseline_ms = (r.baseline_ms or 0.0) + out.duration_ms
            if batch.slots_of(r).length >= len(r.ids):
                self.complete(r)
            return
        assert out.logits is not None
        rows = len(batch.rows)
        for i, c in enumerate(batch.chunks):
            self._prefill_chunk_done(c.request, out.duration_ms, rows, out.logits[i])
        for i, r in enumerate(batch.decoding, start=len(batch.chunks)):
            r.batch_sizes.append(rows)
            self._take_token(r, out.logits[i])

    def _log(self, batch: Batch, duration_ms: float) -> None:
        own = batch.kind == "baseline"
        computed = sum(c.num_tokens for c in batch.chunks) + len(batch.decoding)
        cached = 0 if own else sum(c.request.cached_tokens for c in batch.chunks
                                   if c.start == c.request.cached_tokens)
        prefilling = () if own else tuple(c.request.request_id for c in batch.chunks)
        self.telemetry.log(batch.kind, batch.rows, computed=computed, cached=cached, duration_ms=duration_ms,
                           prefilling=prefilling, running=len(self.state.running), waiting=len(self.state.waiting))

    def _prefill_chunk_done(self, r: Request, duration_ms: float, rows: int, logits: torch.Tensor) -> None:
        r.prefill_ms += duration_ms
        r.prefill_chunks += 1
        r.prefill_shared_step = r.prefill_shared_step or rows > 1
        if r.prefilled < len(r.ids):
            r.emit(GenerationEvent(text="", phase="prefill", prompt_tokens=len(r.ids),
                                   cached_tokens=r.cached_tokens, prefilled_tokens=r.prefilled))
            return
        # The prompt's slots pass to the tree, where later arrivals hit it; they stay locked
        # there until the request finishes.
        if r.req.store:
            r.inserted_tokens += self.cache.adopt(r.slots, r.key)
        r.state = State.DECODE
        if r.max_new_tokens <= 0:
            r.first_token_at = time.perf_counter()
            self.finish(r, "length")
            return
        self._take_token(r, logits)

    def _take_token(self, r: Request, logits: torch.Tensor) -> None:
        """Sample ``r``'s next token from its logits row; stream it or finish."""
        tok = sampling.sample(logits, r.req.sampling, r.generator, r.out_ids)
        now = time.perf_counter()
        if r.first_token_at is None:
            r.first_token_at = now
        self.telemetry.count_output(1, self.state.config.rate_window_s)
        if tok in self.runner.text.eos_ids:
            self.finish(r, "stop")
            return
        r.last_token_at = now
        text = r.append_token(tok, self.runner.text.decode)
        r.emit(GenerationEvent(text=text, token_id=tok, phase="decode", prompt_tokens=len(r.ids),
                               cached_tokens=r.cached_tokens, prefilled_tokens=len(r.ids)))
        if len(r.out_ids) >= r.max_new_tokens:
            self.finish(r, "length")

    # ------------------------------------------------------------ finishing
    def finish(self, r: Request, reason: str) -> None:
        """The answer is over: cache prompt plus reply (its slots pass to the tree), free the
        rest of its slots, then the no-reuse baseline or done."""
        r.finish_reason = reason
        rs = r.slots
        if rs is not None and r.req.store and r.state is State.DECODE and rs.length > len(r.ids):
            # Prompt plus reply, so the next chat turn reuses the answer too.
            r.inserted_tokens += self.cache.adopt(rs, r.reply_key())
        self._release(r)
        # The no-reuse prefill holds pool slots of its own too; without room it is skipped.
        if baseline.wanted(r, self.state.config) and baseline.start(r, self.cache):
            return
        self.complete(r)

    def complete(self, r: Request) -> None:
        """Done: slots back, the final text decoded whole, into the outbox."""
        self._leave(r)
        r.text = self.runner.text.decode(r.out_ids)
        self.state.finished.append(r)

    def fail(self, r: Request, exc: BaseException) -> None:
        if not isinstance(exc, EngineError):
            log.error("request %s failed", r.request_id, exc_info=exc)
        self._leave(r)
        r.emit(as_engine_error(exc))
        r.emit(END_OF_STREAM)

    def _leave(self, r: Request) -> None:
        self._release(r)
        r.state = State.DONE
        if r in self.state.running:
            self.state.running.remove(r)

    def _release(self, r: Request) -> None:
        """Give back every pool slot the request holds (its cached part is unlocked)."""
        for name in ("slots", "baseline_slots"):
            rs = getattr(r, name)
            if rs is not None:
                self.cache.release(rs)
                setattr(r, name, None)
                self.state.memory_short = False  # room came back


def as_engine_error(exc: BaseException) -> EngineError:
    """Bad input stays as it is; anything else is a fault of the server (``EngineFault``)."""
    if isinstance(exc, EngineError):
        return exc
    return EngineFault(f"The request failed: {type(exc).__name__}: {exc}"[:300])
