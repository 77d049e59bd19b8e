"""The layer driver's start-up checks: which of the plan's layer drivers runs this model here.

Owns: ``choose_layers(runner, settings)``, each driver's "runs here?" check (``engine.model.plan``'s
``LAYERS``) and the probe forwards behind them. Each driver builds on the one below it for a
Llama-shaped decoder (exact on fused, fused on stack, stack on transformers), so its check asks
about that one first, each probe once, from the bottom; the exact forward of any other family of the
registry is checked against transformers' own forward instead. A check runs the runner's forwards
with explicit arguments (this stack, fused or not): nothing is switched on and off while it runs,
and what it returns (``LayerChoice``) is final. Knows nothing of requests or the cache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.kvcache.kv_pool import KVPool
from engine.model import plan, pool_attention
from engine.model.attention import exact
from engine.model.decoder_stack import DecoderStack
from engine.model.paged_attention import PagedSegment
from engine.model.plan import KernelSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerChoice:
    """The chosen driver, the ones set aside before it (``(decision, option, why)``), and the decoder
    stack it runs (None below ``stack``; its fused layers None below ``fused``)."""

    driver: str
    rejected: tuple[tuple[str, str, str], ...]
    stack: DecoderStack | None


@torch.inference_mode()
def choose_layers(runner, settings: KernelSettings) -> LayerChoice:
    """The layer driver for ``runner``'s model under ``settings`` (module docstring). Runs on the
    runner's compute thread; ``runner`` has its geometry, linears and attention backend already."""
    memo: dict[str, str] = {}
    # the model's family as the exact forward reads it (engine.model.families), or why not
    built = DecoderStack.build(runner.model, fused=not (settings.refusal("layers", "fused")
                                                        and settings.refusal("layers", "exact")))
    checked: dict[str, DecoderStack] = {}  # "stack": the unfused stack checked; "fused": its fused layers too

    def runs(name: str) -> str:
        if name not in memo:
            memo[name] = settings.refusal("layers", name) or checks[name]()
        return memo[name]

    def below(name: str, what: str) -> str:
        why = runs(name)
        return f"needs {what}, which is not used: {why}" if why else ""

    def stack() -> str:
        why = below("transformers", "the pool-reading attention")
        if why:
            return why
        if isinstance(built, str):
            return built
        if not built.plain:
            return (f"{built.parts.recipe.name}'s layer is not Llama-shaped or uses a sliding window: the "
                    "stack's PyTorch layers do not run it (the exact forward does)")
        if not _same_as_transformers(runner, built):
            return "its logits differ from transformers' forward on a probe"
        checked["stack"] = built
        return ""

    def fused() -> str:
        why = below("stack", "the decoder stack")
        if why:
            return why
        if settings.refusal("layers", "fused") or built.fused is None:
            return "the fused layers do not take this model, or our linear kernel does not build here"
        if not _near_unfused(runner, built, lambda pool, segments: runner._paged(pool, segments, False, built, True),
                             "fused decode layers"):
            return "its logits are off the unfused forward's on a probe (or the kernel refused it)"
        return ""

    def exact_check() -> str:
        if isinstance(built, str):
            return built
        if built.plain:  # Llama-shaped: checked against the unfused stack, as the drivers below it
            return below("fused", "the fused layers") or _check_exact(runner, built)
        return _check_exact_family(runner, built)

    checks: dict[str, Callable[[], str]] = {
        "exact": exact_check, "fused": fused, "stack": stack,
        "transformers": lambda: pool_attention.enable(runner.model), "gathered": lambda: ""}
    for name in ("transformers", "stack", "fused", "exact"):  # the probes' order: each needs the one before
        runs(name)
    driver, rejected = plan.choose("layers", settings, runs)
    chosen = built if driver == "exact" or (driver in ("fused", "stack") and "stack" in checked) else None
    if chosen is not None and driver not in ("exact", "fused"):
        chosen.fused = None  # checked but not used: the stack's steps stay unfused (before any forward)
    return LayerChoice(driver, tuple(rejected), chosen)


def _probes(runner) -> tuple[KVPool, list[list[PagedSegment]]]:
    """The start-up checks' forwards: a prefill, then a decode row and a prefill chunk sharing it,
    then the row again (a pool of their own)."""
    pool = KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype, runner.device,
                  40 * runner.kv_bytes_per_token)
    prefix = pool.alloc(20)
    alone = prefix + pool.alloc(2)
    return pool, [[PagedSegment(list(range(3, 23)), 0, prefix)],
                  [PagedSegment([7], 20, alone), PagedSegment([5, 9, 11], 20, prefix + pool.alloc(3))],
                  [PagedSegment([8], 21, alone)]]


def _same_as_transformers(runner, stack: DecoderStack) -> bool:
    """Whether the unfused ``stack`` computes exactly what transformers' forward computes on the probes."""
    (pool, probes), (own, _) = _probes(runner), _probes(runner)
    try:
        for segments in probes:
            plain = runner._paged(pool, segments, False, None)
            direct = runner._paged(own, segments, False, stack)
            if not torch.equal(plain, direct):
                return False
    except Exception:  # noqa: BLE001 - a layer that only looked like one this forward knows
        return False
    return True


def _near_unfused(runner, stack: DecoderStack, run: Callable, what: str) -> bool:
    """Whether ``run(pool, segments)`` gives the unfused stack's logits on every probe up to rounding
    (``fused.bound`` of the largest logit; a misread layer is off by far more), each on a pool of its
    own; a refusal of a kernel counts as no. ``what`` names it in the one log line."""
    (pool, probes), (own, _) = _probes(runner), _probes(runner)
    try:
        for segments in probes:
            plain = runner._paged(pool, segments, False, stack)
            got = run(own, segments)
            bound = stack.fused.bound * max(1.0, float(plain.abs().max()))
            if not bool(torch.isfinite(got).all()) or float((got - plain).abs().max()) > bound:
                log.warning("%s off: logits differ from the unfused forward's on a probe", what)
                return False
    except Exception as exc:  # noqa: BLE001 - a refusal of the kernel: the path before it
        log.warning("%s off: %s", what, exc)
        return False
    return True


def _exact_refusal(runner, stack: DecoderStack) -> str:
    if not stack.exact_ready:
        return "the fused layers lack a tail in C or one attention scale, or do not take this model here"
    if runner.device.type != "cpu" or not exact.takes(
            runner.dtype, runner.query_groups * runner.num_kv_heads, runner.num_kv_heads, runner.head_dim):
        return "the exact attention kernel does not take this model here (dtype, heads or head size)"
    return ""


def _check_exact(runner, stack: DecoderStack) -> str:
    """Why not every forward runs exact (``DecoderStack.forward_exact``), "" where it does: its logits
    are those of the unfused stack up to rounding on the probes (``_near_unfused``)."""
    why = _exact_refusal(runner, stack)
    if why:
        return why
    if not _near_unfused(runner, stack, lambda pool, segments: runner._exact_paged(pool, segments, False, stack),
                         "exact forward"):
        return "its logits are off the unfused forward's on a probe (or a kernel refused it)"
    return ""


def _check_exact_family(runner, stack: DecoderStack) -> str:
    """``_check_exact`` for a family whose layer the unfused stack does not run (``DecoderParts.plain``
    false): the exact forward's logits of a probe prompt, run in three chunks (past a short sliding
    window), against transformers' own forward of it from nothing, within the fused layers' bound."""
    why = _exact_refusal(runner, stack)
    if why:
        return f"{stack.parts.recipe.name}: {why}"
    from transformers import DynamicCache

    ids = [3 + (7 * i) % 61 for i in range(40)]
    try:
        ref = runner._model(DynamicCache(), input_ids=torch.tensor([ids], device=runner.device)).logits[0].float()
        kv = runner.new_request_kv(len(ids))
        got = torch.cat([runner._exact_buffer(ids[a:b], kv, True, stack) for a, b in ((0, 24), (24, 39), (39, 40))])
    except Exception as exc:  # noqa: BLE001 - a refusal of a kernel: the path before it
        log.warning("exact forward off: %s", exc)
        return f"a kernel refused it on a probe ({exc})"
    bound = stack.fused.bound * max(1.0, float(ref.abs().max()))
    if not bool(torch.isfinite(got).all()) or float((got - ref).abs().max()) > bound:
        log.warning("exact forward off: logits differ from transformers' forward on a probe")
        return "its logits are off transformers' forward on a probe"
    return ""
