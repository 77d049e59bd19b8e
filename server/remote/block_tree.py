"""A remote engine's KV cache as the blocks it announced: hash-chained, token ids, medium.

Owns: the block store rebuilt from KV events (vLLM's and SGLang's ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``, decoded by ``server.remote.kv_events``), its running
counts per medium (blocks held, stored, evicted), walking a prompt's token ids down the
blocks, and turning blocks into radix nodes for drawing. Pure: no sockets, no threads of its
own, no UI; one lock, so the subscriber's thread can apply while a panel reads.

The model, as vLLM and SGLang publish it:

- a block is ``block_size`` tokens; its hash covers its tokens and its parent's hash (and
  extra keys: a LoRA, a ``cache_salt`` on a request's first block), so the same hash means
  the same content, whatever the medium;
- a block may be held in several media at once ("GPU", "CPU", "STORAGE": SGLang's
  hierarchical cache, vLLM's offloading) and, rarely, twice in one medium (two requests that
  computed it at once): each (hash, medium) pair is counted, like the server counts it;
- a removal names a hash and a medium; a block leaves when no medium holds it. A child
  whose parent left stays (the server still holds its KV, though no new prompt can reach it
  by prefix) and is drawn hanging from the root, flagged ``detached``.

Input: the events come checked (``server.remote.kv_wire``: hashes ints or bytes, token ids
ints, a positive block size, extra keys lists of scalars); applying one does not check again.

Thread safety: every public method takes ``self.lock``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

BlockHash = int | bytes
DEFAULT_MEDIUM = "GPU"  # vLLM says "GPU" even on CPU; SGLang's array form has no medium: its device tier


@dataclass(eq=False)
class Block:
    hash: BlockHash
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    serial: int  # this process's number for the block (stable node ids for drawing)
    stored_at: float  # wall-clock seconds, the event batch's time
    salt: str | None = None  # the cache_salt among the first block's extra keys (vLLM), if any
    media: Counter[str] = field(default_factory=Counter)  # medium -> copies held


class StoredEvent(NamedTuple):
    """One ``BlockStored``, already decoded: ``token_ids`` cover all ``block_hashes`` in order."""

    block_hashes: Sequence[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: Sequence[int]
    block_size: int
    medium: str | None = None
    extra_keys: Sequence[Any] | None = None


class RemovedEvent(NamedTuple):
    block_hashes: Sequence[BlockHash]
    medium: str | None = None


class ClearedEvent(NamedTuple):
    pass


Event = StoredEvent | RemovedEvent | ClearedEvent


class DrawNode(NamedTuple):
    """A run of blocks merged into one radix node for drawing: a chain without branches,
    in one medium set and under one salt."""

    node_id: int  # the first block's serial
    parent_id: int  # 0: the root
    blocks: tuple[Block, ...]
    depth_tokens: int
    medium: str  # the "primary" medium if any block holds it, else the first one
    detached: bool  # its first block's parent is gone (not reachable by prefix)

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(t for b in self.blocks for t in b.token_ids)


def _salt_of(extra_keys: Any) -> str | None:
    """The cache_salt among a block's extra keys: vLLM publishes them untagged, so the one
    string that is not a LoRA name (``lora_name`` is passed apart) is taken as the salt. (This
    engine's publisher puts an opaque tag of a private block's namespaces there: drawn, and
    walked, as a salt nobody here knows.) Anything but a list of keys has no salt."""
    if not isinstance(extra_keys, list | tuple):
        return None
    for key in extra_keys:
        if isinstance(key, str):
            return key
    return None


def _discard(index: dict, key: Any, h: BlockHash) -> None:
    same = index.get(key)
    if same is not None:
        same.discard(h)
        if not same:
            del index[key]


class BlockTree:
    """The blocks a remote engine holds, as its events said (see the module docstring)."""

    def __init__(self, primary_medium: str = DEFAULT_MEDIUM) -> None:
        self.lock = threading.RLock()
        self.primary = primary_medium
        self.blocks: dict[BlockHash, Block] = {}
        # parent hash (None: first blocks) -> held children, kept whether or not the parent is
        # held: a parent stored again after its eviction finds its children again
        self.kids: dict[BlockHash | None, set[BlockHash]] = {}
        self.firsts: dict[tuple[int, ...], set[BlockHash]] = {}  # a first block's tokens -> its hashes (salts, LoRAs)
        self.block_size = 0  # the server's, from the first BlockStored
        self.stored: Counter[str] = Counter()  # running totals, per medium
        self.evicted: Counter[str] = Counter()
        self.held: Counter[str] = Counter()  # (hash, medium) copies held now, per medium
        self.cleared = 0
        self.unknown_removed = 0  # removals of blocks never seen stored (joined late, lost history)
        # vLLM publishes extra_keys (the salt among them); SGLang's array form has none, and its
        # hashes ignore salts: only then may a salted prompt match an unsalted first block
        self.extra_keys_seen = False
        self.version = 0  # bumped by every change (panels compare it)
        self._serial = 0

    # ------------------------------------------------------------- applying events
    def apply(self, event: Event, ts: float | None = None) -> None:
        with self.lock:
            if isinstance(event, StoredEvent):
                self._store(event, time.time() if ts is None else ts)
            elif isinstance(event, RemovedEvent):
                self._remove(event)
            else:
                self._clear()
            self.version += 1

    def apply_all(self, events: Iterable[Event], ts: float | None = None) -> None:
        with self.lock:
            for e in events:
                self.apply(e, ts)

    def reset(self) -> None:
        """Forget everything (the server restarted: its cache starts empty, its counts too)."""
        with self.lock:
            self.blocks.clear()
            self.kids.clear()
            self.firsts.clear()
            self.held.clear()
            self.version += 1

    def _store(self, e: StoredEvent, ts: float) -> None:
        size = int(e.block_size) or 1
        self.block_size = self.block_size or size
        medium = e.medium or DEFAULT_MEDIUM
        parent = e.parent_block_hash
        tokens = tuple(e.token_ids)
        self.extra_keys_seen = self.extra_keys_seen or e.extra_keys is not None
        for i, h in enumerate(e.block_hashes):
            block = self.blocks.get(h)
            if block is None:
                self._serial += 1
                extra = e.extra_keys[i] if e.extra_keys and i < len(e.extra_keys) else None
                block = Block(h, parent, tokens[i * size:(i + 1) * size], self._serial, ts, _salt_of(extra))
                self.blocks[h] = block
                self.kids.setdefault(parent, set()).add(h)  # None: a first block
                if parent is None:
                    self.firsts.setdefault(block.token_ids, set()).add(h)
            block.media[medium] += 1
            self.held[medium] += 1
            self.stored[medium] += 1
            parent = h

    def _remove(self, e: RemovedEvent) -> None:
        medium = e.medium or DEFAULT_MEDIUM
        for h in e.block_hashes:
            block = self.blocks.get(h)
            if block is None or block.media[medium] <= 0:
                self.unknown_removed += 1
                continue
            block.media[medium] -= 1
            if not block.media[medium]:
                del block.media[medium]
            self.held[medium] -= 1
            self.evicted[medium] += 1
            if not block.media:
                del self.blocks[h]
                _discard(self.kids, block.parent, h)
                if block.parent is None:
                    _discard(self.firsts, block.token_ids, h)

    def _clear(self) -> None:
        for medium, n in self.held.items():
            self.evicted[medium] += n
        self.blocks.clear()
        self.kids.clear()
        self.firsts.clear()
        self.held.clear()
        self.cleared += 1

    # ------------------------------------------------------------- reading
    @property
    def num_blocks(self) -> int:
        """(hash, medium) copies held now, all media: what a plain counter of the events holds."""
        with self.lock:
            return sum(self.held.values())

    def counts(self) -> dict[str, dict[str, int]]:
        """Per medium: blocks held now, stored and evicted since this tree started."""
        with self.lock:
            media = sorted(set(self.held) | set(self.stored) | set(self.evicted))
            return {m: {"held": self.held[m], "stored": self.stored[m], "evicted": self.evicted[m]} for m in media}

    def match(self, token_ids: Sequence[int], salt: str | None = None, medium: str | None = None) -> list[Block]:
        """The longest chain of held blocks whose tokens are a prefix of ``token_ids``, from a
        first block (no parent) under ``salt`` (vLLM mixes the salt into the first block; a
        server that does not publish extra keys matches any first block). ``medium``: only
        blocks held there (default: any)."""
        with self.lock:
            size = self.block_size
            if not size:
                return []
            def ok(b: Block) -> bool:
                return medium is None or b.media.get(medium, 0) > 0
            roots = [b for b in map(self.blocks.__getitem__, self.firsts.get(tuple(token_ids[:size]), ())) if ok(b)]
            # Unsalted prompts reach unsalted first blocks only, a salted one its salt's; where the
            # server publishes no extra keys (SGLang, whose hashes ignore salts), any of them.
            if self.extra_keys_seen:
                roots = [b for b in roots if b.salt == salt]
            best: list[Block] = []
            for root in roots:  # a few at most (same text under other salts or LoRAs)
                path, block = [root], root
                while True:
                    i = len(path) * size
                    want = tuple(token_ids[i:i + size])
                    if len(want) < size:
                        break
                    nxt = next((self.blocks[c] for c in self.kids.get(block.hash, ())
                                if self.blocks[c].token_ids == want and ok(self.blocks[c])), None)
                    if nxt is None:
                        break
                    path.append(nxt)
                    block = nxt
                if len(path) > len(best):
                    best = path
            return best

    def draw_nodes(self, key: Callable[[Block], Hashable] | None = None,
                   max_nodes: int | None = None) -> list[DrawNode]:
        """The held blocks as radix nodes, parents first: a block starts a new node where its
        parent branches, where the medium, salt or ``key`` (e.g. its owner) changes, or where it
        has no held parent."""
        with self.lock:
            out: list[DrawNode] = []
            def medium_of(b: Block) -> str:
                return self.primary if self.primary in b.media else next(iter(sorted(b.media)), self.primary)
            tops = sorted((b for b in self.blocks.values() if b.parent is None or b.parent not in self.blocks),
                          key=lambda b: b.serial)
            stack: list[tuple[Block, int, int]] = [(b, 0, 0) for b in reversed(tops)]
            while stack:
                first, parent_id, depth = stack.pop()
                run, block = [first], first
                while len(self.kids.get(block.hash, ())) == 1:
                    child = self.blocks[next(iter(self.kids[block.hash]))]
                    if (medium_of(child) != medium_of(first) or child.salt not in (None, first.salt)
                            or (key is not None and key(child) != key(first))):
                        break
                    run.append(child)
                    block = child
                depth += sum(len(b.token_ids) for b in run)
                out.append(DrawNode(first.serial, parent_id, tuple(run), depth, medium_of(first),
                                    first.parent is not None and first.parent not in self.blocks))
                if max_nodes is not None and len(out) >= max_nodes:
                    break
                for c in sorted((self.blocks[c] for c in self.kids.get(block.hash, ())), key=lambda b: b.serial, reverse=True):
                    stack.append((c, first.serial, depth))
            return out

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` (whatever ``-O`` says) where the indexes disagree with the
        blocks: every block under its parent in ``kids``, the first blocks in ``firsts``, the
        held counts the sum of the blocks' media. Tests call it; it walks the whole tree."""
        def require(ok: bool, what: str) -> None:
            if not ok:
                raise AssertionError(what)
        with self.lock:
            held: Counter[str] = Counter()
            for h, b in self.blocks.items():
                require(b.hash == h and bool(b.media) and all(n > 0 for n in b.media.values()),
                        f"block {h!r}: its hash or media")
                held.update(b.media)
                require(h in self.kids.get(b.parent, ()), f"block {h!r} is not among its parent's kids")
            require({h for hs in self.firsts.values() for h in hs} == self.kids.get(None, set()),
                    "firsts and the parentless kids differ")
            for parent, kids in self.kids.items():
                require(bool(kids) and all(c in self.blocks and self.blocks[c].parent == parent for c in kids),
                        f"the kids of {parent!r}")
            require(+held == +self.held, f"held {dict(self.held)} but the blocks hold {dict(held)}")
