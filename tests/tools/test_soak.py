"""The soak tool (issue 58's twenty minutes), run for seconds on a tiny model: it starts the app
as a Space runs it, drives page and API traffic, runs the flood and classroom checks, stops the
app with SIGTERM, and its report says what the long run's note quotes."""

from __future__ import annotations

import pytest

from tests.helpers_app import save_tiny_model


@pytest.mark.slow
def test_a_short_soak_reports_traffic_memory_and_both_checks(tmp_path, tokenizer, capsys):
    from tools import soak

    model = save_tiny_model(tmp_path / "tiny", tokenizer)
    code = soak.main(["--minutes", "0.3", "--page-visitors", "2", "--api-clients", "1", "--sample-s", "3",
                      "--budget-mb", "16", "--max-new-tokens", "8", "--model", model,
                      "--max-slope-mib-h", "1e9"])  # 18 seconds say nothing of a slope
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    assert "5xx: 0" in out and "tracebacks in the server's output: 0" in out, out[-3000:]
    assert "resident memory (MiB):" in out and "slope over the second half:" in out
    assert "flood: 150 page events from one address" in out and "(status 200)" in out, out[-3000:]
    assert "classroom: 8 of 8 tabs behind one address answered" in out, out[-3000:]
