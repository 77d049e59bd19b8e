"""The model runner: the only code that runs the transformers model.

Owns: forward passes on a request's KV buffer, packed forwards over many requests'
buffers, the scheduler's forward over the KV pool, a reference prefill from scratch, and
the model's KV geometry. Every forward runs on the runner's one compute thread
(``engine.model.compute_thread``), whoever calls it; on an x86 CPU in float32 the
model's linears are oneDNN-packed (``engine.model.packed_linear``). Holds the model's
text half as ``text`` (``engine.text.codec.TextCodec``: template, encode, decode, eos)
and does no text itself. Knows nothing about the radix tree, the pool's policy or the
scheduler: it is handed token ids and buffers.

The scheduler's forward is ``forward_paged``: several requests' new tokens (decode
tokens and prefill chunks alike) packed into one ``[1, total]`` sequence, each token with
its own position, every request's KV in the pool. Everything but attention (embeddings,
projections, MLP, logits) runs once over the pack, which is where the time goes on a CPU
(the weights are read once per forward); attention reads each request's slots in the pool
(``engine.model.paged_attention``: a shared prefix once for all). A Llama-family model runs
it through ``engine.model.decoder_stack`` (its own layers called directly), any other
batchable model through transformers' forward with that attention registered in its place
(``_paged_attention``). The other paths are single-request: ``forward``/``forward_last`` on a
scratch buffer (tests' references, the warm start) and ``reference_prefill`` (a fresh buffer,
no cache: tests' and benches' reference logits).

Which of these runs, with which linears and attention, is chosen once as the runner is built:
its ``plan`` (``engine.model.plan.ExecutionPlan``), built from the plan's registry with the
start-up probes below as the checks. The forwards act on the plan; nothing here reads a setting.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.held_signals import release_signals
from engine.kvcache.kv_pool import KVPool
from engine.kvcache.request_kv import PoolWriteCache, RequestKV
from engine.model import native_build, native_linear, plan
from engine.model.attention import AttentionBackend, exact
from engine.model.compute_thread import ComputeThread, TurnLock
from engine.model.decoder_stack import DecoderStack
from engine.model.loader import LoadedModel
from engine.model.native_linear import use_native_linears
from engine.model.packed_linear import pack_linears
from engine.model.paged_attention import PagedPlan, PagedSegment
from engine.model.plan import ExecutionPlan, KernelSettings
from engine.text.codec import TextCodec
from engine.types import EngineError, EngineFault, SamplingParams

log = logging.getLogger(__name__)

PAGED_ATTENTION = "radix_paged"
_batch = threading.local()  # the plan and pool of the paged forward running on this thread, if any


def _paged_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA, except inside ``forward_paged`` through transformers' forward: there every request
    attends over its slots in the pool (``engine.model.paged_attention``: a shared prefix read
    once for all). Outside it, plain SDPA with SDPA's masks: single-request paths are unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    paged = getattr(_batch, "paged", None)
    if paged is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        raise EngineError("this model's attention (soft-capping or position bias) cannot read the KV pool")
    plan, pool = paged
    scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
    return plan.attention(pool.k[module.layer_idx], pool.v[module.layer_idx], query, scale), None


def _register_paged_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(PAGED_ATTENTION, _paged_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PAGED_ATTENTION, sdpa_mask)


def cache_argument(model: torch.nn.Module) -> str:
    """The name of the forward's cache argument: ``cache`` on the transformers line this project pins
    (5.24), ``past_key_values`` on older ones (5.17, the GPU machine's). Read off the signature once,
    never tried: an old forward takes an unknown ``cache=`` into its ``**kwargs`` and runs on a cache
    of its own, silently, while a new one only warns about ``past_key_values=``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@dataclass(frozen=True)
class _BufferLayers:
    """A scratch buffer's layers as a forward over the pool reads them: ``k[layer]`` ``[H, S, D]``."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]


@dataclass(frozen=True)
class RowFuture:
    """What a decode row's next tokens depend on besides the model: a runner that computes
    elsewhere (``engine.zerogpu``) may use it to compute the following steps ahead; this one
    ignores it. ``history`` is the answer so far."""

    sampling: SamplingParams
    history: tuple[int, ...]
    max_new_tokens: int


def _on_compute_thread(method):
    """Run a runner method on the runner's compute thread, whichever thread calls it."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        return self.compute.call(method, self, *args, **kwargs)

    return wrapper


class ModelRunner:
    in_process_forwards = True  # False for a runner whose forwards run elsewhere (engine.zerogpu)

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        # Every forward runs on this one thread (see engine.model.compute_thread: one OpenMP pool).
        self.compute = ComputeThread()
        self.model = loaded.model
        self.name, self.device, self.dtype = loaded.name, loaded.device, loaded.dtype
        self.weight_files = loaded.weight_files  # what the second tier's fingerprint hashes
        self.cache_arg = cache_argument(self.model)  # every forward below passes its cache by this name
        cfg = self.model.config.get_text_config(decoder=True)
        self.max_context = int(getattr(cfg, "max_position_embeddings", None)
                               or getattr(cfg, "n_positions", None) or 2048)
        settings = plan.read_settings()  # the one reading of RADIX_KERNELS and its aliases
        # The linears (CPU bf16 with native bf16: oneDNN-packed weights; CPU fp32: our kernel, few rows),
        # checked on the compute thread: the packing check runs a product (one OpenMP pool).
        linear, rejected = self.compute.call(plan.choose, "linear", settings, plan.linear_check(self.model, settings))
        self.packed_linears = (self.compute.call(pack_linears, self.model, plan.packed_dtypes(settings))
                               if linear == "packed" else 0)
        self.native_linears = self.compute.call(use_native_linears, self.model) if linear == "native" else 0
        # Read the KV geometry off a one-token forward: works for any architecture.
        layers = self.compute.call(self._probe_layers)
        self.num_layers = len(layers)
        _, self.num_kv_heads, _, self.head_dim = layers[0].keys.shape
        elem = torch.empty((), dtype=self.dtype).element_size()
        self.kv_bytes_per_token = 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem
        # The text half (template, encode, decode, eos): no forward, so remote mode has it too.
        self.text = TextCodec(loaded.tokenizer, vocab_size=int(self.model.get_input_embeddings().num_embeddings),
                              model_eos=getattr(self.model.generation_config, "eos_token_id", None))
        self.lock = TurnLock()  # one forward at a time, whichever engine asks
        # forward_paged's attention kernel: the first backend that runs on the device, or the one named
        self.attention: AttentionBackend
        self.attention, set_aside = plan.choose_attention(self.device, settings)
        self.query_groups = int(cfg.num_attention_heads) // self.num_kv_heads  # query heads per KV head
        # The layer driver: forward_paged's own layer-by-layer forward (engine.model.decoder_stack) where
        # the model is a Llama-family decoder and it checks out bit for bit against transformers' forward,
        # its fused layers and the exact forward (issue 44) where they check out too.
        self.stack: DecoderStack | None = None
        driver, dropped = self.compute.call(self._choose_layers, settings)
        fused = self.stack.fused if self.stack is not None else None
        self.plan = ExecutionPlan(layers=driver, linear=linear, attention=self.attention.name,
                                  rejected=tuple(rejected + set_aside + dropped),
                                  fused_max_rows=fused.max_rows if fused is not None else 0,
                                  linear_max_rows=native_linear.MAX_ROWS if self.native_linears
                                  and self.dtype == torch.float32 else 0, switches=settings.switches)
        if driver != "exact":  # nothing falls back silently: the log, the engine info and --explain-kernels say why
            log.warning("%s: the forward is %s, not exact: %s", self.name, driver, self.plan.why_not("exact"))
        self.compute.call(self._warm_up)

    @torch.inference_mode()
    def _choose_layers(self, settings: KernelSettings) -> tuple[str, list[tuple[str, str, str]]]:
        """The layer driver (``engine.model.plan``): each driver's check builds on the one below it
        (exact on fused, fused on stack, stack on transformers), each probe runs once, in that order
        from the bottom; ``self.stack`` is left as the chosen driver needs it (None below stack)."""
        memo: dict[str, str] = {}
        # the model's family as the exact forward reads it (engine.model.families), or why not
        built = DecoderStack.build(self.model, fused=not (settings.refusal("layers", "fused")
                                                          and settings.refusal("layers", "exact")))

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
            if settings.refusal("layers", "fused"):
                built.fused = None
            self.stack = self._check_stack(built)
            return "" if self.stack is not None else "its logits differ from transformers' forward on a probe"

        def fused() -> str:
            why = below("stack", "the decoder stack")
            if why:
                return why
            if self.stack.fused is None:
                return "the fused layers do not take this model, or our linear kernel does not build here"
            if not self._check_fused(self.stack, *self._probes()):
                self.stack.fused = None
                return "its logits are off the unfused forward's on a probe (or the kernel refused it)"
            return ""

        def exact_check() -> str:
            if isinstance(built, str):
                return built
            if built.plain:  # Llama-shaped: checked against the unfused stack, as the drivers below it
                return below("fused", "the fused layers") or self._check_exact()
            self.stack = built  # the other families: checked against transformers' own forward
            return self._check_exact_family()

        checks: dict[str, Callable[[], str]] = {
            "exact": exact_check,
            "fused": fused, "stack": stack, "transformers": self._enable_batching, "gathered": lambda: ""}
        for name in ("transformers", "stack", "fused", "exact"):  # the probes' order: each needs the one before
            runs(name)
        driver, rejected = plan.choose("layers", settings, runs)
        if driver not in ("exact", "fused") and self.stack is not None:
            self.stack.fused = None  # checked but not used: the stack's steps stay unfused
        if driver not in ("exact", "fused", "stack"):
            self.stack = None
        return driver, rejected

    @torch.inference_mode()
    def _probe_layers(self) -> list:
        from transformers import DynamicCache

        release_signals()  # held wake-ups go out as the model's work starts (compute_thread)
        cache = DynamicCache()
        self._model(cache, input_ids=torch.tensor([[0]], device=self.device))
        return cache.layers

    def _enable_batching(self) -> str:
        """Switch the model to the pool-reading attention, where that is exact: SDPA models
        with full attention in every layer (no sliding window, no logit soft-capping); "" then,
        else why not. Others decode one request per forward (still scheduled together)."""
        cfg = self.model.config.get_text_config(decoder=True)
        if getattr(cfg, "sliding_window", None) or getattr(cfg, "attn_logit_softcapping", None):
            return "a sliding window or logit soft-capping: attention over the pool would not be exact"
        if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
            return "a layer without full attention"
        if self.model.config._attn_implementation not in ("sdpa", PAGED_ATTENTION):
            return f"the model's attention is {self.model.config._attn_implementation}, not SDPA"
        try:
            _register_paged_attention()
            self.model.set_attn_implementation(PAGED_ATTENTION)
        except Exception as exc:  # noqa: BLE001 - an architecture that does not take registered attention
            return f"the model does not take registered attention ({exc})"
        if self.model.config._attn_implementation != PAGED_ATTENTION:
            return "the model does not take registered attention"
        return ""

    @torch.inference_mode()
    def _check_stack(self, stack: DecoderStack) -> DecoderStack | None:
        """``stack`` if it computes exactly what transformers' forward computes on a probe: a
        prefill, then a decode row and a prefill chunk sharing it (its fused layers set aside:
        ``_check_fused`` checks them on their own, within a bound); else None."""
        pool, probes = self._probes()
        fused, stack.fused = stack.fused, None
        try:
            for segments in probes:
                plain = self._paged(pool, segments, False, None)
                direct = self._paged(pool, segments, False, stack)
                if not torch.equal(plain, direct):
                    return None
        except Exception:  # a layer that only looked like one this forward knows
            return None
        stack.fused = fused
        return stack

    def _check_fused(self, stack: DecoderStack, pool: KVPool, probes: list[list[PagedSegment]]) -> bool:
        """Whether the stack's fused decode layers (``engine.model.fused_decode``) give the logits
        of its unfused forward on the probes, up to rounding (another order of operations:
        ``fused.bound`` of the largest logit; a misread layer is off by far more)."""
        return self._near_unfused(stack, pool, probes, lambda segments: self._paged(pool, segments, False, stack),
                                  "fused decode layers")

    def _probes(self) -> tuple[KVPool, list[list[PagedSegment]]]:
        """The start-up checks' forwards: a prefill, then a decode row and a prefill chunk sharing it,
        then the row again (a pool of their own)."""
        pool = KVPool(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.device,
                      40 * self.kv_bytes_per_token)
        prefix = pool.alloc(20)
        alone = prefix + pool.alloc(2)
        return pool, [[PagedSegment(list(range(3, 23)), 0, prefix)],
                      [PagedSegment([7], 20, alone), PagedSegment([5, 9, 11], 20, prefix + pool.alloc(3))],
                      [PagedSegment([8], 21, alone)]]

    def _near_unfused(self, stack: DecoderStack, pool: KVPool, probes: list[list[PagedSegment]], run, what: str) -> bool:
        """Whether ``run(segments)`` (with the stack's fused layers on) gives the unfused stack's logits
        on every probe up to rounding (``fused.bound`` of the largest logit; a misread layer is off by far
        more); a refusal of a kernel counts as no. ``what`` names it in the one log line."""
        fused = stack.fused
        try:
            for segments in probes:
                stack.fused = None
                plain = self._paged(pool, segments, False, stack)
                stack.fused = fused
                got = run(segments)
                bound = fused.bound * max(1.0, float(plain.abs().max()))
                if not bool(torch.isfinite(got).all()) or float((got - plain).abs().max()) > bound:
                    log.warning("%s off: logits differ from the unfused forward's on a probe", what)
                    return False
        except Exception as exc:  # noqa: BLE001 - a refusal of the kernel: the path before it
            log.warning("%s off: %s", what, exc)
            return False
        finally:
            stack.fused = fused
        return True

    @property
    def can_batch(self) -> bool:
        """Whether ``forward_paged`` packs many requests into one forward (the plan's layer driver
        is not ``gathered``)."""
        return self.plan.layers != "gathered"

    @property
    def exact(self) -> bool:
        """Whether the plan chose the exact forward (issue 44)."""
        return self.plan.layers == "exact"

    @property
    def runs_exact(self) -> bool:
        """Whether forwards run exact now: the plan's driver (``exact``), and the stack and its fused
        layers still there (a test or a caller that drops them gets the paths they name)."""
        stack = self.stack
        return bool(self.exact and stack is not None and stack.fused is not None)

    @torch.inference_mode()
    def _check_exact(self) -> str:
        """Why not every forward runs exact (``DecoderStack.forward_exact``), "" where it does: where
        it can, its logits are those of the unfused stack up to rounding on the probes
        (``_check_fused``'s bound; a misread layer is off by far more)."""
        stack = self.stack
        if not stack.exact_ready:
            return "the fused layers lack a tail in C, one attention scale or whole-head rotary"
        if self.device.type != "cpu" or not exact.takes(
                self.dtype, self.query_groups * self.num_kv_heads, self.num_kv_heads, self.head_dim):
            return "the exact attention kernel does not take this model here (dtype, heads or head size)"
        pool, probes = self._probes()
        if not self._near_unfused(stack, pool, probes, lambda segments: self._exact_paged(pool, segments, False),
                                  "exact forward"):
            return "its logits are off the unfused forward's on a probe (or a kernel refused it)"
        return ""

    @torch.inference_mode()
    def _check_exact_family(self) -> str:
        """``_check_exact`` for a family whose layer the unfused stack does not run (``DecoderParts.plain``
        false): the exact forward's logits of a probe prompt, run in three chunks, against transformers'
        own forward of it from nothing, within the fused layers' bound (``FusedLayers.bound`` of the
        largest logit; a misread recipe is off by far more)."""
        stack = self.stack
        if not stack.exact_ready:
            return f"{stack.parts.recipe.name}: the fused layers do not take it here (dtype, sizes) or lack a tail in C"
        if self.device.type != "cpu" or not exact.takes(
                self.dtype, self.query_groups * self.num_kv_heads, self.num_kv_heads, self.head_dim):
            return "the exact attention kernel does not take this model here (dtype, heads or head size)"
        from transformers import DynamicCache

        ids = [3 + (7 * i) % 61 for i in range(40)]
        try:
            ref = self._model(DynamicCache(), input_ids=torch.tensor([ids], device=self.device)).logits[0].float()
            kv = self.new_request_kv(len(ids))
            got = torch.cat([self._exact_buffer(ids[a:b], kv, every_position=True)
                             for a, b in ((0, 24), (24, 39), (39, 40))])
        except Exception as exc:  # noqa: BLE001 - a refusal of a kernel: the path before it
            log.warning("exact forward off: %s", exc)
            return f"a kernel refused it on a probe ({exc})"
        bound = stack.fused.bound * max(1.0, float(ref.abs().max()))
        if not bool(torch.isfinite(got).all()) or float((got - ref).abs().max()) > bound:
            log.warning("exact forward off: logits differ from transformers' forward on a probe")
            return "its logits are off transformers' forward on a probe"
        return ""

    def _warm_up(self) -> None:
        """Run both prefill paths once, so the first visitor's timings are not a cold start."""
        ids = list(range(1, 17))
        kv = self.new_request_kv(len(ids) + 1)
        self.forward_last(ids[:8], kv)
        self.forward_last(ids[8:], kv)
        self.reference_prefill(ids)

    # ---------------------------------------------------------------- running
    def _model(self, cache, **inputs):
        """transformers' forward with ``cache`` as its KV cache, under this line's name for it."""
        return self.model(**inputs, use_cache=True, **{self.cache_arg: cache})

    def new_request_kv(self, capacity: int) -> RequestKV:
        return RequestKV(self.num_layers, self.num_kv_heads, self.head_dim, capacity, self.dtype, self.device)

    @_on_compute_thread
    @torch.inference_mode()
    def forward(self, ids: Sequence[int], kv: RequestKV) -> torch.Tensor:
        """Run ``ids`` after the ``kv.length`` tokens already in ``kv``; append their KV.

        Returns fp32 logits for every position of ``ids``: shape ``[len(ids), vocab]``.
        A reference path for tests (exactness checks against one plain forward); the engine's
        requests run through ``forward_paged``.
        """
        if not ids:
            raise EngineError("nothing to compute: at least one token must be run")
        if self.runs_exact:
            return self._exact_buffer(ids, kv, every_position=True)
        start = kv.length
        input_ids = torch.tensor([list(ids)], device=self.device)
        positions = torch.arange(start, start + len(ids), device=self.device).unsqueeze(0)
        release_signals()  # held wake-ups go out as the model's work starts (compute_thread)
        out = self._model(kv.cache, input_ids=input_ids, position_ids=positions)
        return out.logits[0].float()

    @_on_compute_thread
    @torch.inference_mode()
    def forward_last(self, ids: Sequence[int], kv: RequestKV) -> torch.Tensor:
        """Like ``forward`` but computes logits for the last position only (a prefill's need)."""
        if self.runs_exact:
            return self._exact_buffer(ids, kv, every_position=False)[-1]
        start = kv.length
        input_ids = torch.tensor([list(ids)], device=self.device)
        positions = torch.arange(start, start + len(ids), device=self.device).unsqueeze(0)
        release_signals()  # held wake-ups go out as the model's work starts (compute_thread)
        out = self._model(kv.cache, input_ids=input_ids, position_ids=positions, logits_to_keep=1)
        return out.logits[0, -1].float()

    @_on_compute_thread
    @torch.inference_mode()
    def forward_paged(self, pool: KVPool, segments: Sequence[PagedSegment], every_position: bool = False,
                      ahead: Sequence[RowFuture] | None = None) -> torch.Tensor:
        """The scheduler's forward: every request's KV lives in ``pool``. ``segments[i]`` runs
        its ``ids`` after the ``past`` tokens it holds; their KV is written to the pool at
        ``slots[past:past + len(ids)]`` and attention reads the slots of every position (a
        prefix shared by several requests once for all of them: ``engine.model.paged_attention``).
        Returns fp32 logits of each segment's last token: ``[len(segments), vocab]``; with
        ``every_position`` (one segment only: tests, and a prompt chunk of a request that asked for
        its prompt's log-probabilities) the logits of every new token, ``[len(ids), vocab]``.
        ``ahead`` (decode rows only, one per segment) is for runners that compute elsewhere."""
        if not segments or any(not s.ids for s in segments):
            raise EngineError("nothing to compute: every segment needs at least one token")
        if every_position and len(segments) != 1:
            raise EngineError("every_position takes one segment")
        if self.plan.layers == "gathered":
            if every_position:
                return self._forward_gathered(pool, segments[0], every_position=True)
            return torch.stack([self._forward_gathered(pool, s) for s in segments])
        if self.runs_exact:
            return self._exact_paged(pool, segments, every_position)
        return self._paged(pool, segments, every_position, self.stack)

    def _exact_paged(self, pool, segments: Sequence[PagedSegment], every_position: bool) -> torch.Tensor:
        """``forward_paged``'s body in exact mode: every row through ``DecoderStack.forward_exact``
        over an ``exact.ExactPlan`` (rows in the caller's order). ``pool`` has per-layer ``k``/``v``."""
        plan = exact.ExactPlan(segments, self.device)
        input_ids = torch.tensor([plan.ids], device=self.device)
        positions = torch.tensor([plan.positions], device=self.device)
        last = 0 if every_position else torch.tensor(plan.lens, device=self.device).cumsum(0) - 1
        return self.stack.forward_exact(input_ids, positions, plan.write_index, pool.k, pool.v, plan, last)[0].float()

    def _exact_buffer(self, ids: Sequence[int], kv: RequestKV, every_position: bool) -> torch.Tensor:
        """``forward``'s work in exact mode: ``ids`` after the ``kv.length`` tokens in the scratch
        buffer ``kv``, whose slots are its positions; the same kernels as the pool's forwards, so a
        buffer's logits equal the pool's bit for bit. Every position's logits (``[len(ids), vocab]``),
        or the last one's (``[1, vocab]``)."""
        start, n = kv.length, len(ids)
        kv.ensure_capacity(start + n)
        buffer = _BufferLayers([kv.k[i] for i in range(kv.k.shape[0])], [kv.v[i] for i in range(kv.v.shape[0])])
        segment = PagedSegment(list(ids), start, range(start + n), runs=[(0, 0, start + n)])
        logits = self._exact_paged(buffer, [segment], every_position)
        kv.prefill_from(start + n)
        return logits

    def _paged(self, pool: KVPool, segments: Sequence[PagedSegment], every_position: bool,
               stack: DecoderStack | None) -> torch.Tensor:
        """``forward_paged``'s body: through ``stack`` when given, else through transformers'
        forward with the pool-reading attention registered in its place."""
        # decode rows read in place, in one call for all, where the backend can
        own_rows = self.attention.takes_rows(self.dtype, self.query_groups, self.head_dim)
        plan = PagedPlan(segments, self.device, self.attention, own_rows)
        input_ids = torch.tensor([plan.ids], device=self.device)
        positions = torch.tensor([plan.positions], device=self.device)
        last = 0 if every_position else torch.tensor(plan.lens, device=self.device).cumsum(0) - 1
        if stack is not None:
            logits = stack.forward(input_ids, positions, plan.write_index, pool.k, pool.v, plan.attention,
                                   last, rows_call=plan.rows_call)[0].float()
        else:
            mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device)  # taken as given: no mask built
            _batch.paged = (plan, pool)
            try:
                release_signals()  # held wake-ups go out as the model's work starts (compute_thread)
                out = self._model(PoolWriteCache(pool, plan.write_index), input_ids=input_ids,
                                  position_ids=positions, attention_mask=mask, logits_to_keep=last)
            finally:
                _batch.paged = None
            logits = out.logits[0].float()
        if every_position or plan.order == sorted(plan.order):
            return logits  # already in the caller's order (one group of decode rows, say): no copy
        back = torch.empty_like(logits)
        back[torch.tensor(plan.order, device=self.device)] = logits
        return back

    def _forward_gathered(self, pool: KVPool, s: PagedSegment, every_position: bool = False) -> torch.Tensor:
        """``forward_paged`` for one segment of a model whose attention cannot read the pool
        (sliding windows, soft-capping): its KV is gathered into a scratch buffer, the model
        runs its own attention, and the new KV is written back to the pool. The last token's
        logits ``[vocab]``, or with ``every_position`` every token's ``[len(ids), vocab]``."""
        n = len(s.ids)
        kv = self.new_request_kv(s.past + n)
        k_dst, v_dst = kv.prefill_from(s.past)
        pool.read_into(s.slots[: s.past], k_dst, v_dst)
        # already on the compute thread: these run in place
        logits = self.forward(s.ids, kv) if every_position else self.forward_last(s.ids, kv)
        pool.write_from(s.slots[s.past:s.past + n], kv.k[:, :, s.past:s.past + n], kv.v[:, :, s.past:s.past + n])
        return logits

    @_on_compute_thread
    @torch.inference_mode()
    def reference_prefill(self, ids: Sequence[int]) -> tuple[torch.Tensor, float]:
        """Prefill every token from scratch with a fresh ``DynamicCache``: no reuse,
        nothing read from or written to the prefix cache. Returns (last logits, ms)."""
        from transformers import DynamicCache

        self.synchronize()
        t0 = time.perf_counter()
        if self.runs_exact:  # the same kernels as the reuse side: both sides' logits compare bit for bit
            logits = self._exact_buffer(ids, self.new_request_kv(len(ids)), every_position=False)[-1]
        else:
            release_signals()  # held wake-ups go out as the model's work starts (compute_thread)
            out = self._model(DynamicCache(), input_ids=torch.tensor([list(ids)], device=self.device),
                              logits_to_keep=1)
            logits = out.logits[0, -1].float()
        self.synchronize()
        return logits, (time.perf_counter() - t0) * 1000

    @property
    def linear_kernels(self) -> str:
        """How the linear layers multiply, in words (for the engine info)."""
        if self.runs_exact:
            return "ours at any number of rows, in the fused layers and the head (the exact forward)"
        if self.packed_linears:
            fused = getattr(self.stack, "fused", None)
            ours = (f"ours in the fused decode steps (up to {fused.max_rows} rows), " if fused is not None else "")
            return f"{ours}oneDNN, weights packed once (RADIX_KERNELS=packed=off for PyTorch's default)"
        if self.native_linears and self.plan.linear_max_rows:
            return (f"ours up to {self.plan.linear_max_rows} rows (decode steps, short prefill chunks), MKL's for "
                    "longer chunks (RADIX_KERNELS=native=off for PyTorch's alone)")
        if self.native_linears:
            return "ours at any number of rows (RADIX_KERNELS=native=off for PyTorch's alone)"
        return "PyTorch's default"

    @property
    def kernel_isa(self) -> str:
        """The instruction set our C kernels are built for, in words (``RADIX_ISA``, for the engine
        info); "" where none of them runs."""
        ours = (self.native_linears or getattr(self.stack, "fused", None) is not None
                or self.attention.name == "cpu_native")
        return native_build.describe_isa() if ours else ""

    @property
    def forward_kind(self) -> str:
        """What runs the scheduler's forward, in words (for the engine info)."""
        if self.runs_exact:
            return ("exact: every row, whatever its batch, through the decoder's layers in fused C calls, our "
                    "attention in blocks fixed by position and our final norm and head, so a row's logits do not "
                    "depend on its batch, its chunk or the cache, bit for bit (RADIX_KERNELS=exact=off for the "
                    "faster paths)")
        if self.stack is not None and self.stack.fused is not None:
            return ("decoder stack: the model's layers called directly, decode steps of up to "
                    f"{self.stack.fused.max_rows} rows in two fused C calls a layer, all layers in one C call when "
                    "no two rows share a prefix (RADIX_KERNELS=fused=off for "
                    "PyTorch's ops, stack=off for transformers' forward)")
        if self.stack is not None:
            return "decoder stack: the model's layers called directly (RADIX_KERNELS=stack=off for transformers' forward)"
        kind = "transformers' forward" + ("" if self.can_batch else ", one request per forward")
        why = self.plan.why_not("exact")
        return kind + (f" (not exact: {why})" if why else "")

    @property
    def family(self) -> str:
        """The model's family recipe in words (``engine.model.families``), or why it has none."""
        from engine.model import families

        recipe = families.recipe_of(self.model)
        return recipe.describe() if recipe is not None else families.refusal(self.model)

    def close(self, timeout_s: float = 30.0) -> None:
        """End the compute thread (after the calls queued before), for command lines that build
        runners one after another: its OpenMP pool goes with it. The runner cannot run after this."""
        self.compute.stop(join_timeout_s=timeout_s)

    @property
    def where(self) -> str:
        """Where the forwards run, in words (the page's "Running ... on")."""
        return str(self.device)

    def forward_ms(self, wall_ms: float) -> float:
        """A forward's time as the figures count it, given its wall time here: the same here."""
        return wall_ms

    def loaded_for_device(self, device: torch.device) -> LoadedModel:
        """This runner's model moved to ``device``, for a runner there (a ZeroGPU worker)."""
        if self.packed_linears or self.native_linears:
            raise EngineFault("this model's linears were repacked for the CPU: load it with "
                              "RADIX_KERNELS=linear=torch to move it to another device")
        return dataclasses.replace(self.loaded, model=self.model.to(device), device=device)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device.type == "mps":
            torch.mps.synchronize()
