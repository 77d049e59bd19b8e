"""Settings for a public page, checked on the launched app: only the intended endpoints are
public, no file is served or accepted, no run history or monitoring page, no prompt data
written to disk, and text a browser can send but UTF-8 cannot encode never breaks a reply."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from components.demo import launch_kwargs
from components.panels.hardening import clean, sanitized
from tests.helpers_app import assert_clean, fn_id, launched_app, raw_call, visitor, wait_idle

ROOT = Path(__file__).resolve().parents[2]

# Every endpoint a client may call by name. Adding one is a decision: add it here too.
PUBLIC_ENDPOINTS = {"/chat", "/fewshot", "/fewshot_batch", "/tree_snapshot", "/ordering_lab", "/ordering_schedule"}
FILE_COMPONENTS = {"file", "files", "image", "audio", "video", "gallery", "model3d", "uploadbutton", "imageeditor",
                   "multimodaltextbox", "dataset", "simpleimage", "annotatedimage", "downloadbutton"}


@pytest.fixture(scope="module")
def app_url(make_module_engine):
    engine = make_module_engine(max_new_tokens_cap=4)
    with launched_app(engine) as url:
        yield url, engine
    wait_idle(engine)
    assert_clean(engine)


def test_launch_settings_for_a_public_page():
    kw = launch_kwargs()
    assert kw["show_error"] is False  # errors reach visitors as messages, never as exception text
    assert kw["run_history"] is False and kw["enable_monitoring"] is False
    assert kw["state_session_capacity"] <= 1_000 and kw["app_kwargs"]["middleware"]  # bounded state, RequestGuard
    assert "allowed_paths" not in kw and "GRADIO_ALLOWED_PATHS" not in os.environ


def test_api_lists_only_the_intended_endpoints(app_url):
    url, _ = app_url
    client = visitor(url)
    api = client.view_api(print_info=False, return_format="dict")
    assert set(api["named_endpoints"]) == PUBLIC_ENDPOINTS
    assert not api["unnamed_endpoints"]
    info = httpx.get(f"{url}gradio_api/info", params={"all_endpoints": "true"}).json()
    assert set(info["named_endpoints"]) == PUBLIC_ENDPOINTS  # nothing "undocumented" either
    for dep in client.config["dependencies"]:
        if f"/{dep.get('api_name')}" not in PUBLIC_ENDPOINTS:
            assert dep.get("api_visibility") == "private", dep.get("api_name")


def test_no_file_components_no_file_serving_no_uploads(app_url, tmp_path):
    url, _ = app_url
    client = visitor(url)
    types = {c.get("type") for c in client.config["components"]}
    assert not types & FILE_COMPONENTS, types & FILE_COMPONENTS
    for path in ["/etc/passwd", str(ROOT / "app.py"), "../../../../etc/passwd", str(Path.home() / ".bashrc")]:
        for route in ("gradio_api/file=", "file="):
            r = httpx.get(f"{url}{route}{path}")
            assert r.status_code in (403, 404), (route, path, r.status_code)
            assert "root:" not in r.text and "import" not in r.text
    upload = httpx.post(f"{url}gradio_api/upload", files={"files": ("x.txt", b"secret prompt " * 200)})
    assert upload.status_code in (404, 413), upload.status_code  # the app takes no files
    assert httpx.get(f"{url}gradio_api/runs").status_code == 404  # no run history page
    assert httpx.get(f"{url}monitoring").status_code in (403, 404)


def test_no_prompt_data_written_to_disk(app_url):
    url, engine = app_url
    marker = f"zebra-{time.time_ns()}-quokka"
    started = time.time() - 1
    client = visitor(url)
    client.predict(f"My secret is {marker}", [], "Pirate", "", 2, False, api_name="/chat")
    client.predict(f"{marker}", {"headers": ["Input", "Output"], "data": [["a", "b"]]}, f"{marker}?", False, 2, False,
                   api_name="/fewshot")
    wait_idle(engine)
    import gradio.utils

    places = [ROOT, Path(gradio.utils.get_upload_folder()), Path.cwd(), Path.home() / ".cache" / "radix-playground"]
    hits = []
    for place in places:
        if not place.exists():
            continue
        for path in place.rglob("*"):
            try:
                if path.is_file() and path.stat().st_mtime >= started and marker.encode() in path.read_bytes():
                    hits.append(path)
            except OSError:
                continue
    assert hits == []


def test_text_utf8_cannot_encode_never_breaks_a_reply(app_url):
    """JSON can carry lone surrogates and a browser can send them; echoed unchanged they would
    make Gradio's serializer fail and drop the visitor's stream (components/panels/hardening.py)."""
    url, engine = app_url
    client = visitor(url)
    history = [{"role": "user", "content": [{"type": "text", "text": "x\udfff"}]},
               {"role": "assistant", "content": [{"type": "text", "text": "y"}]}]
    res = raw_call(url, fn_id(client, "chat"), ["a\ud800b", history, "Custom…", "sys\udbff", float("nan"), False])
    assert res["success"], res
    assert res["output"][0][-2]["content"][0]["text"] == "a\ufffdb"
    wait_idle(engine)


def test_clean_and_sanitized():
    keep = [{"role": "user", "content": "fine"}]
    assert clean(keep) is keep  # nothing to replace: the very same object
    assert clean(["a\ud800", ("b", {"k\udfff": "v"})]) == ["a\ufffd", ("b", {"k\ufffd": "v"})]

    def gen(text, request=None):
        yield text

    wrapped = sanitized(gen)
    import inspect

    assert inspect.isgeneratorfunction(wrapped) and list(inspect.signature(wrapped).parameters) == ["text", "request"]
    assert list(wrapped("\ud800")) == ["\ufffd"] and sanitized(wrapped) is wrapped
