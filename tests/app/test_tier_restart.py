"""The second tier across a restart, through the app as ``python app.py`` builds it (embedded model):
a prompt answered before the restart gets its prefix back from disk after it, as ``/v1`` usage
reports, with the same answer, and the tree shows it as spilled before; ``--disk-cache-mb 0`` turns
the tier off."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers_app import launched_app

pytestmark = pytest.mark.slow

SYSTEM = ("You are the help desk of a bicycle shop. " * 40).strip()  # a shipped-size system prompt (~400 tokens)


def chat(url: str) -> dict:
    model = httpx.get(url.rstrip("/") + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Do you fix flat tyres?"}]}
    r = httpx.post(url.rstrip("/") + "/v1/chat/completions", json=body, timeout=300)
    r.raise_for_status()
    return r.json()


def test_restart_round_trip_through_the_app(real_runner, tmp_path, monkeypatch):
    import app

    monkeypatch.setenv("RADIX_PLAYGROUND_CACHE", str(tmp_path))
    args = app.parse_args(["--disk-cache-mb", "256", "--no-isolate"])
    first = app.build_engine(args, runner=real_runner)
    with launched_app(first) as url:
        before = chat(url)
    assert first.persist_cache() > 0  # what app.main does when the server stops
    first.close()
    second = app.build_engine(args, runner=real_runner)  # a fresh process would find the same files
    assert second.stats().tier_chunks > 0
    # The tree shows what the tier kept before any request touches it (the paths persist beside the chunks).
    spilled = [n for n in second.snapshot().nodes if n.spilled]
    assert sum(n.num_tokens for n in spilled) >= 300 and second.snapshot().tier_kind == "disk"
    with launched_app(second) as url:
        after = chat(url)
    cached = after["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 64 * (before["usage"]["prompt_tokens"] // 64) - 64 and cached > 300
    assert second.recent(1)[0].tier_tokens == cached
    assert after["choices"][0]["message"]["content"] == before["choices"][0]["message"]["content"]
    off = app.build_engine(app.parse_args(["--disk-cache-mb", "0", "--no-isolate"]), runner=real_runner)
    assert off.tier is None
