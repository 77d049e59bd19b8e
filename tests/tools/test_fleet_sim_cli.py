"""``python -m tools.fleet_sim`` on a small generated trace: one table row per fleet size and policy."""

from __future__ import annotations

from tools.fleet_sim import main


def test_the_table_has_a_row_per_size_and_policy(capsys):
    assert main(["--replicas", "2,3", "--requests", "300", "--policies", "round_robin,oracle",
                 "--budget-tokens", "5000"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "%" in line]
    assert [tuple(c.strip() for c in row.split("|")[1:3]) for row in rows] == [
        ("2", "round_robin"), ("2", "oracle"), ("3", "round_robin"), ("3", "oracle")]
