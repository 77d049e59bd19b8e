"""The remote engine's panels, /metrics and hiding rule over a real recorded vLLM stream, without
a server: the recorded batches are fed to the subscriber's own ordering code (no socket opened)."""

from __future__ import annotations

import pytest

from components.panels.memory_panel import memory_markdown
from components.panels.overview_panel import key_numbers_html
from components.panels.tree_panel import REMOTE_EVENTS_NOTE, remote_note
from components.views.tree_figures import tree_figure
from engine.types import EngineError
from server.metrics import EngineMetrics
from server.remote.engine import RemoteEngine
from server.remote.kv_events import EventSource, KVEventSubscriber
from tests.server.remote.test_kv_events import recorded


@pytest.fixture
def remote(tokenizer):
    engine = RemoteEngine("http://127.0.0.1:9", "SmolLM2-135M-Instruct", tokenizer, isolation=True)
    engine.events = KVEventSubscriber(EventSource("tcp://127.0.0.1:1"), engine.blocks)  # never started
    engine.events.synced = True
    yield engine
    engine.events._ctx.term()
    engine.events = None
    engine.close()


def test_panels_and_metrics_show_the_servers_blocks(remote):
    assert remote.snapshot().origin == "shadow"  # no event yet: the shadow tree
    for seq, payload in recorded("vllm_basic")["batches"]:
        remote.events._on_batch(seq, payload, live=True)
    assert remote.events_active and remote.blocks.num_blocks == 12
    snap = remote.snapshot()
    assert snap.origin == "events" and snap.num_tokens == 12 * 32
    # under isolation nobody's request walked these blocks: every visitor sees coarse "others" only
    view = remote.snapshot(viewer="v-someone")
    assert view.nodes and all(n.hidden and not n.token_ids for n in view.nodes)
    fig = tree_figure(view, {}, viewer_owns="v-someone")
    assert "the server's own blocks" in fig.layout.title.text
    table = memory_markdown(remote, viewer="v-someone")
    assert "blocks in GPU | **about 16** held now" in table and "8 batches" in table  # 12 blocks, coarse
    assert "agree" in table
    assert "held by the remote server" in key_numbers_html(remote, None, "v-someone")
    assert remote_note(remote) == REMOTE_EVENTS_NOTE
    text = EngineMetrics(lambda: remote).text().decode()
    assert 'radix_backend_kv_blocks{medium="GPU"} 12.0' in text and "radix_backend_kv_events_total 8.0" in text
    assert "radix_backend_kv_batches_rejected_total 0.0" in text
    remote.check_invariants()


def test_a_bad_override_is_one_clear_error(remote):
    with pytest.raises(EngineError, match="--backend-kv-events"):
        remote.follow_kv_events("localhost:5557")
    assert remote.follow_kv_events("off") is None
