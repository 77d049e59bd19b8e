"""Privacy on a public page: per-visitor cache namespaces (isolation mode) against one shared
cache (shared mode), at engine level and through two gradio_client visitors of the launched app.

In isolation mode a visitor never gets a cache hit on another visitor's text, the tree view
shows other visitors' nodes only as shape and size, and content shipped with the app (preset
system prompts, few-shot sets) is still shared.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

import app
from components.chat_presets import CUSTOM_SYSTEM, DEFAULT_SYSTEM, FEW_SHOT_PRESETS, SYSTEM_PRESETS, few_shot_prompt
from components.panels.chat_panel import build_request, chat_messages
from components.session import page_keyed, sub_namespace, visitor_namespace
from engine.engine import Engine
from engine.namespaces import owner_of
from engine.snapshot_view import HIDDEN_BUCKET_TOKENS
from engine.types import PUBLIC, GenerationRequest, SamplingParams
from tests.helpers_app import assert_clean, flat_text, launched_app, visitor

SECRET = "My bank PIN is 4921 and my password is tangerine-falcon."
SECRET_B = "Visitor B's diary: the meeting with Dana moved to Thursday."


def session(name: str) -> SimpleNamespace:
    """What a handler sees of a visitor: a gr.Request with a session hash."""
    return SimpleNamespace(session_hash=f"session-{name}")


def public_len(engine: Engine, ids: list[int]) -> int:
    """Tokens of ``ids`` a page visitor shares with everyone, as the engine keys them."""
    return page_keyed(engine, GenerationRequest(prompt_ids=tuple(ids)), session("any")).key.public_len


def chat(engine: Engine, who: str, system: str, question: str, max_new: int = 3):
    req = build_request(engine, chat_messages(system, [], question), max_new, False, session(who), tag="chat")
    return req, engine.run(req)


@pytest.fixture()
def isolated(make_engine) -> Engine:
    return make_engine(isolation=True, max_new_tokens_cap=8)


@pytest.fixture()
def shared(make_engine) -> Engine:
    return make_engine(isolation=False, max_new_tokens_cap=8)


# ----------------------------------------------------------------- namespaces
def test_visitor_namespace_is_set_by_the_server(isolated, shared):
    a, a2, b = (visitor_namespace(session(n), isolated) for n in ("a", "a", "b"))
    assert a == a2 != b and a != PUBLIC and b != PUBLIC
    assert "session-a" not in a  # a salted digest: the client's value never becomes the key
    anon1, anon2 = visitor_namespace(None, isolated), visitor_namespace(SimpleNamespace(session_hash=""), isolated)
    assert PUBLIC not in (anon1, anon2) and anon1 != anon2  # no session: shares nothing with anyone
    # ... and an address's requests without a session count as that address's (no share of their own)
    tab = SimpleNamespace(session_hash="s", headers={}, client=SimpleNamespace(host="10.1.2.3"))
    bare = SimpleNamespace(session_hash=None, headers={}, client=SimpleNamespace(host="10.1.2.3"))
    ns_tab, ns_bare = visitor_namespace(tab, isolated), visitor_namespace(bare, isolated)
    assert owner_of(ns_bare) == owner_of(ns_tab) and ns_bare != ns_tab != visitor_namespace(bare, isolated)
    assert visitor_namespace(session("a"), shared) == PUBLIC
    assert sub_namespace(session("a"), isolated, "lab-1") == a + "/lab-1"
    assert sub_namespace(session("a"), shared, "lab-1") == "lab-1"


def test_page_visitors_share_one_owner_per_address_but_never_a_namespace(isolated, monkeypatch):
    """Fair shares and turns count per address (the owner, before the ``/``), like the API's
    per-client limits, so more tabs or invented session hashes buy no more; each tab keeps a
    namespace of its own (no hits, no text across tabs). On Spaces the proxy's last
    ``X-Forwarded-For`` hop is the address, whatever a client put before it."""
    from engine.namespaces import owner_of
    from engine.snapshot_view import is_own

    def tab(session: str, host: str, forwarded: str = "") -> SimpleNamespace:
        return SimpleNamespace(session_hash=session, client=SimpleNamespace(host=host),
                               headers={"x-forwarded-for": forwarded} if forwarded else {})

    a1, a2, b = (visitor_namespace(t, isolated) for t in (tab("s1", "10.0.0.1"), tab("s2", "10.0.0.1"),
                                                              tab("s3", "10.0.0.2")))
    assert owner_of(a1) == owner_of(a2) != owner_of(b)
    assert a1 != a2 and not is_own(a1, a2) and not is_own(a2, a1)  # one address, two private tabs
    assert "10.0.0.1" not in a1 and "s1" not in a1  # digests: neither the address nor the session shows
    monkeypatch.setenv("SYSTEM", "spaces")
    forged = visitor_namespace(tab("s4", "10.9.9.9", "6.6.6.6, 10.0.0.1"), isolated)
    assert owner_of(forged) == owner_of(a1)  # the hop the proxy appended counts, not the client's own


def test_isolation_flag_defaults(monkeypatch):
    for var in ("SYSTEM", "RADIX_ISOLATE"):
        monkeypatch.delenv(var, raising=False)
    assert app.parse_args([]).isolate is False
    assert app.parse_args(["--isolate"]).isolate is True
    monkeypatch.setenv("SYSTEM", "spaces")
    assert app.parse_args([]).isolate is True
    assert app.parse_args(["--no-isolate"]).isolate is False
    monkeypatch.setenv("RADIX_ISOLATE", "0")
    assert app.parse_args([]).isolate is False
    monkeypatch.delenv("SYSTEM")
    monkeypatch.setenv("RADIX_ISOLATE", "True")
    assert app.parse_args([]).isolate is True


# ----------------------------------------------------------------- cache hits
def test_isolated_visitor_never_hits_another_visitors_text(isolated):
    _, first = chat(isolated, "a", SECRET, "What is my PIN?")
    req, again = chat(isolated, "b", SECRET, "What is my PIN?")
    assert req.public_len == 0 and again.cached_tokens == 0
    _, own = chat(isolated, "a", SECRET, "What is my PIN?")
    assert own.cached_tokens == own.prompt_tokens - 1  # a visitor's own cache still works
    # A new visitor guessing A's text piece by piece learns nothing either: every prefix misses.
    for cut in (5, 12, len(SECRET)):
        _, probe = chat(isolated, f"c{cut}", SECRET[:cut], "x")
        assert probe.cached_tokens == 0
    assert_clean(isolated)


def test_shared_mode_reuses_across_visitors(shared):
    _, first = chat(shared, "a", SECRET, "What is my PIN?")
    _, again = chat(shared, "b", SECRET, "What is my PIN?")
    assert again.cached_tokens == again.prompt_tokens - 1
    assert_clean(shared)


def test_shipped_system_prompt_is_shared_and_nothing_more(isolated):
    system = SYSTEM_PRESETS[DEFAULT_SYSTEM]
    req_a, a = chat(isolated, "a", system, SECRET)
    req_b, b = chat(isolated, "b", system, SECRET)  # same secret question: still not shared
    assert req_a.public_len == req_b.public_len > 100
    assert b.cached_tokens == req_b.public_len
    assert_clean(isolated)


def test_only_whole_shipped_blocks_are_public(isolated):
    """A custom prompt that starts like a preset shares nothing, or the point where it
    left the preset would show in the public part of the tree."""
    pirate = SYSTEM_PRESETS["Pirate"]

    def ids(system: str, q: str) -> list[int]:
        return isolated.prompt_ids(GenerationRequest(messages=tuple(chat_messages(system, [], q))))

    assert public_len(isolated, ids(pirate, "hi")) > 0
    assert public_len(isolated, ids(pirate[:-1] + " who loves secrets.", "hi")) == 0
    assert public_len(isolated, ids("You are a friendly", "hi")) == 0


def test_shipped_few_shot_sets_are_shared(isolated):
    preset = FEW_SHOT_PRESETS["Sentiment"]

    def ids(examples, query):
        msgs = ({"role": "user", "content": few_shot_prompt(preset["instruction"], examples, query)},)
        return isolated.prompt_ids(GenerationRequest(messages=msgs))

    p1, p2 = ids(preset["examples"], "Great!"), ids(preset["examples"], "Awful.")
    assert public_len(isolated, p1) == public_len(isolated, p2) > 100
    edited = [(preset["examples"][0][0] + " My address is 12 Elm St.", "positive")] + preset["examples"][1:]
    assert public_len(isolated, ids(edited, "Great!")) == 0
    # Two visitors, same shipped set, own queries: the set is served from the cache to the second.
    for who, query in (("a", "Great!"), ("b", "Awful.")):
        pid = ids(preset["examples"], query)
        req = GenerationRequest(prompt_ids=tuple(pid), sampling=SamplingParams(max_new_tokens=2),
                                namespace=visitor_namespace(session(who), isolated), public_len=public_len(isolated, pid))
        m = isolated.run(req)
    assert m.cached_tokens == public_len(isolated, pid)
    assert_clean(isolated)


# ----------------------------------------------------------------- tree view
def _texts(snapshot) -> str:
    return "\n".join(n.text for n in snapshot.nodes)


def test_tree_view_shows_other_visitors_as_shape_and_size_only(isolated):
    chat(isolated, "a", SYSTEM_PRESETS[DEFAULT_SYSTEM], SECRET)
    chat(isolated, "b", SYSTEM_PRESETS[DEFAULT_SYSTEM], SECRET_B)
    lab = GenerationRequest(prompt=SECRET + " (lab variant)", sampling=SamplingParams(max_new_tokens=1),
                            namespace=sub_namespace(session("a"), isolated, "lab-good"))
    isolated.run(lab)
    ns_a, ns_b = visitor_namespace(session("a"), isolated), visitor_namespace(session("b"), isolated)
    view_a, view_b = isolated.snapshot(viewer=ns_a), isolated.snapshot(viewer=ns_b)
    assert "PIN is 4921" in _texts(view_a) and "Dana" not in _texts(view_a)
    assert "Dana" in _texts(view_b) and "4921" not in _texts(view_b)
    assert "Northwind" in _texts(view_a) and "Northwind" in _texts(view_b)  # shipped content: visible
    for view, own in ((view_a, ns_a), (view_b, ns_b)):
        hidden = [n for n in view.nodes if n.hidden]
        assert hidden, "the other visitor's nodes are still drawn (as shape and size)"
        for n in hidden:
            assert n.text == "" and n.token_ids == () and n.namespace not in (ns_a, ns_b)
            assert n.num_tokens > 0 and n.num_bytes == n.num_tokens * view.bytes_per_token
        for n in view.nodes:
            assert n.hidden or n.namespace in (PUBLIC, own) or n.namespace.startswith(own + "/")
    # Both see the same shared nodes; the other's nodes only as coarse "others" nodes under them.
    shared_a = sorted((n.node_id, n.num_tokens) for n in view_a.nodes if n.namespace == PUBLIC)
    assert shared_a == sorted((n.node_id, n.num_tokens) for n in view_b.nodes if n.namespace == PUBLIC)
    for view in (view_a, view_b):
        for n in view.nodes:
            if n.hidden:
                assert n.num_tokens % HIDDEN_BUCKET_TOKENS == 0 and n.hits == n.lock_ref == 0
                assert n.last_access_s_ago == 0.0 and n.node_id < 0


def _others_view(engine: Engine, viewer: str, own: str) -> tuple:
    """What ``viewer`` can read about other visitors: every snapshot field but their own nodes' clock."""
    snap = engine.snapshot(viewer=viewer)
    nodes = tuple(sorted((n.node_id, n.parent_id, n.num_tokens, n.depth_tokens, n.num_bytes, n.lock_ref, n.hits,
                          n.namespace, n.hidden, n.token_ids, n.text,
                          0.0 if n.namespace.startswith(own) else n.last_access_s_ago) for n in snap.nodes))
    stats = engine.stats(viewer)
    return (nodes, snap.num_tokens, snap.num_bytes, snap.evicted_tokens, stats.cached_tokens_now, stats.cache_bytes,
            stats.num_nodes, stats.evicted_tokens, stats.requests, stats.prompt_tokens, stats.locked_tokens)


def test_hidden_nodes_do_not_tell_which_prompt_another_visitor_sent(make_engine):
    """The attack: the three starter questions differ by a few tokens, and the size of the new
    hidden node named the one another visitor clicked in 6 of 6 trials. Now the other visitor's
    snapshot (and the cache figures shown to them) are identical whichever was sent."""
    from components.chat_presets import STARTER_QUESTIONS
    from components.views.tree_figures import snapshot_summary, tree_figure

    views, summaries = [], []
    for question in STARTER_QUESTIONS:
        engine = make_engine(isolation=True, max_new_tokens_cap=8)
        chat(engine, "b", SYSTEM_PRESETS[DEFAULT_SYSTEM], "Where is my order?")  # the observer's own turn
        chat(engine, "a", SYSTEM_PRESETS[DEFAULT_SYSTEM], question)
        ns_b = visitor_namespace(session("b"), engine)
        views.append(_others_view(engine, ns_b, ns_b))
        summaries.append(snapshot_summary(engine.snapshot(viewer=ns_b)))  # what /tree_snapshot answers
        snap = engine.snapshot(viewer=ns_b)
        assert any(n.hidden for n in snap.nodes)
        for view in ("tree", "icicle"):  # the figures still draw the aggregated nodes
            assert tree_figure(snap, None, view=view, viewer_owns=ns_b).data
    assert views[0] == views[1] == views[2]
    assert summaries[0] == summaries[1] == summaries[2]


def test_shared_mode_tree_hides_nothing(shared):
    chat(shared, "a", SECRET, "hi")
    view = shared.snapshot(viewer=visitor_namespace(session("b"), shared))
    assert not any(n.hidden for n in view.nodes) and "4921" in _texts(view)


# ----------------------------------------------------------------- launched app
def _served(numbers_markdown: str) -> int:
    """The cached-token count the chat shows its visitor ("**X of Y prompt tokens served ...")."""
    m = re.search(r"\*\*([\d,]+) of ([\d,]+) prompt tokens served", numbers_markdown)
    assert m, numbers_markdown
    return int(m.group(1).replace(",", ""))


@pytest.mark.parametrize("isolation", [True, False], ids=["isolated", "shared"])
def test_two_gradio_visitors(isolation, make_engine):
    engine = make_engine(isolation=isolation, max_new_tokens_cap=8)
    with launched_app(engine) as url:
        a, b = visitor(url), visitor(url)
        assert a.session_hash != b.session_hash
        args = ("What is my PIN?", [], CUSTOM_SYSTEM, SECRET, 3, False)
        out_a = a.predict(*args, api_name="/chat")
        out_b = b.predict(*args, api_name="/chat")
        assert flat_text(out_a[0][0]["content"]) == "What is my PIN?"
        assert _served(out_a[3]) == 0
        a.predict("Also remember code 777-ALPHA.", out_a[0], CUSTOM_SYSTEM, SECRET, 3, False, api_name="/chat")
        ns_b = visitor_namespace(SimpleNamespace(session_hash=b.session_hash, client=SimpleNamespace(host="127.0.0.1")),
                                 engine)
        tree_b = engine.snapshot(viewer=ns_b)
        api = b.view_api(print_info=False, return_format="dict")["named_endpoints"]
        tree_b_api = str(b.predict(api_name="/tree_snapshot")) if "/tree_snapshot" in api else None
        if isolation:
            assert _served(out_b[3]) == 0  # no hit on A's identical text
            assert "777-ALPHA" not in _texts(tree_b)  # only A typed it
            assert tree_b_api is None or "777-ALPHA" not in tree_b_api
            # B's own second turn still reuses B's own first one.
            out_b2 = b.predict("And my password?", out_b[0], CUSTOM_SYSTEM, SECRET, 3, False, api_name="/chat")
            assert _served(out_b2[3]) > 0
        else:
            assert _served(out_b[3]) > 0
            assert "777-ALPHA" in _texts(tree_b)
            assert tree_b_api is None or "777-ALPHA" in tree_b_api
    assert_clean(engine)
