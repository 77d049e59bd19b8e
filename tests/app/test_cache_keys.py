"""One keying for the page and the HTTP API, owned by the engine (``engine.cache_keys``,
``EngineAPI.key_for``), and the page's per-engine objects kept on the page's side
(``components.panels.engine_state``).

The rules are checked against the formulas the page and the API used before they shared one
home (so the names, and what shares with what, did not change); then, for a table of visitors,
salts and both isolation settings, the page's key (``page_keyed``, and what ``build_request``
sends) and the API's (what the route sends, as the engine keys it) both equal ``KeyRules.key``
with the engine's secret and the shipped blocks the page tokenized itself before.
"""

from __future__ import annotations

import ast
import gc
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from components.chat_presets import FEW_SHOT_PRESETS, SYSTEM_PRESETS, few_shot_prompt, few_shot_static_part
from components.panels.chat_panel import build_request, chat_messages
from components.panels.engine_state import _PAGE, engine_state
from components.session import page_keyed, share_page_blocks
from components.warm_start import shipped_prefixes
from engine.cache_keys import KeyRules, Visitor, shipped_part
from engine.namespaces import owner_of, secret_name
from engine.types import PUBLIC, CacheKey, GenerationRequest
from server.cache_scope import api_visitor, keyed_request

ROOT = Path(__file__).resolve().parents[2]
SECRET = b"k" * 16
HEX = "[0-9a-f]"


# ----------------------------------------------------------------- the rules, as they were
def test_page_rules_are_the_ones_the_page_had():
    on, off = KeyRules(True, SECRET), KeyRules(False, SECRET)
    tab = Visitor.page("10.0.0.1", "sess")
    assert on.namespace(tab) == (secret_name("v-", SECRET, "origin\0" + "10.0.0.1", 12) + "/"
                                 + secret_name("s-", SECRET, "sess", 12))
    assert off.namespace(tab) == PUBLIC
    anon = [on.namespace(Visitor.page("10.0.0.1", s)) for s in (None, "", None)]
    owner = secret_name("v-", SECRET, "origin\0" + "10.0.0.1", 12)
    # no session: a namespace of its own each time, inside its address's (no share of its own)
    assert len(set(anon)) == 3 and all(re.fullmatch(re.escape(owner) + f"/anon-{HEX}{{12}}", a) for a in anon)
    nowhere = [on.namespace(Visitor.page("", None)) for _ in range(2)]  # no request at all
    assert nowhere[0] != nowhere[1] and all(re.fullmatch(f"v-anon-{HEX}{{12}}", a) for a in nowhere)
    assert on.store(tab) and off.store(tab) and on.store(Visitor.page("", None))


def test_api_rules_are_the_ones_the_api_had():
    on, off = KeyRules(True, SECRET), KeyRules(False, SECRET)
    salted = secret_name("salt-", SECRET, "team", 16)
    owner = secret_name("api-", SECRET, "client\0" + "key-1", 12)
    assert off.namespace(Visitor.api("key-1", None)) == PUBLIC
    assert off.namespace(Visitor.api("key-1", "team")) == off.namespace(Visitor.api("key-2", "team")) == salted
    assert on.namespace(Visitor.api("key-1", "team")) == f"{owner}/{salted}"
    assert on.owner(Visitor.api("key-1", None)) == owner
    anon = [on.namespace(Visitor.api("key-1", None)) for _ in range(2)]
    assert anon[0] != anon[1] and all(re.fullmatch(re.escape(owner) + f"/anon-{HEX}{{16}}", a) for a in anon)
    assert not on.store(Visitor.api("key-1", None)) and on.store(Visitor.api("key-1", "team"))
    assert off.store(Visitor.api("key-1", None))
    assert api_visitor("key-1", "team") == Visitor.api("key-1", "team")  # the API's visitor
    assert KeyRules(True).namespace(Visitor.api("key-1", "team")) != on.namespace(Visitor.api("key-1", "team"))


def test_only_whole_shipped_blocks_are_shareable():
    rules = KeyRules(True, SECRET, shipped=((1, 2, 3), (1, 2, 3, 4, 5), (9, 9)))
    tab = Visitor.page("10.0.0.1", "sess")
    for ids, shared in (([1, 2, 3, 4, 5, 6], 5), ([1, 2, 3, 4], 3), ([1, 2], 0), ([9, 9], 2), ([7, 1, 2, 3], 0)):
        key = rules.key(ids, tab)
        assert key == CacheKey(tuple(ids), rules.namespace(tab), shared)
    assert shipped_part(rules.key([1, 2, 3, 4, 5, 6], tab)) == CacheKey((1, 2, 3, 4, 5), PUBLIC, 5)
    assert shipped_part(rules.key([7], tab)) is None
    assert KeyRules(True, SECRET).key([1, 2, 3], tab).public_len == 0
    assert rules.key([1, 2, 3, 4, 5, 6], Visitor.api("key-1", "team")).public_len == 0  # the API shares no block


def test_a_sub_namespace_stays_inside_the_visitors():
    on, off = KeyRules(True, SECRET), KeyRules(False, SECRET)
    tab = Visitor.page("10.0.0.1", "sess")
    assert on.namespace(tab, "lab-1") == on.namespace(tab) + "/lab-1" == on.key([1], tab, "lab-1").namespace
    assert off.namespace(tab, "lab-1") == "lab-1" and off.namespace(tab, None) == PUBLIC


def old_page_blocks(engine) -> tuple[tuple[int, ...], ...]:
    """The shipped blocks' ids as the page tokenized them itself before the engine did."""
    out = []
    for text in SYSTEM_PRESETS.values():
        out.append(tuple(engine.encode(engine.render_chat([{"role": "system", "content": text}],
                                                          add_generation_prompt=False))))
    for preset in FEW_SHOT_PRESETS.values():
        static = few_shot_static_part(preset["instruction"], preset["examples"])
        rendered = engine.render_chat([{"role": "user", "content": static + "\x00"}])
        out.append(tuple(engine.encode(rendered[: rendered.index("\x00")])))
    return tuple(p[:-1] for p in out if len(p) > 1)


# ----------------------------------------------------------------- page and API agree
CASES = [  # (address, session, cache_salt)
    ("10.0.0.1", "tab-a", None),
    ("10.0.0.1", "tab-b", "team"),
    ("10.0.0.2", "tab-a", "team"),
    ("10.0.0.2", "tab-c", "other"),
    ("10.0.0.1", None, None),
]


def _same(got: CacheKey, want: CacheKey, random_part: bool) -> None:
    """Equal; or, where the rules draw a fresh namespace, equal but for it (same owner kind)."""
    if not random_part:
        assert got == want
        return
    assert (got.ids, got.public_len) == (want.ids, want.public_len) and got.namespace != want.namespace
    assert owner_of(got.namespace).split("-")[0] == owner_of(want.namespace).split("-")[0]


@pytest.mark.parametrize("isolation", [True, False])
def test_page_and_api_key_through_the_one_function(isolation, make_engine):
    engine = make_engine(isolation=isolation, max_new_tokens_cap=4)
    share_page_blocks(engine)
    assert engine._shipped == old_page_blocks(engine)  # the same blocks as the page had
    rules = KeyRules(isolation, engine._key_secret, old_page_blocks(engine))
    for msgs in (chat_messages(SYSTEM_PRESETS["Pirate"], [], "hi"), chat_messages("Be terse.", [], "hi")):
        gen = GenerationRequest(messages=tuple(msgs))
        ids = engine.prompt_ids(gen)
        for origin, sess, salt in CASES:
            tab = SimpleNamespace(session_hash=sess, client=SimpleNamespace(host=origin), headers={})
            want = rules.key(ids, Visitor.page(origin, sess))
            built = build_request(engine, msgs, 2, False, tab, tag="chat")
            for got in (page_keyed(engine, gen, tab).key, engine.cache_key(list(built.prompt_ids), built)):
                _same(got, want, random_part=isolation and not sess)
            # The API: what the route sends (namespace, store), as the engine keys it.
            visitor = Visitor.api(origin, salt)
            sent = keyed_request(engine, gen, origin, salt)
            assert list(sent.prompt_ids) == ids and sent.messages is None
            _same(engine.cache_key(ids, sent), rules.key(ids, visitor), random_part=isolation and not salt)
            assert sent.store == rules.store(visitor)
    assert page_keyed(engine, gen, None).key.public_len == 0  # the custom prompt shares nothing


def test_warm_start_keys_the_shipped_part_of_the_page_key(make_engine):
    engine = make_engine(isolation=True, max_new_tokens_cap=4)
    keys = dict(shipped_prefixes(engine))
    preset = FEW_SHOT_PRESETS["Sentiment"]
    msgs = [{"role": "user", "content": few_shot_prompt(preset["instruction"], preset["examples"], "?")}]
    tab = SimpleNamespace(session_hash="tab-a", client=SimpleNamespace(host="10.0.0.1"), headers={})
    assert keys["few-shot set “Sentiment”"] == shipped_part(page_keyed(engine, GenerationRequest(
        messages=tuple(msgs)), tab).key)
    assert all(k.namespace == PUBLIC and k.public_len == len(k.ids) > 0 for k in keys.values())


def test_the_keying_callers_compute_no_namespace_of_their_own():
    """``session``, ``warm_start`` and ``cache_scope`` hand visitors to the engine, which keys;
    the page and the API hold no secret, no rules and (session, cache_scope) tokenize nothing."""
    for rel in ("components/session.py", "components/warm_start.py", "server/cache_scope.py"):
        names = {n.id for n in ast.walk(ast.parse((ROOT / rel).read_text())) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(ast.parse((ROOT / rel).read_text())) if isinstance(n, ast.Attribute)}
        assert not names & {"secret_name", "PUBLIC", "token_hex", "token_bytes", "KeyRules"}, rel
        if rel != "components/warm_start.py":  # the warm start's growth filler encodes its own text
            assert not names & {"encode", "prompt_ids"}, rel


# ----------------------------------------------------------------- the page's per-engine objects
def test_the_page_keeps_its_objects_out_of_the_engine():
    offenders = [f"{p.relative_to(ROOT)}:{n.lineno}" for p in sorted((ROOT / "components").rglob("*.py"))
                 for n in ast.walk(ast.parse(p.read_text()))
                 if isinstance(n, ast.Attribute) and n.attr == "attachment"]
    assert not offenders, offenders


def test_engine_state_is_one_object_per_engine_and_dies_with_it(make_engine):
    engine, other = make_engine(), make_engine()
    made = []
    first = engine_state(engine, "test.memo", lambda: made.append(1) or object())
    assert engine_state(engine, "test.memo", lambda: made.append(1) or object()) is first and made == [1]
    assert engine_state(other, "test.memo", object) is not first

    class Holder:  # any weakly referable key: the registry knows nothing of what an engine is
        pass

    key = Holder()
    engine_state(key, "test.memo", object)  # type: ignore[arg-type]
    assert any(isinstance(k, Holder) for k in _PAGE.engines())
    del key
    gc.collect()
    assert not any(isinstance(k, Holder) for k in _PAGE.engines())
