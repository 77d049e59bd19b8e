"""The KV pool: one pre-allocated block of token slots, the only home of KV bytes.

Owns: the K and V tensors of every token the engine holds, cached in the tree
and computed by running requests alike, the free list and the byte count.
Knows nothing about trees or requests: it hands out and takes back slots.

Layout, one tensor per layer (so a budget change re-allocates layer by layer
and never holds two whole pools)::

    k[layer] : [kv_head, slot, head_dim]      (v alike)

One token's KV across all layers is one slot, ``bytes_per_token`` bytes. The
pool has exactly ``budget_bytes // bytes_per_token`` slots, so the KV the
process holds can never exceed the budget, whoever holds it.

Free slots are kept as runs ``[start, start + length)``, coalesced on free.
``alloc`` takes the lowest run long enough for the whole request when there is
one, so a request's own slots, and later the tree node they become, are one
contiguous range: attention then reads a segment as a view, never a gather.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch


def contiguous_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split ``slots`` into runs of consecutive slot numbers.

    Returns ``(start_in_slots, first_slot, length)`` triples: a cached prefix is usually
    a handful of runs, so copies become a few slice copies instead of a gather.
    """
    runs: list[tuple[int, int, int]] = []
    i, n = 0, len(slots)
    while i < n:
        j = i + 1
        while j < n and slots[j] == slots[j - 1] + 1:
            j += 1
        runs.append((i, slots[i], j - i))
        i = j
    return runs


class KVPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, budget_bytes: int) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        elem = torch.empty((), dtype=dtype).element_size()
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * elem
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._starts: list[int] = []  # free runs, sorted by start
        self._run_len: dict[int, int] = {}  # start -> length
        self._run_at_end: dict[int, int] = {}  # end (exclusive) -> start
        self._num_free = 0
        self.capacity = 0
        self.budget_bytes = 0
        self._allocate(budget_bytes, keep=())

    # ---------------------------------------------------------------- slots
    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.capacity - self._num_free

    @property
    def bytes_in_use(self) -> int:
        return self.num_used * self.bytes_per_token

    @property
    def num_free_runs(self) -> int:
        return len(self._starts)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` free slots, or None. One contiguous range when a free run is long enough
        (the lowest such), else the lowest runs in address order."""
        if n <= 0:
            return []
        if n > self._num_free:
            return None
        for start in self._starts:
            if self._run_len[start] >= n:
                self._take(start, n)
                return list(range(start, start + n))
        out: list[int] = []
        while len(out) < n:
            start = self._starts[0]
            take = min(self._run_len[start], n - len(out))
            self._take(start, take)
            out.extend(range(start, start + take))
        return out

    def _take(self, start: int, n: int) -> None:
        """Take the first ``n`` slots of the free run at ``start``."""
        length = self._run_len.pop(start)
        del self._run_at_end[start + length]
        i = bisect.bisect_left(self._starts, start)
        if n < length:
            self._starts[i] = start + n  # still sorted: the run only shrinks from the left
            self._run_len[start + n] = length - n
            self._run_at_end[start + length] = start + n
        else:
            del self._starts[i]
        self._num_free -= n

    def free(self, slots: Sequence[int]) -> None:
        """Give slots back; neighbouring free runs merge."""
        if not slots:
            return
        for _, first, length in contiguous_runs(sorted(slots)):
            self._add_run(first, length)

    def _add_run(self, start: int, length: int) -> None:
        self._num_free += length
        end = start + length
        left = self._run_at_end.pop(start, None)
        if left is not None:  # a free run ends where this one starts: extend it
            start = left
            i = bisect.bisect_left(self._starts, start)
            del self._starts[i]
            self._run_len.pop(start)
        right_len = self._run_len.pop(end, None)
        if right_len is not None:  # a free run starts where this one ends: swallow it
            del self._run_at_end[end + right_len]
            del self._starts[bisect.bisect_left(self._starts, end)]
            end += right_len
        bisect.insort(self._starts, start)
        self._run_len[start] = end - start
        self._run_at_end[end] = start

    def check(self) -> None:
        """Assert the free runs are disjoint, sorted, in range and add up (tests call it)."""
        total, prev_end = 0, -1
        for start in self._starts:
            length = self._run_len[start]
            assert length > 0 and start > prev_end, "free runs overlap or touch"
            assert self._run_at_end[start + length] == start
            prev_end = start + length
            total += length
        assert prev_end <= self.capacity and total == self._num_free, "free count does not add up"
        assert len(self._run_len) == len(self._starts) == len(self._run_at_end)

    # ---------------------------------------------------------------- data
    def read_into(self, slots: Sequence[int], k_dst: torch.Tensor, v_dst: torch.Tensor) -> None:
        """Copy the KV of ``slots`` into ``k_dst[:, :, :len(slots)]`` (layer, head, token, dim)."""
        for start, first, length in contiguous_runs(slots):
            for layer in range(self.num_layers):
                k_dst[layer, :, start:start + length].copy_(self.k[layer][:, first:first + length])
                v_dst[layer, :, start:start + length].copy_(self.v[layer][:, first:first + length])

    def write_from(self, slots: Sequence[int], k_src: torch.Tensor, v_src: torch.Tensor) -> None:
        """Store ``k_src[:, :, i]`` (layer, head, token, dim) in ``slots[i]``."""
        for start, first, length in contiguous_runs(slots):
            for layer in range(self.num_layers):
                self.k[layer][:, first:first + length].copy_(k_src[layer, :, start:start + length])
                self.v[layer][:, first:first + length].copy_(v_src[layer, :, start:start + length])

    def gather(self, slots: Sequence[int]) -> torch.Tensor:
        """The KV of ``slots`` as one new tensor ``[2, layer, head, len(slots), dim]`` (a chunk
        for the second tier)."""
        idx = torch.tensor(list(slots), dtype=torch.long, device=self.device)
        return torch.stack([torch.stack([layer.index_select(1, idx) for layer in half]) for half in (self.k, self.v)])

    def scatter(self, slots: Sequence[int], kv: torch.Tensor) -> None:
        """Store ``kv`` (``[2, layer, head, len(slots), dim]``, any device) in ``slots``."""
        if kv.shape[3] != len(slots):
            raise ValueError(f"{kv.shape[3]} tokens of KV for {len(slots)} slots")
        kv = kv.to(self.device)
        idx = torch.tensor(list(slots), dtype=torch.long, device=self.device)
        for layer in range(self.num_layers):
            self.k[layer].index_copy_(1, idx, kv[0, layer])
            self.v[layer].index_copy_(1, idx, kv[1, layer])

    # ---------------------------------------------------------------- budget
    def _allocate(self, budget_bytes: int, keep: Sequence[int]) -> None:
        """(Re)allocate for ``budget_bytes``; the slots in ``keep`` become ``0..len(keep)-1``.
        Layer by layer: at most one old layer is alive beside the new pool."""
        self.budget_bytes = int(budget_bytes)
        self.capacity = max(0, self.budget_bytes // self.bytes_per_token)
        shape = (self.num_kv_heads, self.capacity, self.head_dim)
        idx = torch.tensor(list(keep), dtype=torch.long, device=self.device) if keep else None
        old_k, old_v = self.k, self.v
        self.k, self.v = [], []
        for layer in range(self.num_layers):
            for old, new in ((old_k, self.k), (old_v, self.v)):
                t = torch.empty(shape, dtype=self.dtype, device=self.device)
                if idx is not None:
                    t[:, : len(keep)] = old[layer].index_select(1, idx)
                if old:
                    old[layer] = torch.empty(0)  # let the old layer go now
                new.append(t)
        self._starts, self._run_len, self._run_at_end, self._num_free = [], {}, {}, 0
        if self.capacity > len(keep):
            self._add_run(len(keep), self.capacity - len(keep))

    def rebuild(self, budget_bytes: int, keep: Sequence[int]) -> dict[int, int]:
        """Re-allocate for a new budget, keeping the slots in ``keep`` (which must fit).

        Returns the map old slot -> new slot; the kept slots become 0..len(keep)-1.
        """
        new_capacity = max(0, int(budget_bytes) // self.bytes_per_token)
        keep = list(keep)
        if len(keep) > new_capacity:
            raise ValueError("the kept slots do not fit in the new budget")
        self._allocate(budget_bytes, keep)
        return {old: new for new, old in enumerate(keep)}
