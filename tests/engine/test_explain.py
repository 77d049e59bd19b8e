"""``python app.py --explain-kernels`` (issue 47, item 1): what runs a forward, in one place."""

from __future__ import annotations

from engine.model.explain import explain
from engine.model.plan import ALIASES, ENV


def test_it_names_the_plan_the_forward_the_linears_the_attention_and_every_switch(tiny_runner):
    lines = explain(tiny_runner)
    text = "\n".join(lines)
    assert lines[0].startswith("model: tiny-random-llama on cpu (float32)")
    assert lines[1] == "family: Llama: norms pre, silu"
    assert lines[2] == f"plan: {tiny_runner.plan.summary()}"
    assert f"  layers: {tiny_runner.plan.layers} (" in text and f"  linear: {tiny_runner.plan.linear} (" in text
    for _, option, why in tiny_runner.plan.rejected:  # every option set aside, with its reason
        assert f"    not {option}: {why}" in text
    assert ("forward: exact" in text) == tiny_runner.runs_exact
    assert "linears: " in text and "attention: " in text and "our C kernels built for: " in text
    for name in (ENV, *(name for name, _, _ in ALIASES)):
        assert f"switch {name}=" in text
    said = dict(tiny_runner.plan.switches)  # the values read when the plan was built, not now
    assert f"switch RADIX_EXACT={said['RADIX_EXACT'] or '(unset)'} " in text


def test_the_flag_loads_prints_and_exits_without_a_port(monkeypatch, capsys, tokenizer):
    import app
    from tests.conftest import make_tiny_runner

    own = make_tiny_runner(tokenizer)  # a tiny model of its own stands in for the embedded one
    own.close()
    monkeypatch.setattr("engine.model.loader.load_model", lambda *a, **k: own.loaded)
    monkeypatch.setattr(app, "port_problem", lambda *a: "taken")  # never asked: no page is served
    assert app.main(["--explain-kernels", "--port", "1"]) == 0
    out = capsys.readouterr().out
    assert "plan: layers=" in out and "forward: " in out and "switch RADIX_KERNELS=" in out
