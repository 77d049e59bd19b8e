"""``python app.py --explain-kernels`` (issue 47, item 1): what runs a forward, in one place."""

from __future__ import annotations

from engine.model.explain import SWITCHES, explain


def test_it_names_the_forward_the_linears_the_attention_and_every_switch(tiny_runner, monkeypatch):
    monkeypatch.setenv("RADIX_FUSED_DECODE", "1")
    lines = explain(tiny_runner)
    text = "\n".join(lines)
    assert lines[0].startswith("model: tiny-random-llama on cpu (float32)")
    assert ("forward: exact" in text) == tiny_runner.runs_exact
    assert "linears: " in text and "attention: " in text and "our C kernels built for: " in text
    for name, _ in SWITCHES:
        assert f"switch {name}=" in text
    assert "switch RADIX_FUSED_DECODE=1 " in text and "switch RADIX_EXACT=(unset)" in text


def test_the_flag_loads_prints_and_exits_without_a_port(monkeypatch, capsys, tokenizer):
    import app
    from tests.conftest import make_tiny_runner

    own = make_tiny_runner(tokenizer)  # a tiny model of its own stands in for the embedded one
    own.close()
    monkeypatch.setattr("engine.model.loader.load_model", lambda *a, **k: own.loaded)
    monkeypatch.setattr(app, "port_problem", lambda *a: "taken")  # never asked: no page is served
    assert app.main(["--explain-kernels", "--port", "1"]) == 0
    out = capsys.readouterr().out
    assert "forward: " in out and "switch RADIX_EXACT=" in out
