"""The KV pool: one pre-allocated block of token slots, the only owner of cached KV.

Owns: the K and V tensors of every cached token, the free list, and the byte
count. Knows nothing about trees or requests: it stores and returns slots.

Layout: ``k[layer, kv_head, slot, head_dim]`` (``v`` alike), so one token's KV
across all layers is one slot, and its size is exactly ``bytes_per_token``.
Memory in use is ``num_used * bytes_per_token`` and never exceeds the budget,
because the pool has exactly ``budget_bytes // bytes_per_token`` slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def contiguous_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split ``slots`` into runs of consecutive slot numbers.

    Returns ``(start_in_slots, first_slot, length)`` triples: a fresh pool hands
    out consecutive slots, so a cached prefix is usually a handful of runs and
    copies become a few slice copies instead of a gather.
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
        self.k = self.v = torch.empty(0)
        self._free: list[int] = []
        self._free_sorted = True
        self._allocate(budget_bytes)

    def _allocate(self, budget_bytes: int) -> None:
        self.budget_bytes = int(budget_bytes)
        self.capacity = max(0, self.budget_bytes // self.bytes_per_token)
        shape = (self.num_layers, self.num_kv_heads, self.capacity, self.head_dim)
        self.k = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.v = torch.empty(shape, dtype=self.dtype, device=self.device)
        self._free = list(range(self.capacity - 1, -1, -1))  # descending: alloc pops the lowest
        self._free_sorted = True

    # ---------------------------------------------------------------- slots
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    @property
    def bytes_in_use(self) -> int:
        return self.num_used * self.bytes_per_token

    def alloc(self, n: int) -> list[int] | None:
        """``n`` free slots, lowest first (so they tend to be consecutive), or None."""
        if n > len(self._free):
            return None
        if not self._free_sorted:
            self._free.sort(reverse=True)
            self._free_sorted = True
        # _free is kept in descending order: pop from the end for the lowest slots.
        out = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        return out

    def free(self, slots: Sequence[int]) -> None:
        if slots:
            self._free.extend(slots)
            self._free_sorted = False

    # ---------------------------------------------------------------- data
    def read_into(self, slots: Sequence[int], k_dst: torch.Tensor, v_dst: torch.Tensor) -> None:
        """Copy the KV of ``slots`` into ``k_dst[:, :, :len(slots)]`` (layer, head, token, dim)."""
        for start, first, length in contiguous_runs(slots):
            k_dst[:, :, start:start + length].copy_(self.k[:, :, first:first + length])
            v_dst[:, :, start:start + length].copy_(self.v[:, :, first:first + length])

    def write_from(self, slots: Sequence[int], k_src: torch.Tensor, v_src: torch.Tensor) -> None:
        """Store ``k_src[:, :, i]`` (layer, head, token, dim) in ``slots[i]``."""
        for start, first, length in contiguous_runs(slots):
            self.k[:, :, first:first + length].copy_(k_src[:, :, start:start + length])
            self.v[:, :, first:first + length].copy_(v_src[:, :, start:start + length])

    def rebuild(self, budget_bytes: int, keep: Sequence[int]) -> dict[int, int]:
        """Re-allocate for a new budget, keeping the slots in ``keep`` (which must fit).

        Returns the map old slot -> new slot; the kept slots become 0..len(keep)-1.
        """
        new_capacity = max(0, int(budget_bytes) // self.bytes_per_token)
        if len(keep) > new_capacity:
            raise ValueError("the kept slots do not fit in the new budget")
        old_k, old_v = self.k, self.v
        keep = list(keep)
        self._allocate(budget_bytes)
        mapping = {old: new for new, old in enumerate(keep)}
        if keep:
            idx = torch.tensor(keep, device=self.device)
            self.k[:, :, : len(keep)] = old_k.index_select(2, idx)
            self.v[:, :, : len(keep)] = old_v.index_select(2, idx)
        self._free = list(range(self.capacity - 1, len(keep) - 1, -1))
        self._free_sorted = True
        return mapping
