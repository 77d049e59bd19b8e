"""The step profiler (issue 48) runs end to end on the tiny model: every part measured, the parts
within the step, and the table beside the limit (figures are not asserted)."""

from __future__ import annotations

import pytest

from tools.step_profile import ORDER, Profile, format_table


def test_step_profile_smoke_on_tiny_model(tiny_runner):
    if not tiny_runner.runs_exact:
        pytest.skip("the exact forward does not run here")
    prof = Profile(tiny_runner, prefix=300, rows=3)
    steps = {n: prof.step(n) for n in (1, 3)}
    for parts in steps.values():
        assert set(parts) == {"step", *ORDER} and all(v >= 0 for v in parts.values())
        assert parts["step"] > 0 and parts["attention"] > 0 and parts["linears"] > 0
    table = format_table(steps, {1: 1.0, 3: 2.0}, {1: 2.0, 3: 4.0})
    assert "| **step** |" in table and "x) |" in table and "3 rows" in table
    assert "| read, then linears at half the FMA rate (its multiple) | 2.0 (" in table
    assert prof.cold_prefill(300) > 0
