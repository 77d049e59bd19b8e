"""The prompt-ordering lab: the same requests in several orderings, each from the same (empty) cache.

Owns: running each variant's requests through the real engine in a namespace of
its own (``lab-<run id>-<variant>``), cleared before and after the variant so
that every variant starts cold and leaves the shared cache as it found it;
collecting per-request metrics; and keeping the tree the variant left behind
(snapshot nodes of its namespace, taken before the clear). Knows nothing about
the presets (content lives in ``components/``) or the UI.

A run is a generator of ``LabProgress`` events, one per finished request, so a
caller shows progress; it stops early when ``should_stop()`` says so or when the
caller closes the generator (the namespace is cleared either way).

A run is bounded in total prompt tokens (``MAX_RUN_PROMPT_TOKENS``, all variants
together, about three times the largest preset): on a public page one click must
not hold the model for minutes.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from analysis.no_reuse import with_no_reuse
from engine.api import EngineAPI
from engine.types import EngineError, GenerationRequest, NodeInfo, RequestMetrics, SamplingParams

MAX_RUN_PROMPT_TOKENS = 24_000


@dataclass(frozen=True)
class LabPrompt:
    """One request: chat ``messages`` (template applied) or a raw ``prompt``."""

    label: str
    messages: tuple[dict, ...] | None = None
    prompt: str | None = None


@dataclass(frozen=True)
class Variant:
    """One ordering of the lab's requests."""

    name: str
    prompts: tuple[LabPrompt, ...]


@dataclass(frozen=True)
class RequestOutcome:
    index: int  # position in the variant, from 0
    label: str
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    prefill_ms: float
    baseline_prefill_ms: float | None  # the same prompt prefilled with no reuse, same process
    prompt_ids: tuple[int, ...]
    cached_ids: tuple[int, ...]  # what this request left in the cache: prompt + forwarded output tokens
    output_text: str


class RunTotals:
    """Totals over a run's ``requests`` (each with prompt/cached/computed tokens and
    prefill_ms); ``planned`` is how many the run had, fewer ran if it was stopped."""

    requests: tuple
    planned: int

    @property
    def complete(self) -> bool:
        return len(self.requests) == self.planned

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.requests)

    @property
    def cached_tokens(self) -> int:
        return sum(r.cached_tokens for r in self.requests)

    @property
    def computed_tokens(self) -> int:
        return sum(r.computed_tokens for r in self.requests)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def total_prefill_ms(self) -> float:
        return sum(r.prefill_ms for r in self.requests)


@dataclass(frozen=True)
class VariantResult(RunTotals):
    name: str
    namespace: str
    requests: tuple[RequestOutcome, ...]
    tree: tuple[NodeInfo, ...]  # nodes of this variant's namespace when it finished
    planned: int  # requests the variant has; ``len(requests)`` is smaller if stopped
    evicted_tokens: int  # tokens the engine evicted while this variant ran (any namespace)

    @property
    def mean_prefill_ms(self) -> float:
        return self.total_prefill_ms / len(self.requests) if self.requests else 0.0

    @property
    def baseline_total_ms(self) -> float | None:
        """Summed no-reuse prefill, when every request measured it."""
        if not self.requests or any(r.baseline_prefill_ms is None for r in self.requests):
            return None
        return sum(r.baseline_prefill_ms for r in self.requests)

    @property
    def speedup(self) -> float | None:
        """No-reuse prefill over prefill with reuse, summed over the variant's requests."""
        base = self.baseline_total_ms
        if base is None or self.total_prefill_ms <= 0:
            return None
        return base / self.total_prefill_ms


@dataclass(frozen=True)
class LabProgress:
    done: int  # requests finished, all variants together
    total: int
    variant_index: int  # the variant that just advanced
    message: str
    results: tuple[VariantResult, ...]  # finished variants, then the running one so far
    finished: bool = False
    stopped: bool = False


def cached_ids_of(m: RequestMetrics) -> tuple[int, ...]:
    """The token ids a finished request left in the cache.

    The engine inserts the prompt, then prompt + every generated token that went
    through a forward pass: all but the last sampled token (an end-of-sequence
    token is sampled but never kept in ``output_ids``).
    """
    kept = m.output_ids if m.finish_reason == "stop" else m.output_ids[:-1]
    return tuple(m.prompt_ids) + tuple(kept)


def new_run_id() -> str:
    return uuid.uuid4().hex[:10]


def run_lab(engine: EngineAPI, variants: Sequence[Variant], max_new_tokens: int = 1, measure_baseline: bool = True,
            should_stop: Callable[[], bool] | None = None, run_id: str | None = None,
            namespace_of: Callable[[str], str] | None = None, tag: str = "ordering-lab",
            max_prompt_tokens: int = MAX_RUN_PROMPT_TOKENS) -> Iterator[LabProgress]:
    """Run every variant's requests in order, each variant in a fresh namespace.

    ``namespace_of`` maps a variant's name in the run (``lab-<run id>-<index>``)
    to the namespace it is cached under; the UI passes the visitor's
    ``sub_namespace``, so a visitor's variants stay inside their own namespace.

    Raises ``EngineError`` before running anything if a prompt is empty or too
    long, if all prompts together exceed ``max_prompt_tokens``, if there is
    nothing to run, or if the engine has no prefix cache.
    """
    if not variants or not any(v.prompts for v in variants):
        raise EngineError("Nothing to run: the lab needs at least one request.")
    if not engine.info().cache_enabled:
        raise EngineError("The app runs with the prefix cache off (--no-cache): the ordering lab needs it on.")
    run_id = run_id or new_run_id()
    # Tokenize (and validate) everything first: a bad prompt fails before any work.
    ids = [[engine.prompt_ids(lab_request(p)) for p in v.prompts] for v in variants]
    run_tokens = sum(len(p) for v in ids for p in v)
    if run_tokens > max_prompt_tokens:
        raise EngineError(f"This run's prompts hold {run_tokens:,} tokens in all; the limit is {max_prompt_tokens:,}. "
                          "Use fewer or shorter requests.")
    total = sum(len(v.prompts) for v in variants)
    sampling = SamplingParams(max_new_tokens=max(1, int(max_new_tokens)))
    stop = should_stop or (lambda: False)
    finished: list[VariantResult] = []
    done = 0
    for vi, variant in enumerate(variants):
        ns = (namespace_of or str)(f"lab-{run_id}-{vi}")
        engine.clear_cache(ns)
        evicted_before = engine.stats().evicted_tokens
        outcomes: list[RequestOutcome] = []
        try:
            for ri, (prompt, prompt_ids) in enumerate(zip(variant.prompts, ids[vi], strict=True)):
                if stop():
                    break
                m = engine.run(GenerationRequest(prompt_ids=tuple(prompt_ids), sampling=sampling,
                                                 measure_baseline=measure_baseline, namespace=ns, public_len=0,
                                                 tag=tag))
                if measure_baseline:  # after the answer, on a scratch pool: the cache is left as it is
                    m = with_no_reuse(engine, m, should_stop=stop)
                outcomes.append(_outcome(ri, prompt.label, m))
                done += 1
                partial = _result(variant, ns, outcomes, (), len(variant.prompts), evicted_before, engine)
                yield LabProgress(done, total, vi, f"{variant.name}: request {ri + 1} of {len(variant.prompts)}",
                                  tuple(finished) + (partial,))
            tree = tuple(n for n in engine.snapshot(viewer=ns).nodes if n.namespace == ns)
            finished.append(_result(variant, ns, outcomes, tree, len(variant.prompts), evicted_before, engine))
        finally:
            engine.clear_cache(ns)
        if stop() or not finished[-1].complete:
            yield LabProgress(done, total, vi, "Stopped.", tuple(finished), finished=True, stopped=True)
            return
    yield LabProgress(done, total, len(variants) - 1, "Done.", tuple(finished), finished=True)


def lab_request(p: LabPrompt) -> GenerationRequest:
    if p.messages is not None:
        return GenerationRequest(messages=tuple(p.messages))
    return GenerationRequest(prompt=p.prompt if p.prompt is not None else "")


def _outcome(index: int, label: str, m: RequestMetrics) -> RequestOutcome:
    return RequestOutcome(index=index, label=label, prompt_tokens=m.prompt_tokens, cached_tokens=m.cached_tokens,
                          computed_tokens=m.computed_tokens, prefill_ms=m.prefill_ms,
                          baseline_prefill_ms=m.baseline_prefill_ms, prompt_ids=tuple(m.prompt_ids),
                          cached_ids=cached_ids_of(m), output_text=m.output_text)


def _result(variant: Variant, ns: str, outcomes: list[RequestOutcome], tree: tuple[NodeInfo, ...], planned: int,
            evicted_before: int, engine: EngineAPI) -> VariantResult:
    return VariantResult(name=variant.name, namespace=ns, requests=tuple(outcomes), tree=tree, planned=planned,
                         evicted_tokens=engine.stats().evicted_tokens - evicted_before)


def run_lab_to_end(engine: EngineAPI, variants: Sequence[Variant], **kwargs) -> tuple[VariantResult, ...]:
    """Blocking convenience for tests and scripts: the final results."""
    events = list(run_lab(engine, variants, **kwargs))
    return events[-1].results
