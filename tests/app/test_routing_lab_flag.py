"""``app.py --routing-lab FILE`` (issue 45): the routing lab's report for the Fleet tab, read and checked
before anything is loaded; a missing or damaged file ends the start in one line, with nothing started."""

from __future__ import annotations

import json

import pytest

import app
from tests.components.test_routing_lab_report import REPORT


def test_the_flag_needs_a_fleet(capsys):
    with pytest.raises(SystemExit):
        app.parse_args(["--backend", "http://127.0.0.1:9", "--routing-lab", "lab.json"])
    assert "--routing-lab needs --fleet" in capsys.readouterr().err
    args = app.parse_args(["--backend", "http://r", "--fleet", "http://a,http://b", "--routing-lab", "lab.json"])
    assert args.routing_lab == "lab.json" and args.fleet == ["http://a", "http://b"]


def test_a_report_loads_and_a_bad_one_says_why(tmp_path):
    good = tmp_path / "lab.json"
    good.write_text(json.dumps(REPORT))
    assert app.load_routing_lab(str(good))["rows"][0]["policy"] == "round_robin"
    with pytest.raises(ValueError, match="cannot read the routing-lab report"):
        app.load_routing_lab(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**REPORT, "rows": [{"policy": "x"}]}))
    with pytest.raises(ValueError, match="is not a routing-lab report: row 0's hit_rate"):
        app.load_routing_lab(str(bad))


def test_a_bad_report_ends_the_start_in_one_line_before_the_backend_is_asked(tmp_path, capsys, monkeypatch):
    from tests.helpers_app import free_port

    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\x00not json")
    asked = []
    monkeypatch.setattr(app, "build_remote_engine", lambda *a, **k: asked.append(a))
    rc = app.main(["--backend", "http://127.0.0.1:9", "--fleet", "http://127.0.0.1:9", "--routing-lab", str(bad),
                   "--port", str(free_port())])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and not asked
    assert len(err) == 1 and err[0].startswith("error: ") and "is not a routing-lab report: not JSON" in err[0]
