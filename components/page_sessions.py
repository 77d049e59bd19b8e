"""What the page keeps per Gradio session, bounded: made lean, and dropped when idle.

Every page event a client posts without a session (``/gradio_api/call/...``: scripts, fresh tabs,
a flood) opens a new Gradio session. Gradio 6.31 keeps per session its state (``SessionState``:
every ``gr.State``, and ``config_values``, a config of every block of the page, made at the
session's start for deep links), a message queue and a set of event ids, and per event an
analytics record; the sets never go, the rest only at caps of 2,000 to 10,000. Owns:

- ``bound_sessions(demo)``: at most every ``PRUNE_EVERY_S``, at a join, sessions idle for
  ``SESSION_IDLE_S`` are dropped with everything kept for them (``prune_sessions``), and the
  analytics records are capped at ``MAX_ANALYTICS``: what the page holds no longer grows with
  the events it has served (issue 58's soak grew 15 MiB a minute);
- lean sessions (installed by ``bound_sessions`` on the app's ``StateHolder`` at the first join):
  a new session's block configs are made when first read (an output's, when an event updates
  it; all of them only for a deep link, a route this app refuses), not all at its start. Made
  at the start they cost the event loop about 6 ms a session on this page, so 28 sessions
  opened by one address's flood held every other visitor's stream for over a second (profiled
  with py-spy: three quarters of the loop's time), and each session held a copy of the page.

Knows nothing about the panels, the queue's fairness (``server.page_queue``) or the engine; reads
Gradio's ``StateHolder``, ``SessionState`` and ``Queue`` as 6.31 has them
(``tests/app/test_page_sessions.py`` checks a lean session has Gradio's own fields).
"""

from __future__ import annotations

import datetime
import functools
import os
import time
from copy import copy

from gradio.state_holder import SessionState, StateHolder

SESSION_IDLE_S = 20 * 60.0  # a session with no event for this long is dropped (a tab's timers keep theirs)
PRUNE_EVERY_S = 5.0
MAX_ANALYTICS = 1000  # Gradio's per-event records (its monitoring page, off here): the newest kept


def prune_sessions(demo, now: float | None = None, idle_s: float = SESSION_IDLE_S) -> int:
    """Drop every session idle for ``idle_s`` (by Gradio's own last-use time, else by its empty
    queues) with its state, message queue and event ids; cap the analytics records. Returns how
    many sessions went. Runs on the event loop's thread (from a join) or in a test."""
    import datetime

    queue, holder = demo._queue, getattr(demo, "state_holder", None)
    now_dt = datetime.datetime.now() if now is None else datetime.datetime.fromtimestamp(now)
    gone: set[str] = set()
    if holder is not None:
        with holder.lock:
            for sid, used in list(holder.time_last_used.items()):
                if (now_dt - used).total_seconds() >= idle_s:
                    holder.session_data.pop(sid, None)
                    holder.time_last_used.pop(sid, None)
                    gone.add(sid)
            for sid in [s for s in holder.session_data if s not in holder.time_last_used]:
                holder.session_data.pop(sid, None)  # never used since it was made: nothing of it is read
                gone.add(sid)
    live = set(holder.session_data) if holder is not None else set()
    # Sessions with an event waiting or running keep everything (the state is made when it runs).
    busy = {e.session_hash for eq in list(queue.event_queue_per_concurrency_id.values()) for e in list(eq.queue)}
    busy |= {e.session_hash for job in list(queue.active_jobs) if job for e in job}
    keep = live | busy
    for sid in list(queue.pending_event_ids_session):
        if sid not in keep:  # what is left there (results nobody came to read) has no reader to come
            queue.pending_event_ids_session.pop(sid, None)
            gone.add(sid)
    messages = queue.pending_messages_per_session
    for sid in list(messages.keys()):
        if sid not in keep:
            messages.pop(sid, None)
            gone.add(sid)
    queue.ANALYTICS_MAX_EVENTS = min(getattr(queue, "ANALYTICS_MAX_EVENTS", MAX_ANALYTICS), MAX_ANALYTICS)
    analytics = queue.event_analytics
    while len(analytics) > MAX_ANALYTICS:
        analytics.pop(next(iter(analytics)))
    return len(gone)


def bound_sessions(demo, idle_s: float = SESSION_IDLE_S) -> None:
    """Prune (``prune_sessions``) at most every ``PRUNE_EVERY_S``, at a join (after ``demo.queue()``)."""
    queue = getattr(demo, "_queue", None)
    if queue is None or getattr(queue, "__bounded__", False):
        return
    queue.ANALYTICS_MAX_EVENTS = MAX_ANALYTICS
    push = queue.push
    last = [0.0]

    @functools.wraps(push)
    async def pruning_push(body, request, username):
        make_lean(getattr(demo, "state_holder", None))  # made at launch, after this is installed
        now = time.monotonic()
        if now - last[0] >= PRUNE_EVERY_S:
            last[0] = now
            prune_sessions(demo, idle_s=idle_s)
        return await push(body=body, request=request, username=username)

    queue.push = pruning_push
    queue.__bounded__ = True


class _ConfigsOnDemand(dict):
    """``SessionState.config_values`` made a block at a time, when first read: ``in`` answers
    for every block of the page; ``items``/``values`` (a deep link's read) make what is left.
    ``forget`` (the block changed) and ``set_value`` (its value changed) keep what Gradio would
    have made for that read, without making it now."""

    def __init__(self, blocks_config, keys) -> None:
        super().__init__()
        self._blocks_config = blocks_config
        self._order = list(keys)  # Gradio's order: the page's blocks, then any added later
        self._pending = set(keys)
        self._values: dict = {}  # key -> the value its config's props say, once made

    def forget(self, key) -> None:
        dict.pop(self, key, None)
        self._values.pop(key, None)
        self._pending.add(key)

    def set_value(self, key, value) -> None:
        if dict.__contains__(self, key):
            config = dict.__getitem__(self, key)
            if "props" in config:
                config["props"]["value"] = value
        else:
            self._pending.add(key)
            self._values[key] = value

    def _make(self, key):
        self._pending.discard(key)
        config = self._blocks_config.config_for_block(key, [], self._blocks_config.blocks[key])
        if key in self._values and "props" in config:
            config["props"]["value"] = self._values.pop(key)
        dict.__setitem__(self, key, config)
        return config

    def _make_all(self) -> None:
        for key in list(self._pending):
            self._make(key)
        made = dict(dict.items(self))
        dict.clear(self)
        dict.update(self, {k: made.pop(k) for k in self._order if k in made})
        dict.update(self, made)

    def __missing__(self, key):
        if key in self._pending:
            return self._make(key)
        raise KeyError(key)

    def __contains__(self, key) -> bool:
        return dict.__contains__(self, key) or key in self._pending

    def __setitem__(self, key, value) -> None:
        self._pending.discard(key)
        self._values.pop(key, None)
        dict.__setitem__(self, key, value)

    def get(self, key, default=None):
        return self[key] if key in self else default

    def __len__(self) -> int:
        return dict.__len__(self) + len(self._pending)  # made and pending never share a key

    def __iter__(self):
        self._make_all()
        return dict.__iter__(self)

    def keys(self):
        self._make_all()
        return dict.keys(self)

    def items(self):
        self._make_all()
        return dict.items(self)

    def values(self):
        self._make_all()
        return dict.values(self)


class _LeanSession(SessionState):
    """Gradio's ``SessionState`` (6.31), its ``config_values`` on demand: where Gradio makes a
    block's config on every change of the block or its value (an event's outputs, on the event
    loop), this one marks it and makes it when read (a deep link, refused here)."""

    def __init__(self, blocks) -> None:  # Gradio's, less the config of every block
        self.blocks_config = copy(blocks.default_config)
        self.config_values = _ConfigsOnDemand(self.blocks_config,
                                              [k for k in self.blocks_config.blocks if k in blocks.blocks])
        self.state_data = {}
        self._state_ttl = {}
        self.is_closed = False
        self.STATE_TTL_WHEN_CLOSED = 1 if os.getenv("GRADIO_IS_E2E_TEST", None) else 3600  # as Gradio's

    def __setitem__(self, key: int, value) -> None:  # Gradio's, the config marked instead of made
        from gradio.components import State

        block = self.blocks_config.blocks.get(key)
        if isinstance(block, State):
            self._state_ttl[key] = (block.time_to_live, datetime.datetime.now())
            self.state_data[key] = value
        else:
            self.blocks_config.blocks[key] = value
        if block:
            self.config_values.forget(key)

    def _update_config(self, key: int) -> None:
        if self[key] is not None:
            self.config_values.forget(key)

    def _update_value_in_config(self, key: int, value) -> None:
        self.config_values.set_value(key, value)


def lean_session(blocks) -> SessionState:
    """A new session of ``blocks`` whose block configs are made when read (module docstring)."""
    return _LeanSession(blocks)


class _LeanStateHolder(StateHolder):
    """Gradio's ``StateHolder``, its new sessions lean (``lean_session``)."""

    def __getitem__(self, session_id: str) -> SessionState:
        if session_id not in self.session_data:
            self.session_data[session_id] = lean_session(self.blocks)
        return super().__getitem__(session_id)


def make_lean(holder) -> None:
    """New sessions of ``holder`` (the app's ``StateHolder``) start lean; a holder of another kind is left."""
    if holder is not None and type(holder) is StateHolder:
        holder.__class__ = _LeanStateHolder
