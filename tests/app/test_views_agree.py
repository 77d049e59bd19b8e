"""One hiding rule for every view: the local cache and the remote engine's shadow tree, given the
same tree, show each viewer exactly the same nodes (other visitors folded into coarse "others"
nodes, no hits or times on shared ones), and remote ``stats(viewer)`` counts only what that
viewer may see, as local ``stats(viewer)`` does."""

from __future__ import annotations

import dataclasses

import pytest

from engine.snapshot_view import HIDDEN_BUCKET_TOKENS
from engine.types import PUBLIC, GenerationRequest, SamplingParams, TreeSnapshot
from server.remote.engine import RemoteEngine
from tests.app.test_remote import FIXTURES, scripted_backend
from tests.helpers_app import wait_idle

SHARED = "You are the shop's assistant. Answer in one short sentence, politely and precisely. " * 2
RUNS = [("v-a", SHARED + "Where are the hammers?"), ("v-b", SHARED + "Where are the nails?"),
        ("v-b", SHARED + "Where are the nails? And the screws, please?"), ("v-a/lab-1", "Lab variant one."),
        ("v-c", "Another visitor's private words " * 12), (PUBLIC, SHARED + "Opening hours?")]


def shape(snap: TreeSnapshot) -> tuple:
    """The nodes as a viewer reads them, less what differs by construction (bytes are unknown
    remotely; two snapshots are never taken at the same instant)."""
    return tuple(dataclasses.replace(n, num_bytes=0, last_access_s_ago=0.0) for n in snap.nodes)


@pytest.fixture(scope="module")
def engines(tiny_runner, make_module_engine):
    local = make_module_engine(isolation=True, max_new_tokens_cap=4, budget_bytes=4000 * tiny_runner.kv_bytes_per_token)
    public = len(local.encode(SHARED)) - 1
    for ns, prompt in RUNS:
        local.run(GenerationRequest(prompt=prompt, namespace=ns, sampling=SamplingParams(max_new_tokens=3),
                                    public_len=public if prompt.startswith(SHARED) else 0))
    wait_idle(local)
    remote = RemoteEngine("http://127.0.0.1:9", "m", tiny_runner.text.tokenizer, isolation=True)
    remote.tree = local.cache.tree  # the same tree behind both (read only here)
    yield local, remote
    remote.close()


@pytest.mark.parametrize("viewer", ["v-a", "v-b", "v-c", "v-nobody"])
def test_local_and_remote_views_of_one_tree_hide_others_identically(engines, viewer):
    local, remote = engines
    mine, theirs = local.snapshot(viewer=viewer), remote.snapshot(viewer=viewer)
    assert shape(mine) == shape(theirs)
    assert mine.num_tokens == theirs.num_tokens and mine.evicted_tokens == theirs.evicted_tokens
    hidden = [n for n in theirs.nodes if n.hidden]
    assert hidden and all(n.num_tokens % HIDDEN_BUCKET_TOKENS == 0 and n.text == "" and n.hits == 0
                          and n.token_ids == () for n in hidden)
    assert all(n.hits == 0 and n.last_access_s_ago == 0.0 for n in theirs.nodes if n.namespace == PUBLIC)
    assert shape(local.snapshot()) == shape(remote.snapshot())  # no viewer: everything, node for node
    here, there = local.stats(viewer), remote.stats(viewer)
    assert (here.cached_tokens_now, here.num_nodes, here.locked_tokens) == \
        (there.cached_tokens_now, there.num_nodes, there.locked_tokens)


def test_remote_stats_honour_the_viewer(tokenizer):
    text = (FIXTURES / "vllm_completions_stream.txt").read_bytes()
    with scripted_backend(text, finish=True) as url:
        remote = RemoteEngine(url, "m", tokenizer, isolation=True)
        for ns, prompt in RUNS:
            remote.run(GenerationRequest(prompt=prompt, namespace=ns, sampling=SamplingParams(max_new_tokens=2)))
        everyone = remote.stats()
        for viewer, own in (("v-a", 2), ("v-b", 2), ("v-c", 1), ("v-nobody", 0)):
            seen = remote.stats(viewer)
            snap = remote.snapshot(viewer=viewer)
            assert seen.requests == own < everyone.requests == len(RUNS)
            mine = [m for m in remote.recent() if m.namespace == viewer or m.namespace.startswith(viewer + "/")]
            assert seen.prompt_tokens == sum(m.prompt_tokens for m in mine)
            assert seen.cached_tokens_now == snap.num_tokens and seen.num_nodes == len(snap.nodes)
            assert seen.cached_tokens_now != everyone.cached_tokens_now  # others' tokens counted coarse
        remote.close()

