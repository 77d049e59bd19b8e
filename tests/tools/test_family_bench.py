"""The per-family benchmark runs end to end on two families at a tiny shape (a smoke test: the
table is printed and every plan is the exact forward; figures are not asserted)."""

from __future__ import annotations

import pytest

from engine.model import native_linear
from engine.model.attention import native
from tools import family_bench


def test_family_bench_prints_a_row_per_family_each_on_the_exact_forward(capsys):
    if native.kernel() is None or native_linear.kernel() is None:
        pytest.skip("the exact forward does not run here (no C compiler, or a CPU without AVX2)")
    code = family_bench.main(["--families", "llama,gemma2", "--layers", "2", "--hidden", "64", "--heads", "4",
                              "--kv-heads", "2", "--intermediate", "128", "--system-tokens", "48", "--window", "16",
                              "--max-new-tokens", "3", "--streams", "2", "--alone", "1"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "layers=" in line]
    assert [r.split(" | ")[0] for r in rows] == ["| Llama", "| Gemma 2"], out
    assert all(" | layers=exact " in r and r.endswith(" | 1/1 |") for r in rows), out
    assert "| 16 on 1/2 layers |" in rows[1] and "tokens/s, 2 streams" in out
    assert code == 0


def test_a_family_outside_the_registry_is_one_sentence():
    with pytest.raises(SystemExit, match="gpt2 not in the registry"):
        family_bench.family_types("llama,gpt2")
