"""The chat's "does reuse change the answer?" check: the visitor's last prompt run again twice.

Lays out a small accordion under the chat and wires its button: the visitor's last prompt (its
token ids, from their last answer's metrics) runs once keyed as the page keys it (their own
namespace and the shipped prefix: what reuse would serve) and once in a fresh sub-namespace of
theirs with nothing shareable (nothing cached: every token computed), both greedy with each
token's log-probability, and ``analysis.reuse_check`` compares them. The fresh namespace is
cleared afterwards. Works the same in front of a remote server that returns logprobs (a fresh
``cache_salt`` there). Only the visitor's own prompt runs, in their own namespace.
"""

from __future__ import annotations

import dataclasses
import secrets

import gradio as gr

from analysis.reuse_check import CHECK_NEW_TOKENS, ReuseCheck, check_reuse
from components.panels.common import warn
from components.session import page_keyed, page_visitor
from engine.api import EngineAPI
from engine.types import GenerationRequest, RequestMetrics, SamplingParams

INTRO = (f"Runs your last prompt again twice, {CHECK_NEW_TOKENS} greedy tokens each: once reusing what is cached, "
         "once with nothing cached (every token computed), and compares the answers token by token, with each "
         "token's log-probability as the model computed it.")


def check_requests(engine: EngineAPI, m: RequestMetrics, request) -> tuple[GenerationRequest, GenerationRequest]:
    """(with reuse, without) for the prompt of ``m``, keyed by the engine for the page's visitor:
    the page's own keying, and a fresh sub-namespace of theirs with no shareable part."""
    base = GenerationRequest(prompt_ids=tuple(m.prompt_ids), sampling=SamplingParams(), tag="reuse-check")
    with_reuse = page_keyed(engine, base, request).request(base)
    cold = engine.key_for(base, page_visitor(request), sub=f"reuse-check-{secrets.token_hex(6)}").request(base)
    return with_reuse, dataclasses.replace(cold, public_len=0)


def check_markdown(c: ReuseCheck) -> str:
    """What the check found, in words a first-time visitor reads."""
    if not c.fair:
        return (f"The run without reuse still took {c.cold_cached_tokens:,} tokens from a cache, so this is no "
                "comparison; try again.")
    if c.identical_logprobs:
        verdict = (f"**Identical, bit for bit:** the same {c.new_tokens} tokens and the same log-probability for "
                   f"each (digest `{c.reuse_digest}` on both sides).")
    elif c.same_tokens:
        verdict = (f"**The same {c.new_tokens} tokens, but not bit for bit:** their log-probabilities differ by at "
                   f"most {c.max_logprob_diff:.1e} (digests `{c.reuse_digest}` and `{c.cold_digest}`), first at "
                   f"token {c.first_difference + 1}.")
    else:
        verdict = (f"**The answers part ways at token {c.first_difference + 1}:** until there the log-probabilities "
                   f"differ by at most {c.max_logprob_diff:.1e}, enough to tip a near tie between two tokens.")
    why = ("" if c.identical_logprobs else " Reuse computes fewer tokens per forward than a cold prefill, and the "
           "model's kernels then add the same numbers in another order: the last bits move.")
    return (f"{verdict}{why} With reuse, {c.reused_tokens:,} prompt tokens came from the cache; without, "
            "none.")


def run_check(engine: EngineAPI, last: RequestMetrics | None, request: gr.Request | None = None) -> str:
    if not isinstance(last, RequestMetrics) or not last.prompt_ids:
        return "Send a message first: the check runs your last prompt again."
    try:
        with_reuse, without = check_requests(engine, last, request)
        try:
            return check_markdown(check_reuse(engine, with_reuse, without))
        finally:
            engine.clear_cache(namespace=without.namespace)  # the cold run's KV is nobody's to reuse
    except Exception as exc:  # a message for the visitor, never a traceback
        warn(exc)
        return ""


def build_reuse_check(engine: EngineAPI, last_metrics: gr.State) -> None:
    with gr.Accordion("Does reuse change the answer? Check your last prompt", open=False):
        gr.Markdown(INTRO, elem_classes=["legend"])
        button = gr.Button("Run it again, with and without the cache", size="sm")
        result = gr.Markdown()

    def check(last: RequestMetrics | None, request: gr.Request) -> str:
        return run_check(engine, last, request)

    button.click(check, [last_metrics], result, api_visibility="private", show_progress="minimal")
