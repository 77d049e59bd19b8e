"""Does reuse change the answer? One prompt run again twice, with the cache and without, compared.

Owns: ``ReuseCheck`` and ``check_reuse``. The caller hands two requests for the same prompt ids,
keyed by the engine (``EngineAPI.key_for``): one that may reuse what is cached (the visitor's own
namespace and the shipped prefix), one that cannot (a fresh sub-namespace, nothing shareable). Both
run greedy, for the same number of new tokens, asking for each token's log-probability; what comes
back is compared exactly: the tokens, and the logprobs as the float32 values the engine computed
(``==`` on each, so "identical" means bit for bit), with digests a reader can see.

Works through ``EngineAPI`` alone, so the same check runs on the local engine (its own kernels,
batched with whatever else runs) and in front of a remote server that returns logprobs (vLLM,
SGLang: a fresh ``cache_salt`` is their "without"). Knows nothing about the page.

The "without" side must really have computed everything: its reported ``cached_tokens`` is kept
(``cold_cached_tokens``), and a caller shows the comparison as unfair when it is not 0.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from engine.api import EngineAPI
from engine.types import EngineError, GenerationRequest, RequestMetrics, SamplingParams

CHECK_NEW_TOKENS = 16  # enough to see an answer part ways, short enough to cost a second or two on a CPU


@dataclass(frozen=True)
class ReuseCheck:
    """Two runs of one prompt, with reuse and without, compared token by token."""

    new_tokens: int  # tokens each run generated (the shorter, if one stopped early)
    reused_tokens: int  # prompt tokens the run with reuse took from the cache
    cold_cached_tokens: int  # prompt tokens the run without reuse still took from a cache (0: a fair check)
    same_tokens: bool  # the answers' token ids are the same
    identical_logprobs: bool  # every token's logprob is the same float, bit for bit
    max_logprob_diff: float  # largest difference up to the first differing token (included)
    first_difference: int | None  # index of the first token whose id or logprob differs; None: none
    reuse_digest: str  # SHA-256 of each side's logprobs as float64 bytes (first 16 hex digits)
    cold_digest: str

    @property
    def fair(self) -> bool:
        return self.cold_cached_tokens == 0


def logprob_digest(values: Sequence[float]) -> str:
    """The SHA-256 of ``values`` packed as little-endian float64 (a float32 fits exactly)."""
    return hashlib.sha256(struct.pack(f"<{len(values)}d", *values)).hexdigest()[:16]


def _run(engine: EngineAPI, request: GenerationRequest, new_tokens: int) -> RequestMetrics:
    greedy = SamplingParams(max_new_tokens=new_tokens, temperature=0.0,
                            no_repeat_ngram_size=request.sampling.no_repeat_ngram_size,
                            repetition_penalty=request.sampling.repetition_penalty)
    m = engine.run(dataclasses.replace(request, sampling=greedy, logprobs=0, prompt_logprobs=None,
                                       measure_baseline=False, tag="reuse-check"))
    if m.finish_reason == "cancelled":
        raise EngineError("The check was stopped before it finished.")
    if m.output_logprobs is None or len(m.output_logprobs) != len(m.output_ids):
        raise EngineError("The engine returned no log-probabilities for the check.")
    return m


def compare(reuse: RequestMetrics, cold: RequestMetrics) -> ReuseCheck:
    """Compare two finished runs of the same prompt (``output_ids`` and ``output_logprobs``)."""
    a = [t.logprob for t in reuse.output_logprobs or ()]
    b = [t.logprob for t in cold.output_logprobs or ()]
    n = min(len(a), len(b))
    first, worst = None, 0.0
    for i in range(n):
        worst = max(worst, abs(a[i] - b[i]))
        if reuse.output_ids[i] != cold.output_ids[i] or a[i] != b[i]:
            first = i
            if reuse.output_ids[i] != cold.output_ids[i]:
                break  # past here the two answers read different contexts: nothing to compare
    if first is None and len(a) != len(b):
        first = n
    return ReuseCheck(new_tokens=n, reused_tokens=reuse.cached_tokens, cold_cached_tokens=cold.cached_tokens,
                      same_tokens=list(reuse.output_ids) == list(cold.output_ids),
                      identical_logprobs=a == b and list(reuse.output_ids) == list(cold.output_ids),
                      max_logprob_diff=worst, first_difference=first, reuse_digest=logprob_digest(a),
                      cold_digest=logprob_digest(b))


def check_reuse(engine: EngineAPI, with_reuse: GenerationRequest, without: GenerationRequest,
                new_tokens: int = CHECK_NEW_TOKENS) -> ReuseCheck:
    """Run ``with_reuse`` then ``without`` (the same prompt ids, keyed apart by the caller), greedy,
    ``new_tokens`` each, and compare them. ``EngineError`` when the engine cannot give logprobs."""
    if not engine.capabilities.logprobs:
        raise EngineError("This engine cannot return log-probabilities, so the check cannot compare the runs.")
    if tuple(with_reuse.prompt_ids or ()) != tuple(without.prompt_ids or ()) or not with_reuse.prompt_ids:
        raise EngineError("The check needs the same prompt, as token ids, on both sides.")
    reuse = _run(engine, with_reuse, new_tokens)
    cold = _run(engine, without, new_tokens)
    return compare(reuse, cold)
