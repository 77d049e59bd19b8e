"""The attention backend's contract: one call attends some query rows over one segment of keys.

Owns: ``AttentionBackend`` (what every kernel implements) and ``Causal`` (the causal rule
of a prefill chunk, handed to the kernel as a rule so that no backend has to be given a
dense mask). Knows nothing about the pool, the plan or the model: the caller
(``engine.model.paged_attention.PagedPlan``) cuts the pool into segments, folds
grouped-query heads into the rows, and merges the partial results of several segments by
their log-sum-exp.

One call, in shapes (``B`` batch, ``H`` heads, ``M`` query rows, ``L`` keys, ``D`` head size)::

    q [B, H, M, D]   k, v [B, H, L, D]   (same H: grouped heads already folded into M)
    mask    additive float, broadcastable to [B, 1, M, L], or None   (decode rows' padding)
    causal  Causal rule, or None                                     (a prefill chunk's rest)
    ->  out [B, H, M, D] in q's dtype (or float32),  lse [B, H, M] float32

``lse[b, h, m]`` is the natural log of the sum over visible keys of ``exp(scale * q.k)``,
so two calls over disjoint key sets merge exactly (``paged_attention.merge``). Every row
the caller hands in sees at least one key; a row that sees none has ``lse = -inf``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch


@dataclass
class Causal:
    """A prefill chunk's causal rule over its rest segment, with grouped heads folded::

        query row r  is the token at position  q_start + r % period
        key j        is the token at position  k_start + j
        key j visible to row r  iff  k_start + j <= q_start + r % period

    (``period`` is the chunk's token count ``n``: the ``g`` query heads of a KV head are
    ``g`` blocks of ``n`` rows.) ``dense`` caches the ``[period, length]`` additive mask for
    backends whose kernel takes one, so it is built once per forward, not once per layer."""

    q_start: int
    k_start: int
    period: int
    length: int  # keys in the segment
    device: torch.device
    _dense: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def dense(self) -> torch.Tensor:
        """Additive float32 mask ``[period, length]``: 0 where visible, -inf elsewhere."""
        if self._dense is None:
            q_pos = torch.arange(self.q_start, self.q_start + self.period, device=self.device)[:, None]
            k_pos = torch.arange(self.k_start, self.k_start + self.length, device=self.device)[None, :]
            mask = torch.zeros((self.period, self.length), device=self.device)
            self._dense = mask.masked_fill_(k_pos > q_pos, float("-inf"))
        return self._dense

    def hidden(self, rows: range, keys: range) -> torch.Tensor:
        """Boolean ``[len(rows), len(keys)]``: True where the key is hidden from the row."""
        q_pos = self.q_start + torch.arange(rows.start, rows.stop, device=self.device) % self.period
        k_pos = torch.arange(self.k_start + keys.start, self.k_start + keys.stop, device=self.device)
        return k_pos[None, :] > q_pos[:, None]

    def positions(self, rows: range) -> tuple[int, int]:
        """The first and last query position among ``rows`` (they wrap every ``period`` rows)."""
        first, last = rows.start % self.period, (rows.stop - 1) % self.period
        if rows.stop - rows.start >= self.period or last < first:
            return self.q_start, self.q_start + self.period - 1
        return self.q_start + first, self.q_start + last


class AttentionBackend(ABC):
    """One attention kernel. Chosen once when the runner starts (its execution plan,
    ``engine.model.plan``) and called per layer per segment."""

    name: ClassVar[str]  # what RADIX_KERNELS=attention=<name> selects (engine.model.plan)
    devices: ClassVar[frozenset[str] | None]  # the device types it runs on (None: any)

    @classmethod
    def runs_on(cls, device: torch.device) -> bool:
        return cls.devices is None or device.type in cls.devices

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               mask: torch.Tensor | None = None, causal: Causal | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``q`` over ``k``/``v`` under ``mask`` and/or ``causal`` (module docstring):
        ``(out in q's dtype or float32, lse float32)``."""

    def takes_rows(self, dtype: torch.dtype, rows: int, head_dim: int) -> bool:
        """Whether ``attend_rows`` serves decode rows of ``rows`` query rows each (a token's
        grouped heads) in ``dtype`` and ``head_dim``; the plan then reads every decode row's
        own slots that way instead of gathering them."""
        return False

    def cut_rows(self, rows: list[tuple[int, list[tuple[int, int]]]]) -> object:
        """Decode rows ``(pack position, runs (first slot, length))`` in the form
        ``attend_rows`` takes (once per forward, for every layer)."""
        raise NotImplementedError

    def attend_rows(self, q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, cut: object, scale: float,
                    out: torch.Tensor, lse: torch.Tensor) -> None:
        """Each decode row ``cut`` names, ``g`` query rows per KV head of the pack's queries
        ``q [Hq, T, D]``, over its runs of the pool layer ``k_layer``/``v_layer`` ``[H, S, D]``
        (all visible, one sequence): writes its values and log-sum-exp into ``out [Hq, T, D]``
        and ``lse [Hq, T]`` (float32) at its position."""
        raise NotImplementedError

    def merge_prefix(self, q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor,
                     runs: tuple[tuple[int, int], ...], scale: float, out: torch.Tensor, lse: torch.Tensor) -> bool:
        """A shared prefix's attention merged in place: the rows ``q [Hq, n, D]`` (``n`` tokens, a
        view of the pack's queries) over the ``runs`` ``(first slot, length)`` of the pool layer
        ``k_layer``/``v_layer`` ``[H, S, D]``, all visible, merged into ``out [Hq, n, D]`` and
        ``lse [Hq, n]`` (float32 views), which hold the same rows' attention over their other keys.
        Returns False, touching nothing, where this backend does not (the plan then calls
        ``attend`` per run and merges in PyTorch)."""
        return False

    @property
    def workspace_cap_bytes(self) -> int | None:
        """The most scratch memory one call allocates beyond its inputs and outputs, or None
        when the backend does not bound it (a kernel's own blocks, a dense mask)."""
        return None

    def describe(self) -> str:
        """The backend in words (for the engine info)."""
        return self.name
