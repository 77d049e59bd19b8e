"""The dashboard in front of a router (``--backend ROUTER --fleet URL,...``): every replica's real cache.

Owns: one KV-event follower per replica (a ``KVEventSubscriber`` into a ``BlockTree`` each, found
through the replica's ``GET /kv_event_sources`` exactly as ``RemoteEngine.follow_kv_events``
finds its backend's), each replica's cache and queue figures from its ``/metrics`` (read at most
every few seconds), which replica each request of this dashboard landed on, and the fleet's
duplication (tokens held on more than one replica). The requests themselves go through the
router (``RemoteEngine``); this module never sends one.

Attribution (``attribute``), from the events alone, for a request whose prompt ids are known:

- before it is sent, each replica's match of the prompt is taken (whole blocks);
- after it finished, each replica's match of prompt + answer is polled for up to
  ``SETTLE_S``: the one replica whose match **grew** is where it ran (rule "gained": the
  replica that ran it stores its blocks and publishes them);
- where none grew (the prompt plus answer gave no new whole block, or the events came late)
  or several did (a concurrent request with the same prefix elsewhere), each replica's
  ``/metrics`` counters, read before and after: the one replica whose prompt-token counter grew
  by exactly the prompt and whose hit counter grew by exactly the answer's ``cached_tokens`` ran
  it (rule "counted"; exact while requests do not overlap, and self-checking when they do).
  The counters also overrule a single gain they contradict: the previous request's last events,
  arriving late on its own replica, grow that replica's match of a prompt that shares its
  prefix, while this request's replica has not published yet;
- failing that, the replicas whose match before equals the answer's ``cached_tokens`` (in whole
  blocks): one such is taken (rule "reported"), several or none leave it unknown ("ambiguous").

Cost: one ``/metrics`` read per replica when a request is sent and one when its answer ends
(loopback: milliseconds; a replica that does not answer costs up to 2 s, once each).

Its limits, said in the UI too: it is an inference, not the router's word (vllm-router names no
worker in its answer); two requests with the same prefix in flight at once on two replicas can
swap; a replica that publishes no events cannot be attributed ("no events"); an eviction between
send and finish can hide a gain. The "most any replica had" is taken before the request is sent,
so a concurrent request may change it before the router decides.

Duplication counts blocks by content (the chain of token ids from the first block, and the salt
of that first block), not by hash: two processes may hash alike content differently.

Knows nothing about the UI.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.types import FleetRequest, FleetView, ReplicaView, TreeSnapshot
from server.remote.block_tree import BlockHash, BlockTree
from server.remote.client import BackendClient
from server.remote.kv_events import EventSource, KVEventSubscriber, discover

log = logging.getLogger(__name__)

SETTLE_S = 2.0  # how long a finished request's attribution waits for its replica's events
METRICS_MAX_AGE_S = 3.0
HISTORY = 50  # attributed requests kept

GAINED, COUNTED, REPORTED, AMBIGUOUS, NO_EVENTS = "gained", "counted", "reported", "ambiguous", "no events"
LIVE, DOWN, STALE, STOPPED, NONE = "live", "down", "stale", "stopped", "none"  # ReplicaView.state
STALE_S = 5.0  # no event for this long ...
STALE_TOKENS = 64  # ... while the replica computed this many prompt tokens (two blocks: events were due)
QUERIES = ("radix_prefix_cache_queries_total", "vllm:prefix_cache_queries_total")
HITS = ("radix_prefix_cache_hits_total", "vllm:prefix_cache_hits_total")
Counts = tuple[float, float] | None  # a replica's (prompt tokens, cached tokens) counters; None: unknown


# ---------------------------------------------------------------- pure arithmetic
def cached_blocks_tokens(tree: BlockTree, ids: Sequence[int], salt: str | None, cap_last: bool = True) -> int:
    """Tokens of ``ids`` the tree holds as a chain of whole blocks from a first block under ``salt``;
    ``cap_last``: never the last token (a server always computes it), as ``cached_tokens`` counts."""
    bs = tree.block_size
    if not bs:
        return 0
    n = len(tree.match(ids, salt)) * bs
    return min(n, (len(ids) - 1) // bs * bs) if cap_last else n


def attribute(before: Sequence[int | None], after: Sequence[int | None], reported: int | None,
              block_size: int, counts: Sequence[tuple[Counts, Counts]] = (),
              prompt_tokens: int = 0) -> tuple[int | None, str]:
    """Which replica ran a request (see the module docstring): ``before`` each replica's match of
    the prompt when sent (capped as ``cached_tokens`` is), ``after`` of prompt + answer once done
    (uncapped), None for a replica without events; ``counts`` each replica's (before, after)
    counters. Returns (replica index or None, rule)."""
    known = [i for i, b in enumerate(before) if b is not None and after[i] is not None]
    gained = [i for i in known if after[i] > before[i]]
    exact = []
    if reported is not None and prompt_tokens:
        exact = [i for i, (a, b) in enumerate(counts)
                 if a is not None and b is not None and (b[0] - a[0], b[1] - a[1]) == (prompt_tokens, reported)]
    if len(gained) == 1 and (len(exact) != 1 or exact == gained):
        return gained[0], GAINED
    if len(exact) == 1:  # no single gain, or one the counters contradict (a previous request's late events)
        return exact[0], COUNTED
    if not known:
        return None, NO_EVENTS
    if reported is not None and block_size:
        want = reported // block_size * block_size
        pool = gained or known
        same = [i for i in pool if before[i] == want]
        if len(same) == 1:
            return same[0], REPORTED
    return None, AMBIGUOUS


def content_keys(trees: Sequence[BlockTree]) -> list[dict[BlockHash, int]]:
    """Per tree: block hash -> an id that is the same for the same content on every tree (the
    first block's salt and the chain of token ids from it). A block whose parent is not held is
    keyed by (tree, hash): it is never counted as another replica's."""
    interned: dict[tuple, int] = {}
    out: list[dict[BlockHash, int]] = []
    for t, tree in enumerate(trees):
        keys: dict[BlockHash, int] = {}
        with tree.lock:
            for h in list(tree.blocks):
                _key_of(h, t, tree.blocks, keys, interned)
        out.append(keys)
    return out


def _key_of(h: BlockHash, t: int, blocks: dict, keys: dict[BlockHash, int], interned: dict[tuple, int]) -> int:
    """``content_keys`` for one block: walk up to a keyed block or a top (iteratively: chains can
    be long), then key the chain downwards."""
    start, chain = h, []
    while h not in keys:
        chain.append(h)
        parent = blocks[h].parent
        if parent is None or parent not in blocks:
            break
        h = parent
    for x in reversed(chain):
        b = blocks[x]
        if b.parent is None:
            k: tuple = ("first", b.salt, b.token_ids)
        elif b.parent in keys:
            k = (keys[b.parent], b.token_ids)
        else:
            k = ("detached", t, x)
        keys[x] = interned.setdefault(k, len(interned))
    return keys[start]


@dataclass(frozen=True)
class Duplication:
    tokens_held: int
    tokens_distinct: int
    tokens_on_several: int

    @property
    def duplicate_copy_tokens(self) -> int:
        return self.tokens_held - self.tokens_distinct


def duplication(trees: Sequence[BlockTree]) -> Duplication:
    """Tokens held over all ``trees``, counted once, and held on more than one of them."""
    copies: Counter[int] = Counter()
    sizes: dict[int, int] = {}
    for tree, keys in zip(trees, content_keys(trees), strict=True):
        with tree.lock:
            for h, k in keys.items():
                copies[k] += 1
                sizes[k] = len(tree.blocks[h].token_ids)
    held = sum(sizes[k] * n for k, n in copies.items())
    distinct = sum(sizes.values())
    several = sum(sizes[k] for k, n in copies.items() if n > 1)
    return Duplication(held, distinct, several)


def replica_state(found: bool, subscriber_alive: bool, up: bool, computed_since_event: float | None,
                  quiet_s: float) -> str:
    """What a replica's tree here is worth (``ReplicaView.state``): it publishes no events (``found``
    False); its ``/health`` does not answer (``up`` False); our subscriber ended; it computed at least
    ``STALE_TOKENS`` prompt tokens (from its ``/metrics``: queries less hits) since the last event we got,
    ``quiet_s`` ago, at least ``STALE_S`` (computed blocks are stored, and stored blocks are published: its
    events stopped); else live."""
    if not found:
        return NONE
    if not up:
        return DOWN
    if not subscriber_alive:
        return STOPPED
    if computed_since_event is not None and computed_since_event >= STALE_TOKENS and quiet_s >= STALE_S:
        return STALE
    return LIVE


# ---------------------------------------------------------------- the followed fleet
@dataclass
class Replica:
    url: str
    client: BackendClient
    blocks: BlockTree = field(default_factory=BlockTree)
    events: KVEventSubscriber | None = None
    landed: int = 0
    state: str = LIVE
    since: float | None = None  # wall time the state began
    _event_mark: tuple[float, float, float] | None = None  # (last event's time, computed prompt tokens, when seen)

    def followed(self) -> bool:
        return self.events is not None and self.events.synced

    def counts(self) -> Counts:
        """Its prompt-token and cached-token counters now (a fresh ``/metrics`` read)."""
        found = self.client.metrics(max_age_s=0.0)
        q, h = next((found[n] for n in QUERIES if n in found), None), next((found[n] for n in HITS if n in found), None)
        return (q, h) if q is not None and h is not None else None

    def metric(self, *names: str) -> float | None:
        found = self.client.metrics(max_age_s=METRICS_MAX_AGE_S)
        values = [found[n] for n in names if n in found]
        return values[0] if values else None

    def update_state(self, now: float | None = None) -> str:
        """Its state now (``replica_state``), kept with the time it began."""
        now = time.time() if now is None else now
        up = self.client.healthy(max_age_s=2.0)
        computed_since, quiet = None, 0.0
        if self.events is not None and up:
            q = self.metric(*QUERIES)
            h = self.metric(*HITS)
            computed = q - h if q is not None and h is not None else None
            last = self.events.stats.last_event_at
            if computed is not None:
                if self._event_mark is None or self._event_mark[0] != last:
                    self._event_mark = (last, computed, now)  # a new event seen: count from here
                computed_since = computed - self._event_mark[1]
            quiet = now - (last or (self._event_mark[2] if self._event_mark else now))
        state = replica_state(self.events is not None, self.events is not None and self.events.alive, up,
                              computed_since, quiet)
        if state != self.state:
            self.state, self.since = state, (now if state in (DOWN, STALE, STOPPED) else None)
            log.warning("Fleet: %s is %s", self.url, state) if state != LIVE else log.info("Fleet: %s is live again",
                                                                                          self.url)
        return state


@dataclass
class Pending:
    """A request sent through the router, before it is attributed."""

    ids: list[int]
    salt: str | None
    before: list[int | None]  # each replica's match when sent (capped), None without events
    counts: list[Counts]  # each replica's counters when sent
    counts_after: list[Counts] | None = None  # and when its answer ended (``Fleet.finished``)


class Fleet:
    """The replicas behind the router, followed (``follow``) until ``close``."""

    def __init__(self, urls: Sequence[str], api_key: str | None = None, timeout_s: float = 10.0) -> None:
        self.replicas = [Replica(u.rstrip("/"), BackendClient(u, "", api_key, timeout_s)) for u in urls]
        self.requests: deque[FleetRequest] = deque(maxlen=HISTORY)
        self.lock = threading.Lock()
        self.version = 0

    def follow(self) -> list[EventSource | None]:
        """Find and follow every replica's events (``GET /kv_event_sources``); None where it has none."""
        found: list[EventSource | None] = []
        for r in self.replicas:
            source = discover(r.client._get_json, r.url)
            if source is not None:
                r.events = KVEventSubscriber(source, r.blocks).start()
                log.info("Fleet: following %s's KV events at %s", r.url, source.endpoint)
            else:
                log.warning("Fleet: %s publishes no KV events: its tree stays empty and no request is attributed "
                            "to it", r.url)
            found.append(source)
        return found

    @property
    def trees(self) -> list[BlockTree]:
        return [r.blocks for r in self.replicas]

    def before(self, ids: Sequence[int], salt: str | None) -> Pending:
        """Each replica's match of ``ids`` now: call before the request is sent."""
        return Pending(list(ids), salt, [cached_blocks_tokens(r.blocks, ids, salt) if r.followed() else None
                                         for r in self.replicas], [r.counts() for r in self.replicas])

    def finished(self, pending: Pending) -> None:
        """Read every replica's counters as the request's answer ends (before the next one starts)."""
        pending.counts_after = [r.counts() for r in self.replicas]

    def settle(self, pending: Pending, request_id: int, out_ids: Sequence[int], reported: int | None,
               namespace: str = "", settle_s: float = SETTLE_S,
               on_done: Callable[[], None] | None = None) -> FleetRequest:
        """Attribute a finished request (polls each replica's events for up to ``settle_s``) and keep it."""
        full = list(pending.ids) + list(out_ids)
        bs = next((r.blocks.block_size for r in self.replicas if r.blocks.block_size), 0)

        def after() -> list[int | None]:
            return [cached_blocks_tokens(r.blocks, full, pending.salt, cap_last=False)
                    if b is not None else None for r, b in zip(self.replicas, pending.before, strict=True)]

        deadline = time.monotonic() + settle_s
        now = after()
        while time.monotonic() < deadline:  # bounded: the replica's events for it come within ms here
            if sum(1 for a, b in zip(now, pending.before, strict=True) if b is not None and a > b) == 1:
                break
            time.sleep(0.05)
            now = after()
        counts = list(zip(pending.counts, pending.counts_after or [None] * len(self.replicas), strict=True))
        landed, rule = attribute(pending.before, now, reported, bs, counts, len(pending.ids))
        known = [(b, i) for i, b in enumerate(pending.before) if b is not None]
        best, best_i = max(known) if known else (0, None)
        fr = FleetRequest(request_id=request_id, prompt_tokens=len(pending.ids), landed=landed, rule=rule,
                          cached_reported=reported,
                          cached_on_landed=pending.before[landed] if landed is not None else None,
                          best_before=best, best_replica=best_i if best else None, namespace=namespace)
        with self.lock:
            self.requests.append(fr)
            if landed is not None:
                self.replicas[landed].landed += 1
            self.version += 1
        if on_done is not None:
            on_done()
        return fr

    def view(self, snapshot_of: Callable[[BlockTree], TreeSnapshot],
             shown: Callable[[FleetRequest], bool] = lambda q: True) -> FleetView:
        """The fleet as plain data; ``snapshot_of`` draws one replica's blocks and ``shown`` picks the
        requests listed (the caller's viewer rule)."""
        dup = duplication(self.trees)
        replicas = []
        per_token: float | None = None
        for r in self.replicas:
            r.update_state()
            hits = r.metric("radix_prefix_cache_hits_total", "vllm:prefix_cache_hits_total")
            queries = r.metric("radix_prefix_cache_queries_total", "vllm:prefix_cache_queries_total")
            tree_bytes, tree_tokens = r.metric("radix_kv_tree_bytes"), r.metric("radix_cache_tokens")
            if per_token is None and tree_bytes and tree_tokens:
                per_token = tree_bytes / tree_tokens
            with r.blocks.lock:
                held = len(r.blocks.blocks)
                tokens = sum(len(b.token_ids) for b in r.blocks.blocks.values())
            replicas.append(ReplicaView(
                url=r.url, snapshot=snapshot_of(r.blocks), block_size=r.blocks.block_size, blocks_held=held,
                tokens_held=tokens, events_alive=r.events is not None and r.events.alive, requests_landed=r.landed,
                hit_rate=hits / queries if hits is not None and queries else None,
                running=r.metric("radix_num_requests_running", "vllm:num_requests_running", "sglang:num_running_reqs"),
                state=r.state, since=r.since))
        with self.lock:
            requests = tuple(q for q in self.requests if shown(q))
        return FleetView(tuple(replicas), requests, dup.tokens_held, dup.tokens_distinct, dup.tokens_on_several,
                         dup.duplicate_copy_tokens, per_token,
                         int(dup.duplicate_copy_tokens * per_token) if per_token else None)

    def signature(self) -> tuple:
        with self.lock:
            return (self.version, *(r.blocks.version for r in self.replicas))

    def close(self) -> None:
        for r in self.replicas:
            if r.events is not None:
                r.events.close()
            r.client.close()
