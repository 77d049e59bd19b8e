"""A scheduler ``Request`` changes only through its own methods.

Two kinds of test: an ``ast`` scan of ``engine/`` that fails on any module but
``engine/scheduler/request.py`` assigning a field of a request or of its parts, and the
state methods themselves: the transitions in order, and the invariants they guard. The
scan is a name heuristic: a write to any field ``request.py`` declares, on any object
but ``self``, in a module that can hold a request (it imports ``engine.scheduler``; the
cache and the model below it own same-named fields of their own, ``RequestSlots.slots``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from engine.handle import RequestHandle
from engine.kvcache.request_slots import RequestSlots
from engine.scheduler.request import Answer, IllegalTransition, Request, State
from engine.types import CacheKey, GenerationRequest, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
REQUEST_PY = ROOT / "engine" / "scheduler" / "request.py"
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "update", "setdefault"}


# ------------------------------------------------------------------ the scan
def request_field_names() -> set[str]:
    """Every field ``request.py`` declares: ``self.x = ...`` in ``Request`` and the parts'
    dataclass fields (``KVBookkeeping``, ``Answer``, ``Timings``, ``PolicyMemo``)."""
    tree = ast.parse(REQUEST_PY.read_text())
    names: set[str] = set()
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
        if cls.name == "Request":
            for node in ast.walk(cls):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _on_self(node):
                    names.add(node.attr)
    return names


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id == "self"


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        out: list[ast.expr] = []
        for t in node.targets:
            out.extend(t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])
        return out
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    if isinstance(node, ast.Delete):
        return list(node.targets)
    return []


def can_hold_a_request(source: str) -> bool:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("engine.scheduler"):
            return True
        if isinstance(node, ast.Import) and any(a.name.startswith("engine.scheduler") for a in node.names):
            return True
    return False


def scanned_modules() -> list[Path]:
    return [p for p in sorted((ROOT / "engine").rglob("*.py")) if p != REQUEST_PY and can_hold_a_request(p.read_text())]


def field_writes(source: str, fields: set[str]) -> list[tuple[int, str]]:
    """``(line, text)`` of each write to a request field in ``source``: assignment, augmented
    assignment, item assignment, ``del``, a mutating call (``x.out_ids.append``) or ``setattr``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        for t in _targets(node):
            while isinstance(t, ast.Subscript):  # r.answer.out_ids[0] = ...
                t = t.value
            if isinstance(t, ast.Attribute) and t.attr in fields and not _on_self(t):
                found.append((node.lineno, ast.unparse(node)))
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr in MUTATORS and isinstance(f.value, ast.Attribute)
                    and f.value.attr in fields and not _on_self(f.value)):
                found.append((node.lineno, ast.unparse(node)))
            if isinstance(f, ast.Name) and f.id == "setattr":
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_scan_sees_every_kind_of_write():
    fields = {"slots", "out_ids", "prefill_ms", "state"}
    src = ("r.kv.slots = None\nr.timings.prefill_ms += 1.0\nr.answer.out_ids.append(3)\n"
           "r.answer.out_ids[0] = 1\nr.state, x = 1, 2\nsetattr(r, name, None)\n"
           "self.state = 1\nself.state.running.append(r)\nrs.length = 3\ny = r.kv.slots\n")
    assert sorted(line for line, _ in field_writes(src, fields)) == [1, 2, 3, 4, 5, 6]


def test_the_field_names_cover_the_parts():
    names = request_field_names()
    assert {"state", "kv", "answer", "timings", "memo", "slots", "cached_tokens", "out_ids", "text",
            "finish_reason", "first_token_at", "batch_sizes", "match_len", "queue_ahead"} <= names


def test_the_scan_reads_every_module_that_moves_requests():
    names = {p.relative_to(ROOT).as_posix() for p in scanned_modules()}
    assert {"engine/engine.py", "engine/scheduler/admission.py",
            "engine/scheduler/batch.py", "engine/scheduler/policy.py", "engine/scheduler/postprocess.py",
            "engine/scheduler/scheduler.py", "engine/scheduler/state.py", "engine/scheduler/telemetry.py"} <= names


def test_no_module_outside_request_py_writes_a_request_field():
    fields = request_field_names()
    offenders = []
    for path in scanned_modules():
        for line, text in field_writes(path.read_text(), fields):
            offenders.append(f"{path.relative_to(ROOT)}:{line}: {text}")
    assert not offenders, "change a Request through its methods (engine/scheduler/request.py):\n" + \
        "\n".join(offenders)


# ----------------------------------------------------------- the transitions
def make_request(prompt: list[int], max_new_tokens: int = 3, temperature: float = 0.0) -> Request:
    gen = GenerationRequest(prompt_ids=tuple(prompt), sampling=SamplingParams(max_new_tokens=max_new_tokens,
                                                                              temperature=temperature, seed=7))
    return Request(RequestHandle(gen, list(prompt)), CacheKey(tuple(prompt)), max_new_tokens, seq=1)


def slots_for(r: Request, cached: int) -> RequestSlots:
    """Slots the way ``PrefixCache.acquire`` hands them out: ``cached`` of them the tree's."""
    return RequestSlots(slots=list(range(r.capacity_tokens)), tree_len=cached, cached_tokens=cached,
                        path=(1,) if cached else (), node=None, length=cached)


def decode(ids) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


def admitted(prompt: list[int], cached: int = 0, max_new_tokens: int = 3) -> Request:
    r = make_request(prompt, max_new_tokens)
    r.admit(slots_for(r, cached), started_at=1.0, now=1.002)
    return r


def test_a_request_runs_through_its_states():
    r = make_request(list(range(10)), max_new_tokens=2, temperature=0.8)
    assert r.state is State.WAITING and r.prefilled == 0
    r.admit(slots_for(r, 4), started_at=1.0, now=1.002)
    assert r.state is State.PREFILL and r.kv.cached_tokens == 4 and r.kv.path == (1,)
    assert r.timings.admitted_at == 1.0 and r.timings.prefill_ms == pytest.approx(2.0)
    assert r.answer.generator is not None  # seeded at admission, as temperature > 0
    r.complete_chunk(4, 3, duration_ms=5.0, batch_size=1)
    r.complete_chunk(7, 3, duration_ms=5.0, batch_size=2)
    assert r.prefilled == 10 and r.timings.prefill_chunks == 2 and r.timings.prefill_shared_step
    assert r.timings.prefill_ms == pytest.approx(12.0)
    r.start_decode()
    r.token_sampled(2.0)
    assert r.append_token(0, 2.0, decode) == "a"
    r.complete_decode(batch_size=3)
    r.token_sampled(2.5)
    r.append_token(1, 2.5, decode)
    assert r.answer.out_ids == [0, 1] and r.timings.batch_sizes == [3]
    assert (r.timings.first_token_at, r.timings.last_token_at) == (2.0, 2.5)
    assert r.kv.slots is not None and r.kv.slots.length == 11
    r.finish("length")
    assert r.finish_reason == "length" and r.reply_key().ids == tuple(range(10)) + (0,)
    held = r.hand_back_slots()
    assert len(held) == 1 and r.kv.slots is None and r.prefilled == 0
    r.leave()
    assert r.state is State.DONE


def test_computed_never_exceeds_the_prompt():
    r = admitted(list(range(8)), cached=3)
    with pytest.raises(IllegalTransition):
        r.complete_chunk(3, 6, 1.0, 1)  # 3 + 6 > 8
    with pytest.raises(IllegalTransition):
        r.complete_chunk(4, 2, 1.0, 1)  # positions 3.. are not written yet
    r.complete_chunk(3, 5, 1.0, 1)
    assert r.prefilled == 8
    with pytest.raises(IllegalTransition):
        r.complete_chunk(8, 1, 1.0, 1)


def test_decode_needs_the_whole_prompt():
    r = admitted(list(range(8)), cached=3)
    r.complete_chunk(3, 2, 1.0, 1)
    with pytest.raises(IllegalTransition):
        r.start_decode()
    with pytest.raises(IllegalTransition):
        r.append_token(1, 1.0, decode)  # not decoding yet
    with pytest.raises(IllegalTransition):
        r.complete_decode(1)


def test_no_more_tokens_than_asked_for():
    r = admitted([1, 2, 3], max_new_tokens=1)
    r.complete_chunk(0, 3, 1.0, 1)
    r.start_decode()
    r.append_token(7, 1.0, decode)
    with pytest.raises(IllegalTransition):
        r.append_token(8, 1.1, decode)


def test_finish_only_once():
    r = admitted([1, 2, 3])
    with pytest.raises(IllegalTransition):
        _ = r.finish_reason  # not finished yet
    r.finish("cancelled")
    with pytest.raises(IllegalTransition):
        r.finish("length")
    assert r.finish_reason == "cancelled"


def test_admit_only_from_waiting_and_leave_only_once_without_slots():
    r = admitted([1, 2, 3])
    with pytest.raises(IllegalTransition):
        r.admit(slots_for(r, 0), 0.0, 0.0)
    with pytest.raises(IllegalTransition):
        r.leave()  # still holds its slots
    r.hand_back_slots()
    r.leave()
    with pytest.raises(IllegalTransition):
        r.leave()


def test_a_waiting_request_that_fails_leaves_directly():
    r = make_request([1, 2])
    assert r.hand_back_slots() == []
    r.leave()
    assert r.state is State.DONE


def test_policy_memo_reports_a_queue_place_once():
    r = make_request([1])
    assert r.memo.place(2) and not r.memo.place(2) and r.memo.place(0)
    r.memo.matched(5, 3.0)
    assert (r.memo.match_len, r.memo.match_checked_at) == (5, 3.0)


def test_answer_text_settles_whole():
    a = Answer()
    for t in (0, 1, 2):
        a.append(t, decode)
    a.settle_text(lambda ids: "whole")
    assert a.out_ids == [0, 1, 2] and a.text == "whole"
