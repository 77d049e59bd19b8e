"""The two settings whose default depends on the device the model runs on.

Owns: ``default_budget_bytes`` (the KV cache's budget) and ``default_chunk_tokens`` (prompt
tokens per scheduler step). ``engine.config`` stays torch-free and leaves both None; the engine
asks here once it meets its runner. Knows nothing of requests or the cache.
"""

from __future__ import annotations

import torch

__all__ = ["default_budget_bytes", "default_chunk_tokens"]


def default_budget_bytes(device: torch.device) -> int:
    """1 GiB on CPU and MPS; on CUDA a quarter of free memory, at most 8 GiB."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(min(free // 4, 8 * 2**30))
    return 2**30


def default_chunk_tokens(device: torch.device) -> int:
    """Prompt tokens per scheduler step: 256 on CPU (about half a second of prefill on two
    cores, so streams keep moving), 2,048 on accelerators."""
    return 256 if device.type == "cpu" else 2048
