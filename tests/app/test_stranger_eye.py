"""A stranger's eye over the whole app: every event a visitor can call and every HTTP route the
app mounts, read by visitor B while visitor A (another address) uses the page and the API.

The app runs as a Space runs it (``SYSTEM=spaces``, isolation, visitors told apart by
``X-Forwarded-For``) on the tiny random Llama. The events come from the Blocks' own config (every
``fn_index``, the ones hidden from the API included), the routes from the app the server runs
(Gradio's own routes under ``/gradio_api`` included), so a tab or a route added tomorrow is read
the day it is added; one this test does not know how to read (an output component of a new kind,
a route missing from ``ROUTES``) fails it.

The oracle is differential: the same world is played twice, A's requests differing only in what
is A's own (the length and text of A's chat question, few-shot query and API prompts, with and
without ``cache_salt``, and one salted prompt more in one world: more of A's nodes and requests,
all within one 256-token bucket) while A also runs a lab. B calls every
event and reads every route before and after. Every value B reads after A must be the same in both
worlds once B's own timings (milliseconds, clocks, rates of B's own requests) and random ids are
masked: a value that moved with A's private content is an exact figure of someone else's. The
test prints how many events and routes it read, and how many of B's values changed when A came
(each of those is B's own, shipped, or coarse: it did not depend on what A asked)."""

from __future__ import annotations

import json
import os
import re
import time

import httpx

from components.chat_presets import DEFAULT_SYSTEM
from engine.engine import Engine
from tests.helpers_app import free_port, wait_idle

A_ADDR, B_ADDR = "203.0.113.10", "198.51.100.77"

# Output component kinds this test reads (their JSON values, normalized below).
KNOWN_KINDS = {"markdown", "plot", "button", "state", "textbox", "highlightedtext", "dataframe", "dropdown", "html",
               "chatbot", "json", "timer", "api", "number", "column", "slider", "checkbox", "radio", "row", "tab",
               "tabs", "accordion", "group", "label", "code"}

# Every route the app mounts, and how a stranger reads it: "get" (status and body), "post:<body>",
# "asset" (a made-up file name: refused or a static file, never anyone's data), "head" (a stream
# that never ends: its status and type), or "events" (how the events above are called: read
# through them).
ROUTES = {
    "/v1/models": "get", "/kv_event_sources": "get", "/metrics": "get", "/health": "get",
    "/v1/chat/completions": "post:chat", "/v1/completions": "post:completion",
    "/v1/chat/completions/render": "post:chat", "/v1/completions/render": "post:completion",
    "/openapi.json": "get", "/login/": "post:empty", "/login": "post:empty", "/logout": "get",
    "/svelte/{path:path}": "asset", "/": "get", "/gradio_api/deep_link": "get", "/config": "get", "/config/": "get",
    "/static/{path:path}": "asset", "/assets/{path:path}": "asset", "/favicon.ico": "get", "/theme.css": "get",
    "/robots.txt": "get", "/pwa_icon/{size}": "asset", "/pwa_icon": "get", "/manifest.json": "get",
    "/monitoring": "get", "/monitoring/summary": "get", "/monitoring/{key}": "asset",
}
GRADIO_API = {  # Gradio's own routes, under /gradio_api
    "/info": "get", "/info/": "get", "/app_id": "get", "/app_id/": "get", "/startup-events": "get", "/user": "get",
    "/user/": "get", "/token": "get", "/token/": "get", "/login_check": "get", "/login_check/": "get",
    "/upload": "post:empty", "/upload_progress": "get", "/reset": "post:empty", "/reset/": "post:empty",
    "/runs": "get", "/runs/": "get", "/run-history/buckets": "get", "/run-history/connect": "get",
    "/run-history/records": "get", "/run-history/records/{endpoint}/{record_id}/assets/{asset_id}": "asset",
    "/file={path_or_url:path}": "asset", "/file/{path:path}": "asset", "/proxy={url_path:path}": "asset",
    "/custom_component/{id}/{environment}/{type}/{file_name}": "asset", "/dev/reload": "head",
    "/process_recording": "post:empty", "/profiling/clear": "post:empty", "/profiling/summary": "get",
    "/profiling/traces": "get", "/vibe-code": "post:empty", "/vibe-code/": "post:empty", "/vibe-edit": "post:empty",
    "/vibe-edit/": "post:empty", "/undo-vibe-edit": "post:empty", "/undo-vibe-edit/": "post:empty",
    "/vibe-starter-queries": "get", "/vibe-starter-queries/": "get", "/{page}": "asset", "/{page}/": "asset",
    "/heartbeat/{session_hash}": "events", "/queue/join": "events", "/queue/data": "events", "/cancel": "events",
    "/call/{api_name}": "events", "/call/{api_name}/": "events", "/call/{api_name}/{event_id}": "events",
    "/call/v2/{api_name}": "events", "/call/v2/{api_name}/": "events", "/run/{api_name}": "events",
    "/run/{api_name}/": "events", "/api/{api_name}": "events", "/api/{api_name}/": "events",
    "/stream/{event_id}": "events", "/stream/{event_id}/close": "events",
    "/stream/{session_hash}/{run}/{component_id}/playlist-file": "events",
    "/stream/{session_hash}/{run}/{component_id}/playlist.m3u8": "events",
    "/stream/{session_hash}/{run}/{component_id}/{segment_id}.{ext}": "events", "/mcp": "asset",
    "/call/v2/{api_name}/{event_id}": "events", "/component_server": "post:empty", "/component_server/": "post:empty",
    "/openapi.json": "get", "/queue/status": "get", "/theme.css": "get",
}
BODIES = {  # greedy: B's own answers are the same in both worlds
    "chat": {"messages": [{"role": "user", "content": "What is a radix tree?"}], "max_tokens": 2, "temperature": 0},
    "completion": {"prompt": "A radix tree is", "max_tokens": 2, "temperature": 0},
    "empty": {},
}

# What is B's own and varies run to run whatever A does, masked before comparing: B's own
# timings and rates, clocks, random request ids and digests. Float values (plot coordinates of
# B's timings, ms) are masked too; integers (token counts, sizes) are compared exactly.
MASKS = [
    (re.compile(r"https?://[^\s\"'<>]+"), "<url>"),  # the port each world was served on
    (re.compile(r"0x[0-9a-f]+"), "<address>"),  # Python's repr of a function in Gradio's config
    (re.compile(r"rgb\(\d+, \d+, \d+\)"), "<recency colour>"),  # the tree's colour: how recently B's node was used
    (re.compile(r"\d{1,2}:\d{2}(:\d{2})?"), "<clock>"),
    (re.compile(r"#?\b\d{13,}\b"), "<id>"),
    (re.compile(r"\b[0-9a-f]{16,}\b"), "<hex>"),
    (re.compile(r"[\d,]+(\.\d+)?\s?(ms|s|min|h)\b( ago)?"), "<time>"),
    (re.compile(r"[\d,]+(\.\d+)?\s?(tok(ens)?/s)"), "<rate>"),
    (re.compile(r"≈?\s?\d+(\.\d+)?×"), "<ratio>"),
    (re.compile(r"\b(faster|slower|about the same speed|same|measurable|noise)\b"), "<speed>"),
    (re.compile(r"\b\d+\.\d+\b"), "<float>"),
]
# A sentence, table cell or line that holds one of B's own timings is B's own timing noise as a
# whole (which request was fastest, how many measured slower): masked as one.
TIMED = re.compile(r"<time>|<ratio>|<speed>|<rate>")
PIECES = re.compile(r"(\n|<br>|\||(?<=[.:;])\s)")
TIMING_COLUMNS = re.compile(r"ms|time|speed|faster|slower", re.I)


def _mask_text(value: str) -> str:
    for pattern, mask in MASKS:
        value = pattern.sub(mask, value)
    if TIMED.search(value):
        value = "".join("<timing>" if TIMED.search(p) else p for p in PIECES.split(value))
        value = TRAILING_TIMING.sub("", value)  # a closing note on B's own timings (present or not)
        if len(value) < 200:  # a title or a label that says which of B's runs was faster
            value = "<timing>"
    return value


TRAILING_TIMING = re.compile(r"(\s*\**<timing>\**)+\s*$")


def norm(value):
    """``value`` with B's own timings and random ids masked (see ``MASKS``)."""
    if isinstance(value, dict):
        if value.get("type") == "plotly" and isinstance(value.get("plot"), str):
            return {"plotly": norm(json.loads(value["plot"]))}
        if "headers" in value and "data" in value:  # a dataframe: its timing columns are B's own
            keep = [i for i, h in enumerate(value["headers"]) if not TIMING_COLUMNS.search(str(h))]
            return {"headers": value["headers"], "data": [[norm(row[i]) for i in keep] for row in value["data"]]}
        return {k: norm(v) for k, v in value.items()
                if k not in ("uirevision", "__type__", "id", "created")}
    if isinstance(value, list):
        items = [norm(v) for v in value]
        if any(v == "<timing>" for v in items) and all(isinstance(v, str) and len(v) < 200 for v in items):
            return "<timing labels>"  # bar labels on B's own timings (which bars carry one is timing too)
        return items
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, float):
        return "<float>"
    if isinstance(value, int):
        return "<id>" if value >= 2**40 else value
    if isinstance(value, str):
        return _mask_text(value)
    return value


def _routes(demo) -> dict[str, tuple[str, str]]:
    """Every route the running app serves: path -> (methods, how this test reads it)."""
    out = {}
    for route in demo.server_app.routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            for r in inner.routes:
                sub = r.path.removeprefix(inner.prefix)
                out[r.path] = (",".join(sorted(getattr(r, "methods", None) or ())), GRADIO_API.get(sub))
        elif getattr(route, "path", None):
            out[route.path] = (",".join(sorted(getattr(route, "methods", None) or ())), ROUTES.get(route.path))
    return out


def _read_route(client: httpx.Client, path: str, how: str):
    filled = re.sub(r"\{[^}]+\}", "stranger-probe", path)
    if how == "head":
        with client.stream("GET", filled, timeout=10) as r:
            return r.status_code, r.headers.get("content-type", "").split(";")[0]
    if how == "get":
        r = client.get(filled)
    elif how == "asset":
        r = client.get(filled)
        return r.status_code, r.headers.get("content-type", "").split(";")[0]
    else:
        r = client.post(filled, json=BODIES[how.split(":", 1)[1]])
    text = r.text
    try:
        body = norm(r.json())
    except ValueError:
        body = norm(text)
    return r.status_code, body


def _call_event(client: httpx.Client, dep: dict, comps: dict, session: str, timeout_s: float = 120.0):
    """Call one event as a visitor's page would (``/gradio_api/queue/join``) with its inputs'
    default values; its final output (or its error message)."""
    data = [None if comps[i]["type"] == "state" else comps[i].get("props", {}).get("value") for i in dep["inputs"]]
    trigger = dep["targets"][0][0] if dep["targets"] else None
    join = client.post("gradio_api/queue/join", json={"data": data, "fn_index": dep["id"], "session_hash": session,
                                                       "event_data": None, "trigger_id": trigger})
    if join.status_code != 200:
        return ("refused", join.status_code, norm(join.text))
    event_id = join.json()["event_id"]
    deadline = time.monotonic() + timeout_s
    last = None
    with client.stream("GET", "gradio_api/queue/data", params={"session_hash": session}, timeout=timeout_s) as s:
        for line in s.iter_lines():
            if not line.startswith("data:"):
                continue
            msg = json.loads(line[5:])
            if msg.get("event_id") != event_id:
                continue
            if msg.get("msg") in ("process_generating", "process_completed") and msg.get("output"):
                last = msg["output"]
            if msg.get("msg") == "process_completed":
                break
            assert time.monotonic() < deadline, f"event {dep['id']} did not complete"
    if last is None:
        return ("no output",)
    if last.get("error") is not None or "data" not in last:
        return ("error", norm(str(last.get("error"))))
    return ("ok", norm(last["data"]))


def _stranger_reads(url: str, demo) -> dict:
    """B's reading of everything: every event by fn_index, every route."""
    cfg = demo.config
    comps = {c["id"]: c for c in cfg["components"]}
    unknown = sorted({comps[o]["type"] for d in cfg["dependencies"] for o in d["outputs"]} - KNOWN_KINDS)
    assert not unknown, f"outputs of a kind this test does not know how to read: {unknown}"
    readings: dict = {}
    headers = {"x-forwarded-for": B_ADDR}
    with httpx.Client(base_url=url, headers=headers, timeout=120, follow_redirects=False) as client:
        session = "strangerb" + os.urandom(4).hex()
        for dep in cfg["dependencies"]:
            readings[f"event {dep['id']} {dep.get('api_name')}"] = _call_event(client, dep, comps, session)
        for path, (methods, how) in sorted(_routes(demo).items()):
            assert how is not None, f"a route this test does not know how to read: {path} ({methods})"
            if how != "events":
                readings[f"route {path}"] = _read_route(client, path, how)
    return readings


def _a_acts(url: str, engine: Engine, variant: int) -> None:
    """A (another address) chats, runs few-shot and a lab run, and uses /v1 with and without a
    cache_salt; ``variant`` changes only A's private text and how many cached prompts A sends (one
    salted prompt more: more nodes, and more requests, that no count B reads may show), within
    one 256-token bucket."""
    from gradio_client import Client

    extra = " and the forests where they hunt at night, please" * variant
    a = Client(url, verbose=False, download_files=False, headers={"x-forwarded-for": A_ADDR})
    a.predict(f"Tell me about owls{extra}.", [], DEFAULT_SYSTEM, "", 4, True, api_name="/chat")
    info = a.view_api(print_info=False, return_format="dict")["named_endpoints"]
    for name in ("/fewshot", "/ordering_lab"):
        params = info[name]["parameters"]
        args = [p["parameter_default"] if p["parameter_has_default"] else None for p in params]
        if name == "/fewshot":
            first_text = next(i for i, p in enumerate(params) if p["python_type"]["type"] == "str")
            args[first_text] = f"owl{extra}"
        a.predict(*args, api_name=name)
    with httpx.Client(base_url=url, headers={"x-forwarded-for": A_ADDR}, timeout=120) as http:
        for salt in (None, f"a-salt-{variant}", *[f"a-salt-more-{i}" for i in range(variant)]):
            body = {"prompt": f"Owls hunt{extra}.", "max_tokens": 3, "ignore_eos": True}
            if salt:
                body["cache_salt"] = salt
            assert http.post("v1/completions", json=body).status_code == 200
    wait_idle(engine)


def _world(variant: int, out_path: str) -> None:
    """One world, played in a process of its own (so every counter starts where the other
    world's did): B reads, A acts, B reads again; the readings go to ``out_path`` as JSON."""
    import app
    from components.demo import launch_kwargs
    from engine.model.loader import load_tokenizer
    from tests.conftest import make_tiny_runner

    os.environ["SYSTEM"] = "spaces"
    engine = Engine(make_tiny_runner(load_tokenizer()), isolation=True, max_new_tokens_cap=4)  # by hand: no fixtures in its subprocess
    demo = app.build_app(engine, 32)
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=free_port(), quiet=True,
                **launch_kwargs(app.app_kwargs(engine)))
    try:
        before = _stranger_reads(demo.local_url, demo)
        wait_idle(engine)
        _a_acts(demo.local_url, engine, variant)
        after = _stranger_reads(demo.local_url, demo)
        wait_idle(engine)
    finally:
        demo.close()
        engine.close()
    with open(out_path, "w") as f:
        json.dump({"before": before, "after": after}, f, default=str)


def _play(tmp_path) -> list[tuple[dict, dict]]:
    """Both worlds at once, each in a process of its own."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, SYSTEM="spaces", HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False",
               RADIX_DISK_CACHE_MB="0")
    outs = [tmp_path / f"world{v}.json" for v in (0, 1)]
    procs = [subprocess.Popen([sys.executable, "-c", f"from tests.app.test_stranger_eye import _world; "
                               f"_world({v}, {str(out)!r})"], cwd=root, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for v, out in enumerate(outs)]
    worlds = []
    for proc, out in zip(procs, outs, strict=True):
        log, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, log[-4000:]
        data = json.loads(out.read_text())
        worlds.append((data["before"], data["after"]))
    return worlds


def test_a_stranger_reads_nothing_of_another_visitor_anywhere(tmp_path, capsys):
    (before, world0), (_, world1) = _play(tmp_path)
    events = sum(k.startswith("event ") for k in world0)
    routes = sum(k.startswith("route ") for k in world0)
    changed = [k for k in world0 if before.get(k) != world0[k]]
    with capsys.disabled():
        print(f"\nstranger's eye: read {events} events and {routes} routes; {len(changed)} of B's values changed "
              "when A came, none with what A asked")
    assert events >= 90 and routes >= 60
    leaks = [k for k in world0 if world0[k] != world1.get(k)]
    detail = "\n".join(f"{k}:\n  ...{a[max(0, i - 150):i + 150]}\n  ...{b[max(0, i - 150):i + 150]}" for k in leaks
                       for a, b in [(str(world0[k]), str(world1.get(k)))]
                       for i in [next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))])
    assert not leaks, f"B's reading moved with A's private content ({len(leaks)}):\n{detail}"
