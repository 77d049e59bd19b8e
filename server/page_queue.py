"""The page's event queue, fair by address (what it keeps per session: ``components.page_sessions``).

Owns: ``fair_queue(demo, share)``, installed on Gradio's queue after ``demo.queue()``: Gradio's
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
  sessions) is one address: its events run together, up to the share, in order;
- of a function's running places (its concurrency limit, 16) one address takes at most
  ``running_cap`` (12), so another address's event starts at once (``fair_get_events``).

A running event holds no waiting place (the engine caps each address's requests in its own
inbox too, ``Engine.max_waiting_per_owner``). Knows nothing about
the panels or the engine; reaches into Gradio's ``Queue`` only through ``push`` and its
per-function lists of waiting events (``event_queue_per_concurrency_id``), read in Gradio
6.31.
"""

from __future__ import annotations

import functools
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
