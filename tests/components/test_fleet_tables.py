"""The Fleet tab's words (``components.views.fleet_tables``) and its small trees
(``components.panels.fleet_panel.replica_figures``) over a hand-built ``FleetView``: what a
visitor reads when a request landed away from the replica that held most, when nothing is known,
and when the replicas do not say their bytes per token."""

from __future__ import annotations

import plotly.graph_objects as go

from components.panels.fleet_panel import replica_figures
from components.views.fleet_tables import duplication_line, replica_title, replicas_table, requests_table
from components.views.tree_figures import STATUS_COLORS
from components.views.tree_marks import REUSED
from engine.types import FleetRequest, FleetView, NodeInfo, ReplicaView, RequestMetrics, TreeSnapshot


def _snap(ids: tuple[int, ...]) -> TreeSnapshot:
    node = NodeInfo(node_id=1, parent_id=0, num_tokens=len(ids), depth_tokens=len(ids), num_bytes=0, lock_ref=0,
                    hits=1, last_access_s_ago=1.0, namespace="", hidden=False, token_ids=ids, text="abc")
    return TreeSnapshot((node,), len(ids), 0, 0, 0, 0, 0, origin="events")


def _view(per_token: float | None) -> FleetView:
    held = tuple(range(64))
    replicas = (ReplicaView("http://127.0.0.1:8001", _snap(held), 32, 2, 64, True, 1, 0.5, 0.0),
                ReplicaView("http://127.0.0.1:8002", _snap(held), 32, 2, 64, True, 1, None, None),
                ReplicaView("http://127.0.0.1:8003", TreeSnapshot((), 0, 0, 0, 0, 0, 0), 0, 0, 0, False, 0, None, None))
    requests = (FleetRequest(1, 70, 0, "gained", 0, 0, 0, None),
                FleetRequest(2, 70, 1, "counted", 3, 0, 64, 0),
                FleetRequest(3, 70, None, "ambiguous", 64, None, 64, 0))
    return FleetView(replicas, requests, 128, 64, 64, 64, per_token, int(64 * per_token) if per_token else None)


def test_tables_name_replicas_and_say_what_a_perfect_router_would_have_reused():
    view = _view(512.0)
    assert "replica 0 (:8001)" in replicas_table(view) and "unknown" in replicas_table(view)
    rows = requests_table(view).splitlines()
    assert rows[2].startswith("| 3 |") and "| ? |" in rows[2]  # newest first; not attributed: said so
    assert "| replica 1 |" in rows[3] and "64 (replica 0)" in rows[3] and "**64**" in rows[3]  # 64 missed
    assert "no KV events" in replica_title(2, view.replicas[2]) and "hit rate 50%" in replica_title(0, view.replicas[0])
    assert "32.0 KiB" in duplication_line(view) and "64 tokens" in duplication_line(view)
    assert "tokens only" in duplication_line(_view(None))
    assert "No request yet" in requests_table(FleetView((), (), 0, 0, 0, 0, None, None))


def test_small_trees_mark_the_last_request_on_the_replica_it_landed_on():
    view = _view(None)
    mine = RequestMetrics(request_id=2, tag="chat", namespace="", prompt_tokens=70, cached_tokens=3,
                          computed_tokens=67, prefill_ms=1.0, baseline_prefill_ms=None, ttft_ms=1.0, queue_ms=0.0,
                          decode_tokens_per_s=None, output_tokens=1, finish_reason="stop", cache_bytes=0,
                          cache_budget_bytes=0, evicted_tokens=0, inserted_tokens=0, prompt_ids=list(range(70)),
                          matched_path=[], output_ids=[], output_text="")
    figs = replica_figures(view, mine, None)
    assert len(figs) == 3
    for f in figs:
        go.Figure(f.to_dict())  # valid plotly
    colours = [[c for t in f.to_dict()["data"] if isinstance(t.get("marker", {}).get("line", {}).get("color"), list)
                for c in t["marker"]["line"]["color"]] for f in figs]  # each mark's outline
    green = STATUS_COLORS[REUSED]  # node 1 holds 64 tokens; the request had 3 cached: its first one is "reused"
    assert green in colours[1] and green not in colours[0]  # lit only where it landed
