"""A remote engine's real blocks as the dashboard's plain data (``TreeSnapshot``).

Owns: who a block belongs to for display, and the block tree -> ``NodeInfo`` conversion.

- A block's *owner* is the namespace of a request of this dashboard whose tokens (prompt
  and answer, under that request's ``cache_salt``) walk down to it; a block that no
  recorded request walks through (other clients of the server, old history) belongs to
  ``OTHERS``, which no visitor may see (``engine.snapshot_view.may_see``), so under
  isolation ``for_viewer`` folds it into a coarse "others" node with no text, like another
  visitor's. With isolation off every block is drawn with its text.
- Blocks become radix nodes where the chain branches, or the owner, medium or salt changes
  (``BlockTree.draw_nodes``); a medium other than the primary one ("GPU") is drawn as the
  second tier (``spilled``), named by ``tier_kind`` (the media held, with vLLM's words for its
  offloading tiers: "CPU" host memory, "STORAGE" disk; this engine publishes its own tier so).

Pure: plain data in, plain data out; no sockets, no UI.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable

from engine.types import NodeInfo, TreeSnapshot
from server.remote.block_tree import BlockHash, BlockTree

MEDIA_WORDS = {"CPU": "host memory", "STORAGE": "disk or remote storage"}  # vLLM's offloading tiers
OTHERS = "~backend"  # the owner of blocks no request of this dashboard reaches (never a visitor's namespace)
ORIGIN = "events"  # TreeSnapshot.origin of a tree drawn from the server's own events


def owners(tree: BlockTree, walks: Iterable[tuple[str, list[int], str | None]]) -> tuple[dict[BlockHash, str],
                                                                                         Counter[BlockHash]]:
    """Block hash -> owning namespace, and hash -> how many walks passed through it, for
    ``walks`` of ``(namespace, token ids, salt)``, newest last (a later walk wins a tie)."""
    owner: dict[BlockHash, str] = {}
    hits: Counter[BlockHash] = Counter()
    for namespace, ids, salt in walks:
        for b in tree.match(ids, salt):
            owner[b.hash] = namespace
            hits[b.hash] += 1
    return owner, hits


def block_snapshot(tree: BlockTree, owner: dict[BlockHash, str], hits: Counter[BlockHash] | None = None,
                   now: float | None = None, max_nodes: int = 20_000) -> TreeSnapshot:
    """The tree's held blocks as a full snapshot (no viewer rule applied yet, no text)."""
    now = time.time() if now is None else now
    hits = hits or Counter()
    with tree.lock:
        nodes = tree.draw_nodes(key=lambda b: owner.get(b.hash, OTHERS), max_nodes=max_nodes)
        primary, bs = tree.primary, tree.block_size or 1
        evicted = sum(tree.evicted.values()) * bs
        tiers = [f"{m}: {MEDIA_WORDS[m]}" if m in MEDIA_WORDS else m
                 for m in sorted(m for m in tree.held if m != primary and tree.held[m] > 0)]
    infos = []
    for n in nodes:
        ids = n.token_ids
        infos.append(NodeInfo(
            node_id=n.node_id, parent_id=n.parent_id, num_tokens=len(ids), depth_tokens=n.depth_tokens, num_bytes=0,
            lock_ref=0, hits=max(hits.get(b.hash, 0) for b in n.blocks),
            last_access_s_ago=max(0.0, now - max(b.stored_at for b in n.blocks)),
            namespace=owner.get(n.blocks[0].hash, OTHERS), hidden=False, token_ids=ids, text="",
            spilled=n.medium != primary))
    in_pool = sum(i.num_tokens for i in infos if not i.spilled)
    return TreeSnapshot(tuple(infos), in_pool, 0, 0, 0, evicted, 0, tier_kind=", ".join(tiers), origin=ORIGIN)
