"""Transformers ``Cache`` objects over the engine's KV: scratch buffers and the pool.

The scheduler's requests keep their KV in the pool (``engine.kvcache.kv_pool``): in a
forward over it, ``PoolWriteCache`` writes each new token's key and value to
its slot, and the attention (``engine.model.paged_attention``) reads the pool.

``RequestKV`` is a scratch buffer outside the pool, for single-request paths
(the prefill benchmark, timings, tools, tests): one pre-allocated buffer that the model appends to in place.

Owns: the KV of the one request being run, as a transformers ``Cache`` whose
layers write new keys and values into a buffer sized for the whole request
(prompt plus new tokens). ``DynamicCache`` grows by ``torch.cat`` and copies
every layer on every step; this buffer is filled once from the pool (the
cached prefix) and then only appended to, so the prefix is copied exactly once.

Buffer layout: ``k[layer, kv_head, token, head_dim]``, the pool's layout, so
pool <-> buffer copies are plain slice copies.
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, DynamicLayer


class _BufferLayer(DynamicLayer):
    """One layer's view of the request buffer; ``keys`` is always the filled part."""

    def __init__(self, owner: RequestKV, layer_idx: int) -> None:
        super().__init__()
        # Weak: a strong reference back would make every buffer a cycle, freed only by the cyclic
        # garbage collector, so a timing's 100 MB scratch buffers piled up between collections
        # (2.3 GB over the budget with eight tabs timing at once); now the last reference frees it.
        self._owner_ref, self._idx = weakref.ref(owner), layer_idx
        self.length = 0

    @property
    def _owner(self) -> RequestKV:
        owner = self._owner_ref()
        if owner is None:
            raise RuntimeError("this request buffer was freed")
        return owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True
        self._refresh()

    def _refresh(self) -> None:
        o = self._owner
        self.keys = o.k[self._idx, :, : self.length].unsqueeze(0)
        self.values = o.v[self._idx, :, : self.length].unsqueeze(0)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self._owner.ensure_capacity(self.length + n)
        o = self._owner
        o.k[self._idx, :, self.length : self.length + n] = key_states[0]
        o.v[self._idx, :, self.length : self.length + n] = value_states[0]
        self.length += n
        self._refresh()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("request buffers are never cropped")


class RequestKV:
    """KV buffer for one request, batch size 1."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, num_kv_heads, max(1, capacity), head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.layers = [_BufferLayer(self, i) for i in range(num_layers)]
        self.cache = Cache(layers=self.layers)

    @property
    def length(self) -> int:
        """Tokens whose KV is in the buffer (all layers agree between forwards)."""
        return self.layers[0].length

    def ensure_capacity(self, n: int) -> None:
        if n <= self.k.shape[2]:
            return
        grow = max(n, 2 * self.k.shape[2])
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_empty((old.shape[0], old.shape[1], grow, old.shape[3]))
            new[:, :, : old.shape[2]] = old
            setattr(self, name, new)
        for layer in self.layers:
            if layer.is_initialized:
                layer._refresh()

    def prefill_from(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Declare the first ``n`` tokens filled (by the caller, through the returned views)."""
        self.ensure_capacity(n)
        for layer in self.layers:
            layer.length = n
            if layer.is_initialized:
                layer._refresh()
        return self.k[:, :, :n], self.v[:, :, :n]


class _PassThroughLayer(DynamicLayer):
    """A layer of a forward whose attention reads KV elsewhere (the requests' buffers, the pool):
    ``store`` puts the new keys and values there; the layer itself holds nothing."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.store(key_states, value_states)
        return key_states, value_states  # attention reads where ``store`` put them, not these

    def store(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise NotImplementedError

    def get_seq_length(self) -> int:
        return 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("these forwards' caches are never cropped")


class _PoolWriteLayer(_PassThroughLayer):
    """One layer of a forward over the pool: the pack's new keys and values go to their slots."""

    def __init__(self, pool, write_index: torch.Tensor, layer_idx: int) -> None:
        super().__init__()
        self._pool, self._index, self._idx = pool, write_index, layer_idx

    def store(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._pool.k[self._idx].index_copy_(1, self._index, key_states[0])
        self._pool.v[self._idx].index_copy_(1, self._index, value_states[0])


class PoolWriteCache(Cache):
    """The cache of ``ModelRunner.forward_paged``: token ``i`` of the pack stores its KV in
    pool slot ``write_index[i]``."""

    def __init__(self, pool, write_index: torch.Tensor) -> None:
        super().__init__(layers=[_PoolWriteLayer(pool, write_index, i) for i in range(pool.num_layers)])
