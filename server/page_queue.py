"""The page's event queue, fair by address, and the bounds on what it keeps per session.

Owns: ``fair_queue(demo, share)``, installed on Gradio's queue after ``demo.queue()``, and
``bound_sessions(demo)`` (below). ``fair_queue``: Gradio's
queue is first in, first out and its ``max_size`` counts everyone, so one address posting 150
events (``POST /gradio_api/call/chat``, each a new session) filled it and every other address
got "Queue is full" (issue 58). Here, at each join:

- an address (``request_guard.connection_origin``: the socket's peer, or on Spaces the hop the
  platform's proxy appended to ``X-Forwarded-For``, the rule the API's limits count by) with
  ``share`` events already waiting is refused at once with "you already have N requests
  waiting", before Gradio's own size check;
- events wait in turns by address: an event goes behind every waiting event of its own
  address and ahead of a later turn of anyone else's (round robin), so a newcomer's first
  event runs before a flooder's second. A classroom behind one address (several tabs, several
  sessions) is one address: its events run together, up to the share, in order.

``bound_sessions``: every page event a client posts without a session (``/gradio_api/call/...``)
opens a new Gradio session, and Gradio keeps per session its state (a copy of the whole page's
config and every ``gr.State``: the largest), a message queue and a set of event ids, and per
event an analytics record; the sets never go, the rest only at caps of 2,000 to 10,000. Here,
at most every ``PRUNE_EVERY_S`` at a join, sessions idle for ``SESSION_IDLE_S`` are dropped
with everything kept for them, their state included, and the analytics records are capped at
``MAX_ANALYTICS``: what the page holds no longer grows with the events it has served (issue 58's
soak grew 15 MiB a minute).

- and of a function's running places (its concurrency limit, 16) one address takes at most
  ``running_cap`` (12), so another address's event starts at once (``fair_get_events``).

A running event holds no waiting place (the engine caps each address's requests in its own
inbox too, ``Engine.max_waiting_per_owner``). Knows nothing about
the panels or the engine; reaches into Gradio's ``Queue`` only through ``push`` and its
per-function lists of waiting events (``event_queue_per_concurrency_id``), read in Gradio
6.31.
"""

from __future__ import annotations

import functools
import time
from collections import Counter

from server.request_guard import connection_origin

DEFAULT_SHARE = 16  # waiting events per address: a classroom's tabs all fit


def share_of(max_queue: int) -> int:
    """Waiting page events per address: half the engine's inbox (as its per-address cap), at least 4."""
    return max(4, max_queue // 2)


def origin_of_event(event) -> str:
    """The address a queued Gradio ``Event`` came from (its join request's)."""
    request = getattr(event, "request", None)
    return request_origin(request)


def request_origin(request) -> str:
    headers = getattr(request, "headers", None)
    if headers is None or not hasattr(headers, "get"):
        headers = {}
    client = getattr(request, "client", None)
    return connection_origin(headers, getattr(client, "host", None))


def waiting_by_address(queue) -> Counter:
    """Events waiting (not started) in Gradio's ``queue``, counted per address."""
    counts: Counter = Counter()
    for event_queue in list(queue.event_queue_per_concurrency_id.values()):
        for event in list(event_queue.queue):
            counts[origin_of_event(event)] += 1
    return counts


def in_turns(events: list) -> list:
    """``events`` reordered round robin by address, keeping each address's own order: the k-th
    waiting event of every address goes before the (k+1)-th of any (stable by arrival)."""
    seen: Counter = Counter()
    ranked = []
    for i, event in enumerate(events):
        origin = origin_of_event(event)
        ranked.append((seen[origin], i, event))
        seen[origin] += 1
    return [event for _, _, event in sorted(ranked, key=lambda r: (r[0], r[1]))]


def too_many_message(n: int, share: int) -> str:
    return (f"You already have {n} requests waiting on this page (at most {share} from one address): wait for "
            "one to start, then try again.")


def fair_queue(demo, share: int = DEFAULT_SHARE) -> None:
    """Install the per-address share and the turns on ``demo``'s queue (after ``demo.queue()``)."""
    queue = getattr(demo, "_queue", None)
    if queue is None or getattr(queue, "__fair_share__", None) is not None:
        return
    push = queue.push

    @functools.wraps(push)
    async def fair_push(body, request, username):
        origin = request_origin(request)
        mine = waiting_by_address(queue)[origin]
        if mine >= share:
            return False, too_many_message(mine, share), "queue_full"
        ok, event_id, state = await push(body=body, request=request, username=username)
        if ok:
            async with queue.delete_lock:  # the dispatcher takes events under the same lock
                for event_queue in queue.event_queue_per_concurrency_id.values():
                    if len(event_queue.queue) > 1:
                        event_queue.queue[:] = in_turns(event_queue.queue)
        return ok, event_id, state

    queue.push = fair_push
    queue.get_events = functools.partial(fair_get_events, queue)
    queue.__fair_share__ = share


def running_cap(limit: int | None) -> int | None:
    """Running events of one function one address may hold: all but a quarter of its concurrency
    limit (12 of 16), kept for whoever arrives, as the scheduler keeps rows (``owner_row_cap``)."""
    return None if limit is None else max(1, limit - max(1, limit // 4))


def fair_get_events(queue):
    """Gradio's dispatcher step (``Queue.get_events``, read in Gradio 6.31), fair by address: the
    first waiting event (in turns, ``in_turns``) whose address holds fewer than ``running_cap`` of
    that function's running events is started. Without this one address's events could take every
    running place of a function, and another address's first event, first in line, still waited
    for one of theirs to end. Batched functions are Gradio's own way."""
    import random

    running: Counter = Counter()
    for job in list(queue.active_jobs):
        for event in job or ():
            running[(event.concurrency_id, origin_of_event(event))] += 1
    ids = list(queue.event_queue_per_concurrency_id.keys())
    random.shuffle(ids)
    for concurrency_id in ids:
        event_queue = queue.event_queue_per_concurrency_id[concurrency_id]
        limit = event_queue.concurrency_limit
        if not event_queue.queue or (limit is not None and event_queue.current_concurrency >= limit):
            continue
        cap = running_cap(limit)
        for event in event_queue.queue:
            if event.fn.batch:
                break
            if cap is None or running[(concurrency_id, origin_of_event(event))] < cap:
                event_queue.queue.remove(event)
                return [event], False, concurrency_id
        if event_queue.queue and event_queue.queue[0].fn.batch:
            first = event_queue.queue[0]
            events = [first] + [e for e in event_queue.queue[1:] if e.fn == first.fn][: first.fn.max_batch_size - 1]
            for event in events:
                event_queue.queue.remove(event)
            return events, True, concurrency_id
    return None


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
        now = time.monotonic()
        if now - last[0] >= PRUNE_EVERY_S:
            last[0] = now
            prune_sessions(demo, idle_s=idle_s)
        return await push(body=body, request=request, username=username)

    queue.push = pruning_push
    queue.__bounded__ = True
