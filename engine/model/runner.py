"""The model runner: the only code that runs the transformers model.

Owns: forward passes on a request's KV buffer, packed forwards over many requests'
buffers, the scheduler's forward over the KV pool, a reference prefill from scratch, and
the model's KV geometry. Every forward runs on the runner's one compute thread
(``engine.model.compute_thread``), whoever calls it; on an x86 CPU in bfloat16 the
model's linears are oneDNN-packed (``engine.model.packed_linear``). Holds the model's
text half as ``text`` (``engine.text.codec.TextCodec``: template, encode, decode, eos)
and does no text itself. Knows nothing about the radix tree, the pool's policy or the
scheduler: it is handed token ids and buffers.

The scheduler's forward is ``forward_paged``: several requests' new tokens (decode
tokens and prefill chunks alike) packed into one ``[1, total]`` sequence, each token with
its own position, every request's KV in the pool. Everything but attention (embeddings,
projections, MLP, logits) runs once over the pack, which is where the time goes on a CPU
(the weights are read once per forward); attention reads each request's slots in the pool
(``engine.model.paged_attention``: a shared prefix once for all). By default every row runs the
exact forward (``DecoderStack.forward_exact``: the family's recipe in our C layers, our attention
in blocks fixed by position), whatever its batch; the other drivers are the decoder stack's PyTorch
layers (Llama-shaped models) and transformers' forward with the pool-reading attention registered in
its place (``engine.model.pool_attention``). The other paths are single-request:
``forward``/``forward_last`` on a scratch buffer (tests' references, the warm start) and
``reference_prefill`` (a fresh buffer, no cache: the tests' reference logits; a no-reuse *timing*
is ``analysis.no_reuse.no_reuse_prefill``'s).

Which of these runs, with which linears and attention, is chosen once as the runner is built:
its ``plan`` (``engine.model.plan.ExecutionPlan``, frozen), from the plan's registry with the
start-up checks of ``engine.model.layer_checks``. ``forward_paged`` asks the plan which driver runs
a step (``ExecutionPlan.driver_for``) and runs it; nothing here chooses again, and the settings come
in as an argument (the environment is read, by ``plan.read_settings``, only when none are given).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.held_signals import release_signals
from engine.kvcache.kv_pool import KVPool
from engine.kvcache.request_kv import PoolWriteCache, RequestKV
from engine.model import explain, layer_checks, native_linear, plan, pool_attention
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
cache_argument = pool_attention.cache_argument  # where callers have always found it


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

    def __init__(self, loaded: LoadedModel, kernels: KernelSettings | None = None) -> None:
        """``kernels``: the kernel settings (``engine.model.plan``; the app passes them), by default
        ``plan.read_settings()`` of this process's environment."""
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
        self.kernels = settings = kernels if kernels is not None else plan.read_settings()  # what a copy elsewhere takes
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
        # The layer driver (engine.model.layer_checks): the exact forward where the family's recipe and
        # our kernels check out, else the first of the drivers below it that does.
        choice = self.compute.call(layer_checks.choose_layers, self, settings)
        self.stack: DecoderStack | None = choice.stack
        fused = self.stack.fused if self.stack is not None else None
        self.plan = ExecutionPlan(layers=choice.driver, linear=linear, attention=self.attention.name,
                                  rejected=tuple(rejected + set_aside) + choice.rejected,
                                  fused_max_rows=fused.max_rows if fused is not None else 0,
                                  linear_max_rows=native_linear.MAX_ROWS if self.native_linears
                                  and self.dtype == torch.float32 else 0, switches=settings.switches)
        if choice.driver != "exact":  # never silently: the log, the engine info and --explain-kernels say why
            log.warning("%s: the forward is %s, not exact: %s", self.name, choice.driver, self.plan.why_not("exact"))
        self.compute.call(self._warm_up)

    @torch.inference_mode()
    def _probe_layers(self) -> list:
        from transformers import DynamicCache

        release_signals()  # held wake-ups go out as the model's work starts (compute_thread)
        cache = DynamicCache()
        self._model(cache, input_ids=torch.tensor([[0]], device=self.device))
        return cache.layers

    def _warm_up(self) -> None:
        """Run both prefill paths once, so the first visitor's timings are not a cold start."""
        ids = list(range(1, 17))
        kv = self.new_request_kv(len(ids) + 1)
        self.forward_last(ids[:8], kv)
        self.forward_last(ids[8:], kv)
        self.reference_prefill(ids)

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
        """Whether forwards run exact: the plan's driver is ``exact`` (the same as ``exact``; kept for
        the callers that ask it by this name)."""
        return self.plan.layers == "exact"

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
        driver = self.plan.driver_for(sum(len(s.ids) for s in segments))  # the plan says; nothing else chooses
        if driver == "gathered":
            if every_position:
                return self._forward_gathered(pool, segments[0], every_position=True)
            return torch.stack([self._forward_gathered(pool, s) for s in segments])
        if driver == "exact":
            return self._exact_paged(pool, segments, every_position)
        return self._paged(pool, segments, every_position, self.stack if driver in ("fused", "stack") else None,
                           driver == "fused")

    def _exact_paged(self, pool, segments: Sequence[PagedSegment], every_position: bool,
                     stack: DecoderStack | None = None) -> torch.Tensor:
        """``forward_paged``'s body in exact mode: every row through ``stack.forward_exact`` (the
        runner's stack by default) over an ``exact.ExactPlan`` (rows in the caller's order). ``pool``
        has per-layer ``k``/``v``."""
        plan = exact.ExactPlan(segments, self.device)
        input_ids = torch.tensor([plan.ids], device=self.device)
        positions = torch.tensor([plan.positions], device=self.device)
        last = 0 if every_position else torch.tensor(plan.lens, device=self.device).cumsum(0) - 1
        stack = stack or self.stack
        return stack.forward_exact(input_ids, positions, plan.write_index, pool.k, pool.v, plan, last)[0].float()

    def _exact_buffer(self, ids: Sequence[int], kv: RequestKV, every_position: bool,
                      stack: DecoderStack | None = None) -> torch.Tensor:
        """``forward``'s work in exact mode: ``ids`` after the ``kv.length`` tokens in the scratch
        buffer ``kv``, whose slots are its positions; the same kernels as the pool's forwards, so a
        buffer's logits equal the pool's bit for bit. Every position's logits (``[len(ids), vocab]``),
        or the last one's (``[1, vocab]``)."""
        start, n = kv.length, len(ids)
        kv.ensure_capacity(start + n)
        buffer = _BufferLayers([kv.k[i] for i in range(kv.k.shape[0])], [kv.v[i] for i in range(kv.v.shape[0])])
        segment = PagedSegment(list(ids), start, range(start + n), runs=[(0, 0, start + n)])
        logits = self._exact_paged(buffer, [segment], every_position, stack)
        kv.prefill_from(start + n)
        return logits

    def _paged(self, pool: KVPool, segments: Sequence[PagedSegment], every_position: bool,
               stack: DecoderStack | None, fused: bool = False) -> torch.Tensor:
        """``forward_paged``'s body: through ``stack`` when given (its fused layers where ``fused``),
        else through transformers' forward with the pool-reading attention registered in its place."""
        # decode rows read in place, in one call for all, where the backend can
        own_rows = self.attention.takes_rows(self.dtype, self.query_groups, self.head_dim)
        plan = PagedPlan(segments, self.device, self.attention, own_rows)
        input_ids = torch.tensor([plan.ids], device=self.device)
        positions = torch.tensor([plan.positions], device=self.device)
        last = 0 if every_position else torch.tensor(plan.lens, device=self.device).cumsum(0) - 1
        if stack is not None:
            logits = stack.forward(input_ids, positions, plan.write_index, pool.k, pool.v, plan.attention,
                                   last, rows_call=plan.rows_call, fused=fused)[0].float()
        else:
            mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device)  # taken as given: no mask built
            with pool_attention.reading_pool(plan, pool):
                release_signals()  # held wake-ups go out as the model's work starts (compute_thread)
                out = self._model(PoolWriteCache(pool, plan.write_index), input_ids=input_ids,
                                  position_ids=positions, attention_mask=mask, logits_to_keep=last)
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
        return explain.linear_kernels(self)

    @property
    def kernel_isa(self) -> str:
        """The instruction set our C kernels are built for, in words (``RADIX_ISA``, for the engine
        info); "" where none of them runs."""
        return explain.kernel_isa(self)

    @property
    def forward_kind(self) -> str:
        """What runs the scheduler's forward, in words (for the engine info)."""
        return explain.forward_kind(self)

    @property
    def family(self) -> str:
        """The model's family recipe in words (``engine.model.families``), or why it has none."""
        return explain.family(self)

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
