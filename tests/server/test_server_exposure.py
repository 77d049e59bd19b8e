"""What a visitor can read of the whole server on a public deployment (issue 43), through the real
server on the tiny model: ``/metrics`` and ``/kv_event_sources`` answer the operator's key only
(``server.exposure``), so visitor B, polling every route beside the page while visitor A's request
runs and ends, reads the same bytes before and after; without isolation, or with
``--public-metrics``, they are open as before.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

import app
from engine.types import GenerationRequest, SamplingParams
from server.exposure import ServerReadRule
from tests.helpers_app import free_port, wait_idle

OPERATOR = "operator-secret"


def _engine(tiny_runner, *flags: str):
    port, replay = free_port(), free_port()
    config = json.dumps({"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}",
                         "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": "kv-events"})
    args = app.parse_args(["--kv-events-config", config, "--max-new-tokens", "4", *flags])
    return app.build_engine(args, runner=tiny_runner), args


@contextmanager
def _served(engine, args) -> Iterator[str]:
    """The app as ``python app.py`` serves it, with the operator flags given; yields its URL."""
    from components.demo import launch_kwargs

    demo = app.build_app(engine, args.max_queue)
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=free_port(), quiet=True,
                **launch_kwargs(app.app_kwargs(engine, args.api_key, args.max_per_client, args.operator_key,
                                               args.public_metrics)))
    try:
        yield demo.local_url
    finally:
        demo.close()
        engine.close()


def _everything_beside_the_page(url: str, headers: dict | None = None) -> dict[str, tuple[int, str]]:
    """What a stranger reads of every route the server serves beside the page."""
    out = {}
    for path in ("metrics", "kv_event_sources", "v1/models"):
        r = httpx.get(url + path, headers=headers or {}, timeout=30)
        out[path] = (r.status_code, r.text)
    return out


def test_an_isolated_app_tells_a_stranger_nothing_of_another_visitors_request(tiny_runner):
    engine, args = _engine(tiny_runner, "--isolate", "--operator-key", OPERATOR)
    with _served(engine, args) as url:
        before = _everything_beside_the_page(url)
        assert before["metrics"][0] == 404 and "operator" in before["metrics"][1]
        assert before["kv_event_sources"][0] == 404
        wrong = _everything_beside_the_page(url, {"Authorization": "Bearer guess"})
        assert wrong["metrics"][0] == 404 and wrong["kv_event_sources"][0] == 404
        engine.run(GenerationRequest(prompt_ids=tuple(range(500, 547)), namespace="v-a/s-1",
                                     sampling=SamplingParams(max_new_tokens=4)))  # visitor A's request
        wait_idle(engine)
        after = _everything_beside_the_page(url)
        assert after == before, "a stranger's reads changed with another visitor's request"
        # The operator reads everything.
        operator = {"Authorization": f"Bearer {OPERATOR}"}
        metrics = httpx.get(url + "metrics", headers=operator, timeout=30)
        assert metrics.status_code == 200 and "radix_prefix_cache_queries_total" in metrics.text
        assert "radix_kv_events_dropped_batches_total 0.0" in metrics.text  # the publisher's bounded queue
        sources = httpx.get(url + "kv_event_sources", headers=operator, timeout=30)
        assert sources.status_code == 200 and sources.json()["0"]["topic"] == "kv-events"


def test_an_isolated_app_without_an_operator_key_keeps_them_off(tiny_runner):
    engine, args = _engine(tiny_runner, "--isolate")
    with _served(engine, args) as url:
        for path in ("metrics", "kv_event_sources"):
            assert httpx.get(url + path, headers={"Authorization": "Bearer x"}, timeout=30).status_code == 404


@pytest.mark.parametrize("flags", [(), ("--isolate", "--public-metrics")], ids=["private", "public-metrics"])
def test_a_private_app_or_an_operator_who_opens_them_serves_them_to_all(tiny_runner, flags):
    engine, args = _engine(tiny_runner, *flags)
    with _served(engine, args) as url:
        assert httpx.get(url + "metrics", timeout=30).status_code == 200
        assert httpx.get(url + "kv_event_sources", timeout=30).status_code == 200


def test_the_rule():
    assert ServerReadRule(isolation=False).allows({})
    assert not ServerReadRule(isolation=True).allows({"authorization": "Bearer "})
    assert not ServerReadRule(isolation=True, operator_key="k").allows({"authorization": "Bearer x"})
    assert ServerReadRule(isolation=True, operator_key="k").allows({"authorization": "Bearer k"})
    assert ServerReadRule(isolation=True, public=True).allows({})
