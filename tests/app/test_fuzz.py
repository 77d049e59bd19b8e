"""Fuzz: well over 1,000 generated hostile inputs through every UI handler of the app (the
Python functions Gradio calls, found in the built Blocks), straight to the public API with
gradio_client, and to the engine: empty and whitespace-only prompts, 1 MiB strings, control
and zero-width characters, lone surrogates, emoji split across tokens, prompts over the
context length, malformed chat histories and few-shot tables, absurd slider values.

Required: no handler raises anything but a deliberate ``gr.Error``; nothing a visitor is
shown (outputs, toasts, API errors) holds a traceback or an internal-failure message; the
engine's tree and pool invariants hold afterwards, with no lock left.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import random
import re
import time
import typing
import warnings
from collections.abc import Iterator
from typing import Any

import gradio as gr
import pytest

import app
from engine.engine import Engine
from engine.types import EngineError, GenerationRequest, SamplingParams
from tests import fuzz_inputs as fz
from tests.helpers_app import assert_clean, fn_id, launched_app, raw_call, shown_logs, visitor, wait_idle

TRACEBACK = re.compile(r"Traceback \(most recent call last\)|File \"[^\"]+\", line \d+")
# Messages that mean an unexpected exception was caught and summarised for the visitor.
INTERNAL = ("Something went wrong", "The request failed:", "has not enabled verbose error reporting")
MAX_YIELDS = 300  # a generator still running after this many updates is stopped, like a visitor would


class Findings:
    def __init__(self) -> None:
        self.items: list[str] = []
        self.cases = 0

    def add(self, where: str, what: str, args: Any = None) -> None:
        self.items.append(f"{where}: {what}"[:400] + (f"  <- {_short(args)}" if args is not None else ""))

    def check_shown(self, where: str, text: str, args: Any = None) -> None:
        try:
            text.encode("utf-8")  # Gradio serializes outputs with orjson: strict UTF-8
        except UnicodeEncodeError:
            self.add(where, f"output Gradio cannot serialize (lone surrogate): {text[:80]!r}", args)
            return
        if TRACEBACK.search(text):
            self.add(where, f"traceback shown to the visitor: {text[:200]!r}", args)
        elif any(marker in text for marker in INTERNAL):
            self.add(where, f"internal failure shown: {text[:200]!r}", args)


def _short(value: Any) -> str:
    r = repr(value)
    return r if len(r) < 300 else r[:300] + f"... ({len(r):,} chars)"


def shown_strings(value: Any) -> Iterator[str]:
    """Every string inside what a handler returned (gr.update dicts, lists, tuples)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from shown_strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from shown_strings(v)


# ------------------------------------------------------------------ UI handlers
class NoProgress:
    """Stands in for gr.Progress outside a running event."""

    def __call__(self, *args, **kwargs) -> None:
        return None

    def tqdm(self, iterable, *args, **kwargs):
        return iterable


def handlers(demo: gr.Blocks) -> list:
    """Each distinct Python function wired to an event, once."""
    seen, out = set(), []
    for block in demo.fns.values():
        fn = getattr(block.fn, "__wrapped__", block.fn)
        if block.fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        out.append(block)
    return out


def _special(fn, param: inspect.Parameter) -> str | None:
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = {}
    ann = str(hints.get(param.name, param.annotation))
    if "Request" in ann:
        return "request"
    if "SelectData" in ann or "EventData" in ann:
        return "event"
    if isinstance(param.default, gr.Progress):
        return "progress"
    return None


def call_handler(block, args: list, session: str, rng: random.Random) -> list:
    """Call ``block.fn`` the way Gradio would (special parameters filled in); return what it
    produced, one entry per update (a generator is read to its end, or stopped)."""
    fn = block.fn
    request = gr.Request(username=None, session_hash=session)
    values, it = [], iter(args)
    for p in inspect.signature(fn).parameters.values():
        kind = _special(fn, p)
        if kind == "request":
            values.append(request)
        elif kind == "event":
            values.append(gr.SelectData(None, {"value": rng.choice(["Chat", "Radix tree", "Latency", "nope", None]),
                                               "index": rng.randint(-1, 9), "selected": True}))
        elif kind == "progress":
            values.append(NoProgress())
        else:
            values.append(next(it, None if p.default is inspect.Parameter.empty else p.default))
    result = fn(*values)
    if not inspect.isgenerator(result):
        return [result]
    updates = []
    try:
        for update in result:
            updates.append(update)
            if len(updates) >= MAX_YIELDS:
                break
    finally:
        result.close()  # what Gradio does when the visitor stops or leaves
    return updates


def _choices(comp) -> list:
    return [c[1] if isinstance(c, tuple | list) else c for c in (getattr(comp, "choices", None) or [])]


def fuzz_value(comp, rng: random.Random, states: dict[int, list]) -> Any:
    """A value Gradio could hand this input after its own preprocessing, chosen to hurt."""
    kind = type(comp).__name__
    if kind in ("Textbox", "TextArea", "Code"):
        return rng.choice([fz.text(rng), fz.text(rng), None])
    if kind in ("Slider", "Number"):
        return fz.number(rng)
    if kind == "Checkbox":
        return rng.choice([True, False, None, 0, 1, "yes", []])
    if kind in ("Dropdown", "Radio"):
        return rng.choice(_choices(comp) + [None])
    if kind == "Chatbot":
        return fz.history(rng)
    if kind == "Dataframe":
        return fz.few_shot_rows(rng)
    if kind == "State":
        return rng.choice([None] + states.get(comp._id, []))
    return None


def valid_value(comp, states: dict[int, list]) -> Any:
    if type(comp).__name__ == "State":
        return (states.get(comp._id) or [comp.value])[-1]
    value = comp.value
    if type(comp).__name__ == "Dataframe" and isinstance(value, dict):
        value = value.get("data")
    return value


def _record_states(block, updates: list, states: dict[int, list]) -> None:
    """Keep State outputs, so later calls get realistic session state as well as junk."""
    for update in updates:
        values = update if isinstance(update, tuple | list) and len(block.outputs) > 1 else [update]
        for comp, value in zip(block.outputs, values, strict=False):
            if type(comp).__name__ == "State" and value is not None and not isinstance(value, dict):
                bucket = states.setdefault(comp._id, [])
                bucket.append(value)
                del bucket[:-3]


def run_handler_case(block, args: list, findings: Findings, states: dict, rng: random.Random) -> None:
    where = f"UI {getattr(block.fn, '__qualname__', block.fn)} [{block.api_name}]"
    findings.cases += 1
    out, err = io.StringIO(), io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        warnings.simplefilter("always")
        try:
            updates = call_handler(block, args, f"fuzz-{rng.randrange(4)}", rng)
        except gr.Error as exc:  # a deliberate message for the visitor
            findings.check_shown(where, str(exc), args)
            return
        except Exception as exc:
            findings.add(where, f"raised {type(exc).__name__}: {exc}", args)
            return
    for w in caught:
        if issubclass(w.category, UserWarning):  # gr.Warning outside a running event
            findings.check_shown(where, str(w.message), args)
    findings.check_shown(where, out.getvalue(), args)  # gr.Info prints outside a running event
    for update in updates:
        values = update if isinstance(update, tuple | list) and len(block.outputs) > 1 else [update]
        for comp, value in zip(block.outputs, values, strict=False):
            if hasattr(value, "to_plotly_json"):  # a figure: its labels and hover texts are shown too
                value = value.to_plotly_json()
            if type(comp).__name__ not in ("State", "Timer"):
                for s in shown_strings(value):
                    findings.check_shown(where, s, args)
    _record_states(block, updates, states)


def calls_for(block) -> int:
    kinds = {type(c).__name__ for c in block.inputs}
    return 70 if kinds & {"Textbox", "Chatbot", "Dataframe"} else 18


@pytest.fixture(scope="module")
def ui_engine(tiny_runner, make_module_engine) -> Engine:
    return make_module_engine(max_new_tokens_cap=8, budget_bytes=600 * tiny_runner.kv_bytes_per_token)


def test_fuzz_ui_handlers(ui_engine, monkeypatch):
    from components.panels import chat_panel

    engine = ui_engine
    # The pause a chat turn leaves the page to draw its answer before the paired timing: no page
    # draws here, and twelve such pauses were an eighth of this test.
    monkeypatch.setattr(chat_panel, "SETTLE_S", 0.0)
    demo = app.build_app(engine)  # the Blocks as shipped, handler hygiene included
    rng = random.Random(1234)
    findings, states = Findings(), {}
    blocks = handlers(demo)
    assert any(b.api_name == "chat" for b in blocks)
    for block in blocks:
        # First the defaults a fresh page sends (it also yields realistic session state) ...
        t0 = time.perf_counter()
        run_handler_case(block, [valid_value(c, states) for c in block.inputs], findings, states, rng)
        heavy = time.perf_counter() - t0 > 0.5  # runs many requests (the ordering lab): fewer cases
        text_inputs = [i for i, c in enumerate(block.inputs) if type(c).__name__ in ("Textbox", "TextArea")]
        # ... each 1 MiB text in each text input ...
        for i in text_inputs:
            for big in fz.one_mb_texts():
                args = [valid_value(c, states) for c in block.inputs]
                args[i] = big
                run_handler_case(block, args, findings, states, rng)
        # ... then random mixes: some inputs valid, the rest hostile.
        for _ in range(6 if heavy else calls_for(block)):
            args = [fuzz_value(c, rng, states) if rng.random() < 0.6 else valid_value(c, states)
                    for c in block.inputs]
            run_handler_case(block, args, findings, states, rng)
    wait_idle(engine)
    assert_clean(engine)
    assert not findings.items, f"{len(findings.items)} problems in {findings.cases} cases:\n" + \
        "\n".join(findings.items[:30])
    assert findings.cases >= 800, findings.cases
    print(f"UI fuzz: {findings.cases} cases over {len(blocks)} handlers")


# ------------------------------------------------------------------ public API
def _api_value(component: str, rng: random.Random, choices: list) -> Any:
    """What a hand-written client could send as JSON for this parameter."""
    if component in ("Textbox", "TextArea", "Code"):
        return rng.choice([fz.text(rng), fz.text(rng), ""])
    if component in ("Slider", "Number"):
        return fz.json_number(rng)
    if component == "Checkbox":
        return rng.choice([True, False])
    if component in ("Dropdown", "Radio"):
        return rng.choice(choices) if choices else None
    if component == "Chatbot":  # the messages format a browser sends: content as a list of parts
        return rng.choice([[], [], [{"role": "user", "content": [{"type": "text", "text": fz.text(rng)}]},
                                    {"role": "assistant", "content": [{"type": "text", "text": fz.text(rng)}]}]])
    if component == "Dataframe":
        rows = fz.few_shot_rows(rng)
        ok = isinstance(rows, list) and all(isinstance(r, list) and all(isinstance(c, str | int | float | None)
                                                                       for c in r) for r in rows)
        return {"headers": ["Input", "Output"], "data": rows if ok else [["a", "b"]]}
    return None


def _client_can_send(args: list) -> bool:
    """gradio_client writes strict UTF-8 JSON: no lone surrogates, no NaN or infinity."""
    import json

    try:
        json.dumps(args, allow_nan=False, ensure_ascii=False).encode("utf-8")
        return True
    except (ValueError, UnicodeEncodeError):
        return False


def _body_over_cap(args: list) -> bool:
    """Whether a request carrying ``args`` is over the server's body cap, however the client encodes it."""
    from server.request_guard import MAX_BODY_BYTES

    as_utf8 = len(json.dumps(args, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    return max(as_utf8, len(json.dumps(args))) > MAX_BODY_BYTES  # raw_call escapes non-ASCII: 6 bytes a unit


def api_fuzz(url: str, n_per_endpoint: int, seed: int) -> tuple[Findings, int]:
    """Fuzz every public endpoint: gradio_client where it can encode the input, the browser's
    own protocol (raw JSON) where it cannot. Returns the findings and the raw-call count."""
    from gradio_client.exceptions import AppError

    rng = random.Random(seed)
    findings, raw = Findings(), 0
    client = visitor(url)
    api = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    choices_of = endpoint_choices(client)
    for name, info in api.items():
        params = info["parameters"]
        choices = choices_of.get(name, [])
        for k in range(n_per_endpoint):
            args = [_api_value(p.get("component", ""), rng, choices[j] if j < len(choices) else [])
                    for j, p in enumerate(params)]
            if k < len(fz.one_mb_texts()):  # each 1 MiB text once, in the first text parameter
                idx = next((j for j, p in enumerate(params) if p.get("component") == "Textbox"), None)
                if idx is not None:
                    args[idx] = fz.one_mb_texts()[k]
            findings.cases += 1
            where = f"API {name}"
            if not _client_can_send(args):
                raw += 1
                res = raw_call(url, fn_id(client, name), args)
                if not res["success"]:
                    # A deliberate gr.Error (Gradio's own range checks) carries a message; a hidden
                    # exception arrives as an error with none.
                    if not res["error"]:
                        findings.add(where, "the event failed with a hidden exception", args)
                    else:
                        findings.check_shown(where, str(res["error"]), args)
                for s in [*shown_strings(res["output"]), *res["logs"]]:
                    findings.check_shown(where, s, args)
                continue
            job = client.submit(*args, api_name=name)
            try:
                result = job.result(timeout=300)
            except AppError as exc:
                findings.check_shown(where, str(exc), args)
                continue
            except Exception as exc:
                if getattr(getattr(exc, "response", None), "status_code", None) == 413 and _body_over_cap(args):
                    continue  # the server's designed refusal of an oversized body (server/request_guard.py)
                findings.add(where, f"client got {type(exc).__name__}: {exc}", args)
                continue
            for s in shown_strings(result):
                findings.check_shown(where, s, args)
            for message, _level in shown_logs(job):
                findings.check_shown(where, message, args)
    return findings, raw


def endpoint_choices(client) -> dict[str, list[list]]:
    """For each named endpoint, the choices of each API parameter (dropdowns), read off the
    server's config; State inputs are not API parameters."""
    comps = {c["id"]: c for c in client.config["components"]}
    out = {}
    for dep in client.config["dependencies"]:
        if dep.get("api_name"):
            inputs = [comps.get(i, {}) for i in dep.get("inputs", [])]
            out[f"/{dep['api_name']}"] = [_choices(type("C", (), {"choices": c.get("props", {}).get("choices")}))
                                          for c in inputs if c.get("type") != "state"]
    return out


def test_fuzz_public_api(tiny_runner, make_engine):
    engine = make_engine(max_new_tokens_cap=8, budget_bytes=600 * tiny_runner.kv_bytes_per_token)
    with launched_app(engine) as url:
        findings, raw = api_fuzz(url, n_per_endpoint=32, seed=99)
        # The app still serves a plain request afterwards.
        out = visitor(url).predict("Hello!", [], "Pirate", "", 2, False, api_name="/chat")
        assert "prompt tokens served" in out[3]
    wait_idle(engine)
    assert_clean(engine)
    assert not findings.items, f"{len(findings.items)} problems in {findings.cases} cases:\n" + \
        "\n".join(findings.items[:30])
    assert findings.cases >= 180 and raw >= 30, (findings.cases, raw)


@pytest.mark.slow
def test_fuzz_chat_api_on_the_real_model(real_runner, make_engine):
    """A smaller API run on the real model: the nasty texts, with real tokenization and
    decoding, sent the way a browser sends them (raw JSON: lone surrogates included)."""
    engine = make_engine(real_runner, max_new_tokens_cap=4)
    with launched_app(engine) as url:
        chat = fn_id(visitor(url), "chat")
        findings = Findings()
        rng = random.Random(5)
        cases = ([rng.choice(group) for group in (fz.WHITESPACE, fz.CONTROL, fz.ZERO_WIDTH, fz.SPECIAL, fz.MARKUP)
                  for _ in range(2)] + fz.SURROGATES[:3] + fz.EMOJI[:4] + fz.one_mb_texts()
                 + ["x\ud800y\udfffz", "".join(fz.ZERO_WIDTH) * 50, "word " * 9000])
        for i, text in enumerate(cases):
            history = [] if i % 3 else [
                {"role": "user", "content": [{"type": "text", "text": fz.EMOJI[i % len(fz.EMOJI)]}]},
                {"role": "assistant", "content": [{"type": "text", "text": text[:100]}]}]
            args = [text, history, "Pirate" if i % 2 else "Custom…", text[:50], 4, i % 5 == 0]
            res = raw_call(url, chat, args)
            findings.cases += 1
            if str(res["error"]).startswith("HTTP 413") and _body_over_cap(args):
                continue  # the server's designed refusal of an oversized body
            if not res["success"]:
                findings.add("real /chat", f"failed: {res['error']!r}", text)
            for s in [*shown_strings(res["output"]), *res["logs"]]:
                findings.check_shown("real /chat", s, text)
    wait_idle(engine)
    assert_clean(engine)
    assert not findings.items, "\n".join(findings.items[:30])
    assert findings.cases >= 25


# ------------------------------------------------------------------ engine
def test_fuzz_engine(tiny_runner, make_engine):
    engine = make_engine(max_new_tokens_cap=8, budget_bytes=500 * tiny_runner.kv_bytes_per_token)
    rng = random.Random(7)
    emoji_ids = tiny_runner.text.encode("👨‍👩‍👧‍👦🏳️‍🌈")
    problems, outcomes = [], {"ok": 0, "refused": 0, "cancelled": 0}
    n = 700
    for i in range(n):
        form = rng.choice(["prompt", "messages", "prompt_ids"])
        body: dict[str, Any] = {
            "prompt": {"prompt": fz.text(rng) if rng.random() < 0.97 else rng.choice(fz.one_mb_texts())},
            "messages": {"messages": fz.messages(rng)},
            "prompt_ids": {"prompt_ids": fz.prompt_ids(rng, tiny_runner.text.vocab_size, emoji_ids)},
        }[form]
        try:
            sampling = SamplingParams(**fz.sampling_values(rng))
            req = GenerationRequest(**body, sampling=sampling, namespace=rng.choice(["", "v-a", "v-b", "v-a/lab"]),
                                    public_len=rng.choice([0, 3, -5, 10**6]))
            handle = engine.submit(req)
            mode = rng.random()
            events = iter(handle)
            if mode < 0.1:
                next(events, None)
                handle.cancel()
                outcomes["cancelled"] += 1
            elif mode < 0.2:
                next(events, None)
                del events  # abandoned stream
                outcomes["cancelled"] += 1
            else:
                last = list(events)[-1]
                assert last.done and last.metrics.output_tokens <= 8
                outcomes["ok"] += 1
        except EngineError as exc:
            outcomes["refused"] += 1
            if any(marker in str(exc) for marker in INTERNAL) or TRACEBACK.search(str(exc)):
                problems.append(f"case {i} ({form}): {exc}")
        except Exception as exc:
            problems.append(f"case {i} ({form}): {type(exc).__name__}: {exc}  <- {_short(body)}")
        if i % 100 == 99:
            wait_idle(engine)
            engine.check_invariants()
    wait_idle(engine)
    assert_clean(engine)
    assert not problems, "\n".join(problems[:30])
    assert outcomes["ok"] > 100 and outcomes["refused"] > 100 and outcomes["cancelled"] > 30, outcomes
