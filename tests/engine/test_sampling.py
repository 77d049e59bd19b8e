"""Loop guards: deterministic, and they stop the loops the embedded model falls into."""

from __future__ import annotations

import torch

from engine.model.sampling import banned_by_ngram, guard_logits, sample
from engine.types import SamplingParams


def test_banned_by_ngram():
    assert banned_by_ngram([1, 2, 3, 1, 2], 3) == {3}
    assert banned_by_ngram([1, 2, 3, 1, 2], 0) == set()
    assert banned_by_ngram([5, 6], 3) == set()
    assert banned_by_ngram([1, 1, 1], 2) == {1}
    assert banned_by_ngram([4, 5], 1) == {4, 5}


def test_greedy_never_repeats_an_ngram():
    """A model that always prefers the same cycle cannot loop under the guard."""
    vocab = 10
    params = SamplingParams(no_repeat_ngram_size=3)
    out: list[int] = []
    for _ in range(30):
        logits = torch.zeros(vocab)
        logits[len(out) % 3] = 5.0  # wants 0 1 2 0 1 2 ...
        out.append(sample(logits, params, None, out))
    grams = [tuple(out[i:i + 3]) for i in range(len(out) - 2)]
    assert len(grams) == len(set(grams))


def test_repetition_penalty_and_off_is_identity():
    logits = torch.tensor([2.0, -1.0, 0.5])
    assert guard_logits(logits, [0, 1], SamplingParams()) is logits
    pen = guard_logits(logits, [0, 1], SamplingParams(repetition_penalty=2.0))
    assert torch.allclose(pen, torch.tensor([1.0, -2.0, 0.5]))
    assert torch.equal(logits, torch.tensor([2.0, -1.0, 0.5]))  # input untouched


def test_seeded_sampling_with_guard_is_reproducible():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.8, seed=3, no_repeat_ngram_size=2, repetition_penalty=1.3)

    def run():
        g = torch.Generator().manual_seed(3)
        out: list[int] = []
        for _ in range(20):
            out.append(sample(logits, params, g, out))
        return out

    assert run() == run()


def test_greedy_picks_what_torch_argmax_picks_ties_and_nan_included():
    import torch

    from engine.types import SamplingParams

    g = torch.Generator().manual_seed(3)
    cases = [torch.randn(49152, generator=g) for _ in range(5)]
    tie = torch.zeros(100)
    tie[[7, 40]] = 2.0
    nan = torch.randn(100, generator=g)
    nan[[13, 60]] = float("nan")
    inf = torch.full((10,), float("-inf"))
    for logits in [*cases, tie, nan, inf, torch.zeros(0)[:0].new_zeros(1)]:
        assert sample(logits, SamplingParams(temperature=0), None) == int(torch.argmax(logits))
    assert sample(tie, SamplingParams(temperature=0), None) == 7
