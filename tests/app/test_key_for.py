"""``EngineAPI.key_for``: the engine keys a request for a visitor and says how much of it it
would reuse now; a local engine by its radix cache, a remote one by what it knows (the shadow
tree of what it sent), on real tiny engines and, for the remote one, a real HTTP backend."""

from __future__ import annotations

from types import SimpleNamespace

from components.chat_presets import SYSTEM_PRESETS
from components.panels.chat_panel import build_request, chat_messages
from components.session import page_keyed, page_visitor, share_page_blocks, sub_namespace, visitor_namespace
from engine.cache_keys import Visitor
from engine.types import PUBLIC, GenerationRequest, SamplingParams
from server.remote.engine import RemoteEngine
from tests.helpers_app import launched_app


def tab(session: str, origin: str = "10.0.0.1") -> SimpleNamespace:
    return SimpleNamespace(session_hash=session, client=SimpleNamespace(host=origin), headers={})


def pirate(question: str) -> GenerationRequest:
    return GenerationRequest(messages=tuple(chat_messages(SYSTEM_PRESETS["Pirate"], [], question)),
                             sampling=SamplingParams(max_new_tokens=3))


def test_matched_len_is_what_the_run_then_reuses(make_engine):
    engine = make_engine(budget_bytes=32 * 2**20, isolation=True, max_new_tokens_cap=4)
    share_page_blocks(engine)
    a, b = tab("tab-a"), tab("tab-b", "10.0.0.2")
    first = page_keyed(engine, pirate("Where is the treasure buried?"), a)
    assert first.matched_len == 0 and first.key.public_len > 0 and first.store
    assert engine.run(first.request(pirate("?"))).cached_tokens == 0
    # The same visitor again: all but the last token; another visitor: only the shipped block.
    again = page_keyed(engine, pirate("Where is the treasure buried?"), a)
    other = page_keyed(engine, pirate("Where is the treasure buried?"), b)
    assert again.matched_len == len(again.ids) - 1
    assert other.matched_len == other.key.public_len < again.matched_len
    for keyed in (other, again):
        assert engine.run(keyed.request(pirate("?"))).cached_tokens == keyed.matched_len
    # A longer conversation of visitor a: the earlier turn is matched, as the run reuses it.
    longer = page_keyed(engine, pirate("Where is the treasure buried? Tell me more, matey."), a)
    assert other.key.public_len <= longer.matched_len < len(longer.ids) - 1
    assert engine.run(longer.request(pirate("?"))).cached_tokens == longer.matched_len
    engine.check_invariants()


def test_the_engine_names_a_visitors_namespaces(make_engine):
    engine = make_engine(isolation=True, max_new_tokens_cap=4)
    mine = visitor_namespace(tab("s1"), engine)
    assert mine == engine.namespace_for(page_visitor(tab("s1"))) == page_keyed(engine, pirate("hi"), tab("s1")).key.namespace
    assert sub_namespace(tab("s1"), engine, "lab-1") == mine + "/lab-1"
    assert engine.key_for(pirate("hi"), page_visitor(tab("s1")), "lab-1").key.namespace == mine + "/lab-1"
    other = make_engine(isolation=True)  # one secret per process, as the page's was
    assert other.namespace_for(page_visitor(tab("s1"))) == mine
    api = engine.key_for(pirate("hi"), Visitor.api("addr:1.2.3.4", None))
    assert not api.store and api.key.public_len == 0  # no salt on an isolating server: nobody could reuse it


def test_build_request_is_the_engines_key(make_engine):
    engine = make_engine(isolation=False, max_new_tokens_cap=4)
    msgs = chat_messages(SYSTEM_PRESETS["Pirate"], [], "hi")
    built = build_request(engine, msgs, 2, False, tab("s1"), tag="chat")
    keyed = page_keyed(engine, GenerationRequest(messages=tuple(msgs)), tab("s1"))
    assert built.prompt_ids == keyed.ids and built.namespace == keyed.key.namespace == PUBLIC
    assert built.public_len == keyed.key.public_len > 0 and built.tag == "chat" and built.messages is None


def test_a_remote_engine_keys_alike_and_matches_what_it_sent(tokenizer, make_engine):
    """The remote engine keys by the same rules; its matched length is its shadow tree's (what
    this dashboard sent), which here the backend (this app's engine, not isolating) reuses too."""

    backend = make_engine(budget_bytes=32 * 2**20, max_new_tokens_cap=8)
    local = make_engine(max_new_tokens_cap=8)
    with launched_app(backend) as url:
        remote = RemoteEngine(url, "", tokenizer, max_new_tokens_cap=16)
        remote.check_backend()
        try:
            for eng in (remote, local):
                share_page_blocks(eng)
            gen = pirate("Where is the treasure buried?")
            keyed, there = page_keyed(remote, gen, tab("s1")), page_keyed(local, gen, tab("s1"))
            assert keyed.key == there.key and keyed.matched_len == 0  # not isolating: PUBLIC on both
            remote.run(keyed.request(gen))
            again = page_keyed(remote, gen, tab("s1"))
            assert again.matched_len == len(again.ids) - 1
            assert remote.run(again.request(gen)).cached_tokens == again.matched_len
        finally:
            remote.close()
