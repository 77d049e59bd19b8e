"""The runner on both transformers lines it meets: 5.24 (pinned here) names the forward's cache
``cache``, 5.17 (the GPU machine's) ``past_key_values``. A model whose forward takes the old name
runs exactly as the same model with the new one: nothing passed under a name it would swallow."""

from __future__ import annotations

import torch

from engine.model.loader import LoadedModel
from engine.model.runner import ModelRunner, cache_argument
from tests.conftest import make_tiny_runner


class OldLineLlama(torch.nn.Module):
    """The tiny Llama behind a 5.17-style forward: ``past_key_values=``, and ``cache=`` refused
    (5.17 would have taken it into ``**kwargs`` and run on a cache of its own)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.inner = model
        self.config, self.generation_config = model.config, model.generation_config

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None, logits_to_keep=0, **kwargs):
        assert "cache" not in kwargs, "the cache was passed under the new name"
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs,
                          **{cache_argument(self.inner): past_key_values})

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()


def test_cache_argument_follows_the_forward_signature(tiny_runner):
    assert cache_argument(tiny_runner.model) in ("cache", "past_key_values")
    assert cache_argument(OldLineLlama(tiny_runner.model)) == "past_key_values"


def test_runner_on_an_old_line_forward_matches_the_new(tokenizer):
    new = make_tiny_runner(tokenizer, seed=3)
    old = ModelRunner(LoadedModel(OldLineLlama(make_tiny_runner(tokenizer, seed=3).model), tokenizer,
                                  "old-line", torch.device("cpu"), torch.float32))
    assert old.cache_arg == "past_key_values" and not old.can_batch  # not a Llama class: forward_paged gathers
    assert (old.num_layers, old.num_kv_heads, old.head_dim) == (new.num_layers, new.num_kv_heads, new.head_dim)
    ids = list(range(20, 60))
    kv_old, kv_new = old.new_request_kv(len(ids)), new.new_request_kv(len(ids))
    old.forward(ids[:30], kv_old)
    new.forward(ids[:30], kv_new)
    assert torch.allclose(old.forward(ids[30:], kv_old), new.forward(ids[30:], kv_new), atol=1e-5)
    assert torch.allclose(old.reference_prefill(ids)[0], new.reference_prefill(ids)[0], atol=1e-5)
    old.close()
    new.close()
