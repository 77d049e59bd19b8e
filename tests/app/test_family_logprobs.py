"""Qwen 3 and Gemma 3 through ``/v1`` (issue 59): the same questions give the same logprobs, bit for
bit, asked alone (behind a cached system prompt), batched beside other clients' long prompts, and
with a fresh ``cache_salt`` each (no reuse): ``test_logprobs_exact``'s three runs, on tiny random
models of those families (``tests/family_models.py``) with their sliding windows, q/k norms and
Gemma's soft-capped logits."""

from __future__ import annotations

import pytest
import torch

import tests.app.test_logprobs_exact as exact_api
from engine.model.loader import LoadedModel
from engine.model.runner import ModelRunner
from tests.family_models import tiny_model


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_alone_cached_and_salted_beside_others_give_equal_logprobs(tokenizer, family, make_engine):
    runner = ModelRunner(LoadedModel(tiny_model(family, len(tokenizer)), tokenizer, f"tiny-{family}",
                                     torch.device("cpu"), torch.float32))
    try:
        exact_api.exact_or_skip(runner)
        assert runner.plan.layers == "exact"
        runs = exact_api.runs_through_the_app(make_engine, runner, 128, 300)
        exact_api.check_runs(f"tiny {family}", runs)
        for pair in exact_api.PAIRS:
            exact_api.check_exact(runs, pair)
    finally:
        runner.close()
