"""What names the second tier: the fingerprint of everything its KV depends on.

Owns: ``fingerprint`` (model, weights, dtype, tokenizer, geometry, linear kernels) and
``weights_digest`` (the weights' files, each file's digest kept in a memo so a start hashes them
only when they changed). A tier folder is named by the fingerprint and the mode (docs/TIER.md), so
another model, weights, dtype, tokenizer or mode never reads it. Knows nothing about chunks or stores.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch

log = logging.getLogger("engine.kvcache.kv_tier")  # the tier's one log, as before the split

def fingerprint(model_name: str, dtype: torch.dtype, tokenizer, num_layers: int, num_kv_heads: int,
                head_dim: int, weights: str = "", packed_linear: bool = False, native_linear: int = 0,
                fused_decode: bool = False, attention: str = "") -> str:
    """Names what the KV depends on: the same model, weights (``weights_digest``), dtype,
    tokenizer, geometry, linear kernels (oneDNN-packed or our native linears, and our fused decode
    layers, change the KV's last bits) and attention kernels (``attention``: the backend's own
    description, which names its kernels and their paths; a token's KV past the first layer
    depends on the attention of the layers below it), or nothing."""
    h = hashlib.sha1(f"{model_name}|{dtype}|{num_layers}|{num_kv_heads}|{head_dim}|".encode())
    h.update(f"weights={weights}|packed_linear={int(bool(packed_linear))}|".encode())
    if native_linear:  # our linears (engine.model.native_linear), up to that many float32 rows; absent: the
        h.update(f"native_linear={int(native_linear)}|".encode())  # names tiers had before
    if fused_decode:  # our fused decode layers (engine.model.fused_decode), likewise
        h.update(b"fused_decode=1|")
    if attention:  # the attention backend and its kernels, likewise
        h.update(f"attention={attention}|".encode())
    vocab = sorted(tokenizer.get_vocab().items()) if tokenizer is not None else []
    h.update(repr(vocab).encode("utf-8", "surrogatepass"))
    h.update(str(getattr(tokenizer, "chat_template", "")).encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:16]


def weights_digest(files: Sequence[Path], model: torch.nn.Module | None = None, memo: Path | None = None) -> str:
    """A digest of the model's weights: of the ``files`` they were loaded from (each file's digest
    kept in ``memo``, a JSON file, under its path, size and mtime_ns, so a start hashes the
    weights only when they changed: about 1 s for 540 MB here), or, without files, of the
    ``model``'s tensors as loaded."""
    if files:
        table = _read_memo(memo)
        h = hashlib.sha256()
        changed = False
        for path in sorted(Path(p) for p in files):
            st = path.stat()
            entry = table.get(str(path))
            if isinstance(entry, list) and entry[:2] == [st.st_size, st.st_mtime_ns] and len(entry) == 3:
                digest = str(entry[2])
            else:
                digest = _file_digest(path)
                table[str(path)] = [st.st_size, st.st_mtime_ns, digest]
                changed = True
            h.update(f"{path.name}|{digest}|".encode())
        if changed and memo is not None:
            _write_memo(memo, table)
        return h.hexdigest()[:32]
    if model is None:
        return ""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{t.numel()}|".encode())
        h.update(t.view(torch.uint8).numpy())
    return h.hexdigest()[:32]


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _read_memo(memo: Path | None) -> dict:
    if memo is None:
        return {}
    try:
        table = json.loads(memo.read_text())
        return table if isinstance(table, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_memo(memo: Path, table: dict) -> None:
    tmp = memo.with_name(f"{memo.name}.tmp{os.getpid()}")
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(table))
        os.replace(tmp, memo)
    except OSError as exc:  # the next start hashes again
        tmp.unlink(missing_ok=True)
        log.info("KV tier: could not keep the weights' digest in %s (%s)", memo, exc)
