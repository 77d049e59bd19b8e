"""Choosing the second tier when an engine starts: its fingerprint and its store.

Owns: ``tier_fingerprint`` (what the tier's KV depends on: model, dtype, tokenizer,
geometry and, on disk, a digest of the weights) and ``make_tier`` (a disk folder per
fingerprint and mode, or host memory on a GPU without a folder, or none). Knows the runner
only for its geometry and weights; what the store keeps and its trust rule are
``engine.kvcache.kv_tier``'s, how the cache uses it ``engine.kvcache.second_tier``'s.

The tier's folder (``tier_dir``) is created with mode 0o700 and must be the user's alone
(``tier_folder.unsafe_folder``: the user's or root's, not writable by others unless sticky): one
that others may write gets no second tier (one log line), and its weights' digests are
neither read nor kept there (the weights are hashed in full instead).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from engine.kvcache import kv_tier, tier_folder

if TYPE_CHECKING:
    from engine.model.runner import ModelRunner

log = logging.getLogger(__name__)

__all__ = ["make_tier", "tier_fingerprint"]


def tier_fingerprint(runner: ModelRunner, tier_dir: str | None) -> str:
    """What the second tier's KV depends on (``kv_tier.fingerprint``). On disk that includes a digest
    of the weights (memoized beside the tier's folders, so a start re-hashes only changed files);
    host memory ends with the process, so there the weights need no digest."""
    from engine.model import native_build, native_linear  # torch's side: a remote engine never asks

    weights = "" if tier_dir is None else kv_tier.weights_digest(
        getattr(runner, "weight_files", ()), runner.model, memo=_memo_in(Path(tier_dir)))
    return kv_tier.fingerprint(runner.name, runner.dtype, runner.text.tokenizer, runner.num_layers,
                               runner.num_kv_heads, runner.head_dim, weights=weights,
                               packed_linear=getattr(runner, "packed_linears", 0) > 0,
                               native_linear=native_linear.MAX_ROWS if getattr(runner, "native_linears", 0) else 0,
                               fused_decode=getattr(getattr(runner, "stack", None), "fused", None) is not None,
                               attention=_attention_kernels(runner), isa=native_build.isa(),
                               exact=bool(getattr(runner, "exact", False)))


def _memo_in(tier_dir: Path) -> Path | None:
    """Where the weights' digests are kept: in ``tier_dir`` when it is the user's alone, else nowhere."""
    try:
        tier_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        return None
    return None if tier_folder.unsafe_folder(tier_dir, parent=True) else tier_dir / "weight-digests.json"


def _attention_kernels(runner: ModelRunner) -> str:
    """The runner's attention backend in words (its kernels and their paths), or "" where it has none."""
    backend = getattr(runner, "attention", None)
    return backend.describe() if backend is not None else ""


def make_tier(runner: ModelRunner, tier_bytes: int, tier_dir: str | None, fingerprint: str,
              isolation: bool = False) -> kv_tier.ChunkStore | None:
    """The second tier: a disk folder per model fingerprint and mode (another model, weights or
    dtype never reads it, and an isolated run never reads what a shared run wrote as public) or,
    on a GPU without a folder, host memory. None (one log line) if another engine holds the folder
    or it cannot be made."""
    if tier_bytes <= 0:
        return None
    geometry = kv_tier.ChunkGeometry(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype)
    if tier_dir is None:
        return kv_tier.HostStore(tier_bytes, geometry) if runner.device.type != "cpu" else None
    folder = Path(tier_dir) / f"{fingerprint}-{'isolated' if isolation else 'shared'}"
    try:
        folder.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        why = tier_folder.unsafe_folder(folder.parent, parent=True)
        if why:
            raise tier_folder.TierUnsafe(f"the KV tier's folder {folder.parent} {why}")
        store = kv_tier.DiskStore(folder, tier_bytes, geometry)
    except (tier_folder.TierBusy, tier_folder.TierUnsafe, OSError) as exc:  # held, not the user's alone, or not made
        log.warning("KV tier: running without a second tier: %s", exc)
        return None
    tier_folder.prune_other_tiers(folder.parent, keep=folder)
    return store
