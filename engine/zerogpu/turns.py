"""``TurnScheduler``: the scheduler of ZeroGPU mode, whose forwards come from one GPU call per turn.

Owns: each running request's call (``Turn``), started the first time the scheduler asks a forward
of that request, in the request's own context (``RequestHandle.context``, copied where it was
submitted: on the page, the Gradio handler of the visitor who asked). The ``spaces`` wrapper reads
that visitor's request from the context when the call is scheduled and sends its ``X-IP-Token``,
so the turn is charged to the visitor whose turn it is, and to nobody else. The call computes the
whole turn in its worker (``turn_call``) and streams each forward out; each of the scheduler's
forwards takes its rows from their requests' streams (a batch of several visitors: each row from
its own call), writes their KV into the pool of record, and hands the logits to ``postprocess``
as usual. So the tree, the pool, admission, the step log and the events are the plain scheduler's.

A step that is not the forward the scheduler asks for (its chunking differed, another request's
prompt took part of a step's budget) is dropped, and the turn goes on in a new call for the same
visitor from where the pool stands: a wrong guess costs a call, never a different answer. A
failed call (the visitor's quota spent, a worker killed, no GPU free) fails that visitor's request
alone, with one sentence; the other rows of the step go on. A request that leaves (finished,
stopped, failed) has its call closed. Forwards that belong to no turn (a prompt scored for its
log-probabilities, the analysis's scratch prefills) go through ``runner.forward_paged``: a call of
its own, made where it is asked.
"""

from __future__ import annotations

import contextvars
import logging
import re
from collections.abc import Iterator

import torch

from engine.kvcache.kv_pool import KVPool
from engine.model.paged_attention import PagedSegment
from engine.scheduler.batch import Batch, Output
from engine.scheduler.request import Request, State
from engine.scheduler.scheduler import Scheduler
from engine.types import EngineError, EngineFault
from engine.zerogpu import turn_call

log = logging.getLogger(__name__)


class Turn:
    """One request's GPU call: the generator ``spaces`` returns, pulled in the request's context."""

    def __init__(self, request: Request, stream: Iterator[turn_call.Step], context: contextvars.Context) -> None:
        self.request, self._stream, self._context = request, stream, context
        self.steps = 0

    def next(self) -> turn_call.Step | None:
        """The call's next forward (None when the call ended); the first one schedules the call.
        A call that fails raises ``EngineFault`` with one sentence (``as_visitor_fault``)."""
        try:
            step = self._context.run(next, self._stream)
        except StopIteration:
            return None
        except EngineError:
            raise
        except Exception as exc:
            raise as_visitor_fault(exc) from exc
        self.steps += 1
        return step

    def close(self) -> None:
        """End the call (``spaces`` stops its worker after the forward under way)."""
        close = getattr(self._stream, "close", None)
        if close is not None:
            try:
                self._context.run(close)
            except Exception as exc:  # an ended call may complain on close: nothing is left to do
                log.debug("closing a turn's call: %s", exc)


class TurnScheduler(Scheduler):
    """``Scheduler`` whose ``run`` takes each row's forward from its request's turn call."""

    def __init__(self, runner, cache, config) -> None:
        super().__init__(runner, cache, config)
        self.turns: dict[int, Turn] = {}  # request id -> its call
        self.calls = 0  # calls started
        self.restarts = 0  # of those, turns that went on in a new call
        self.whole = 0  # calls that came back whole (a worker is then likely up: later calls ask less)

    def step(self) -> list[Request]:
        finished = super().step()
        self._close_left()
        return finished

    def fail_all(self, exc: BaseException) -> None:
        super().fail_all(exc)
        self._close_left()

    def run(self, batch: Batch) -> Output:
        if batch.every_position:  # a prompt scored for its log-probabilities: no turn, a call of its own
            return super().run(batch)
        pool = self.cache.pool
        rows: list[torch.Tensor | None] = []
        errors: dict[int, BaseException] = {}
        device_ms = 0.0
        for i, (r, segment) in enumerate(zip(batch.rows, batch.segments(), strict=True)):
            try:
                step = self._step_for(r, segment, pool)
                rows.append(turn_call.apply(pool, segment, step))
                device_ms = max(device_ms, step.device_ms)  # the rows' calls run side by side
            except Exception as exc:  # this visitor's call failed: only this row fails
                self._drop(r)
                if "worker" in str(exc).lower():
                    self.whole = 0  # its worker is gone: the next call asks for a worker's start again
                rows.append(None)
                errors[i] = exc
        if len(errors) == len(rows) == 1:
            return Output(None, error=errors[0])
        like = next((x for x in rows if x is not None), None)
        if like is None:
            like = torch.zeros(self.runner.text.vocab_size)
        logits = torch.stack([x if x is not None else torch.zeros_like(like) for x in rows])
        return Output(logits, device_ms, row_errors=errors or None)

    # ------------------------------------------------------------- the calls
    def _step_for(self, r: Request, segment: PagedSegment, pool: KVPool) -> turn_call.Step:
        turn = self.turns.get(r.request_id)
        if turn is not None:
            step = turn.next()
            if step is not None and step.matches(segment):
                return step
            self._drop(r)  # not the forward the scheduler asks: go on in a new call from here
            self.restarts += 1
        turn = self._start(r, segment, pool)
        step = turn.next()
        if step is None or not step.matches(segment):
            self._drop(r)
            raise EngineFault("The GPU call computed another forward than the one asked; please try again.")
        return step

    def _start(self, r: Request, segment: PagedSegment, pool: KVPool) -> Turn:
        prefilling = r.state is State.PREFILL
        rest = r.ids[segment.past + len(segment.ids):] if prefilling else ()
        work = turn_call.pack(pool, segment, self.config.chunk_tokens, r.req.sampling, r.answer.out_ids,
                              r.answer.generator, r.max_new_tokens, self.runner.text.eos_ids, rest,
                              cold=self.whole == 0)
        context = getattr(r.handle, "context", None) or contextvars.Context()  # no context: no visitor
        try:
            stream = context.run(self.runner.turn_call, work)
        except Exception as exc:
            raise as_visitor_fault(exc) from exc
        turn = Turn(r, stream, context)
        self.turns[r.request_id] = turn
        self.calls += 1
        return turn

    def _drop(self, r: Request) -> None:
        turn = self.turns.pop(r.request_id, None)
        if turn is not None:
            turn.close()

    def _close_left(self) -> None:
        """Close the calls of requests that are no longer running (finished, stopped, failed)."""
        running = {r.request_id for r in self.state.running}
        for rid in [rid for rid in self.turns if rid not in running]:
            turn = self.turns.pop(rid)
            self.whole += turn.steps > 0 and turn.request.answer.finish_reason in ("stop", "length")
            turn.close()


def as_visitor_fault(exc: BaseException) -> EngineFault:
    """A call that did not come back (the quota spent, a worker killed, no GPU free), as one
    sentence; ``spaces`` raises these as ``gradio.Error``, whose text is already for a visitor."""
    text = " ".join(str(getattr(exc, "message", None) or exc).split()) or type(exc).__name__
    title = str(getattr(exc, "title", "") or "")
    log.warning("GPU call failed: %s%s", f"{title}: " if title else "", text)
    asked = _ASKED.search(text)
    if asked:
        return EngineFault(f"Your GPU quota on this Space is used up for now: this answer asks for {asked[1]} s of GPU "
                           f"and you have {asked[2]} s left today (logging in to Hugging Face gives more).")
    if "quota" in (title + text).lower() or "limit" in text.lower():
        return EngineFault(f"The GPU quota is used up for now ({_first_sentence(text)}); please try again later.")
    if "aborted" in text.lower() or "worker" in title.lower():
        return EngineFault("The GPU worker stopped in the middle of this answer; please ask again.")
    return EngineFault(f"The GPU call did not finish ({_first_sentence(text)}); please try again.")


_ASKED = re.compile(r"\((\d+)s requested vs\. (\d+)s left\)")  # spaces.zero.client's quota message


def _first_sentence(text: str) -> str:
    head = text.split(". ")[0].rstrip(".")
    return head[:200]
