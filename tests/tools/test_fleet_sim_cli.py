"""``python -m tools.fleet_sim`` on a small generated trace: one table row per fleet size and policy."""

from __future__ import annotations

from tools.fleet_sim import main


def test_the_table_has_a_row_per_size_and_policy(capsys):
    assert main(["--replicas", "2,3", "--requests", "300", "--policies", "round_robin,oracle", "--no-pooled",
                 "--budget-tokens", "5000"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "%" in line]
    assert [tuple(c.strip() for c in row.split("|")[1:3]) for row in rows] == [
        ("2", "round_robin"), ("2", "oracle"), ("3", "round_robin"), ("3", "oracle")]


def test_the_routing_labs_trace_is_predicted_and_set_beside_the_measured_rows():
    import argparse

    from components.views.routing_lab_report import lab_table, parse_report, to_json
    from tools.fleet_sim import predict_builtin
    from tools.routing_lab import report_of

    runs, what = predict_builtin(["round_robin", "cache_aware", "kv_aware"])
    assert "24 requests" in what and set(runs) == {"round_robin", "cache_aware", "kv_aware"}
    assert runs["round_robin"].per_replica == [8, 8, 8]
    assert runs["cache_aware"].hit_rate > runs["round_robin"].hit_rate
    assert runs["kv_aware"].hit_rate > runs["round_robin"].hit_rate
    measured = {"policy": "round_robin", "answered": 24, "requests": 24, "hit_rate": 0.619, "ttft_p50_s": 0.457,
                "ttft_p95_s": 1.66, "output_tokens_per_s": 23.2, "per_replica": [8, 8, 8], "held_tokens": 4000,
                "duplicate_tokens": 1000}
    args = argparse.Namespace(replicas=3, model=None, users=8, turns=3, concurrency=4, max_tokens=16)
    report = report_of([measured, {**measured, "policy": "sticky_least_loaded"}], runs, args)
    assert parse_report(to_json(report)) == parse_report(to_json(report))  # what the Fleet tab reads back
    rows = lab_table(parse_report(to_json(report))).splitlines()
    assert rows[0].endswith("simulated share | simulated per replica |")
    assert rows[2].endswith(f"| 1,000 (25%) | {runs['round_robin'].hit_rate:.1%} | 8 / 8 / 8 |")
    assert rows[3].endswith("| - | - |")  # a policy the simulator does not have
    assert "simulated" not in lab_table(report_of([measured], None, args))


def test_each_size_gets_a_pooled_reference_row(capsys):
    assert main(["--replicas", "2", "--requests", "200", "--policies", "round_robin"]) == 0
    out = capsys.readouterr().out
    assert "one unbounded cache" in out
    assert [line.split("|")[2].strip() for line in out.splitlines() if line.startswith("| 2 ")] == [
        "round_robin", "(one pooled cache)"]
