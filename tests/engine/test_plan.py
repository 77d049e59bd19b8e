"""The execution plan (issue 47, item 1): one reader of the kernel settings, one ordered registry per
decision with a reason for each option set aside, and on the tiny model the plan's choices are what runs."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from engine.kvcache.kv_pool import KVPool
from engine.model import plan
from engine.model.decoder_stack import DecoderStack
from engine.model.native_linear import NativeLinear
from engine.model.packed_linear import PackedLinear
from engine.model.paged_attention import PagedSegment
from engine.model.plan import ALIASES, DECISIONS, ENV, ExecutionPlan, choose, parse, read_settings
from engine.types import EngineError

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


# ------------------------------------------------------------------ the parser


def test_radix_kernels_pins_a_decision_and_sets_options_aside():
    s = parse("linear=packed, attention=cpu_sdpa,fused=off")
    assert s.pinned("linear") == "packed" and s.pinned("attention") == "cpu_sdpa" and s.pinned("layers") is None
    assert s.refusal("layers", "fused") == "RADIX_KERNELS fused=off"
    assert s.refusal("attention", "cpu_native") == "RADIX_KERNELS attention=cpu_sdpa names cpu_sdpa first"
    assert s.refusal("attention", "math_chunked") == "" and s.refusal("layers", "stack") == ""
    assert read_settings({}) == plan.KernelSettings(switches=tuple((n, None) for n, _, _ in ALIASES) + ((ENV, None),))


@pytest.mark.parametrize("env, off, pins", [
    ({"RADIX_EXACT": "0"}, {"exact"}, {}),
    ({"RADIX_EXACT": "off"}, {"exact"}, {}),
    ({"RADIX_EXACT": "1"}, set(), {}),
    ({"RADIX_DECODER_STACK": "0"}, {"stack"}, {}),
    ({"RADIX_DECODER_STACK": "false"}, set(), {}),  # this switch only ever took "0"
    ({"RADIX_FUSED_DECODE": "no"}, {"fused"}, {}),
    ({"RADIX_NATIVE_LINEAR": "0"}, {"native", "fused", "exact"}, {}),  # the fused layers and the head are ours too
    ({"RADIX_PACKED_LINEAR": "0"}, {"packed"}, {}),
    ({"RADIX_PACKED_LINEAR": "1"}, set(), {"linear": "packed"}),
    ({"RADIX_PACKED_LINEAR": "2"}, set(), {}),
    ({"RADIX_NATIVE_ATTENTION": "0"}, {"cpu_native", "exact"}, {}),
    ({"RADIX_ATTENTION_BACKEND": "math_chunked"}, set(), {"attention": "math_chunked"}),
    ({"RADIX_ATTENTION_BACKEND": ""}, set(), {}),
])
def test_the_old_switches_are_aliases(env, off, pins):
    s = read_settings(env)
    assert set(s.off) == off and {d: p for d, (p, _) in s.pins.items()} == pins
    name, value = next(iter(env.items()))
    assert all(why == f"{name}={value}" for why in s.off.values())  # the reason names the switch
    assert (name, value) in s.switches


def test_radix_kernels_comes_after_the_aliases():
    s = read_settings({"RADIX_ATTENTION_BACKEND": "cpu_sdpa", ENV: "attention=math_chunked,exact=off"})
    assert s.pinned("attention") == "math_chunked" and s.refusal("layers", "exact") == "RADIX_KERNELS exact=off"


@pytest.mark.parametrize("text, named", [
    ("linear=blas", "valid: packed, native, torch"),
    ("attention=flash9", "valid: cpu_native, cpu_sdpa, math_chunked"),
    ("layers=fused-all", "valid: exact, fused, stack, transformers, gathered"),
    ("turbo=off", "decisions: layers, linear, attention; options: exact, fused"),
    ("fused=on", "takes only 'off' (or name it as layers=fused)"),
    ("fused", "is not <decision>=<option> or <option>=off"),
])
def test_an_unknown_name_is_a_clear_error_naming_the_valid_ones(text, named):
    with pytest.raises(ValueError, match="RADIX_KERNELS") as err:
        parse(text)
    assert named in str(err.value)
    with pytest.raises(ValueError, match=re.escape(named)):
        read_settings({ENV: text})


def test_an_unknown_backend_under_its_old_switch_is_refused_too():
    with pytest.raises(ValueError, match=r"RADIX_ATTENTION_BACKEND=flash9: unknown attention option 'flash9'"):
        read_settings({"RADIX_ATTENTION_BACKEND": "flash9"})


# ------------------------------------------------------------------ the registry


def test_the_first_option_that_runs_is_chosen_and_each_before_it_says_why_not():
    checks = {"exact": "the exact kernel does not build", "fused": ""}
    chosen, rejected = choose("layers", read_settings({}), lambda n: checks.get(n, ""))
    assert chosen == "fused" and rejected == [("layers", "exact", "the exact kernel does not build")]
    chosen, rejected = choose("layers", parse("layers=stack"), lambda n: "")
    assert chosen == "stack"
    assert rejected == [("layers", "exact", "RADIX_KERNELS layers=stack names stack first"),
                        ("layers", "fused", "RADIX_KERNELS layers=stack names stack first")]
    chosen, _ = choose("layers", parse("layers=stack"), lambda n: "no" if n == "stack" else "")
    assert chosen == "transformers"  # a named driver that does not run leaves the next one


def test_a_named_attention_backend_must_run():
    with pytest.raises(EngineError, match="'cpu_native' named by the settings does not run here"):
        choose("attention", parse("attention=cpu_native"), lambda n: "no kernel")
    backend, rejected = plan.choose_attention(torch.device("cuda"), read_settings({}))
    assert backend.name == "math_chunked" and [n for _, n, _ in rejected] == ["cpu_native", "cpu_sdpa"]
    assert all(why.startswith("does not run on cuda") for _, _, why in rejected)


def test_the_registry_lists_every_backend_and_the_plan_is_frozen():
    from engine.model.attention import BACKENDS

    assert [n for n, _ in DECISIONS["attention"]] == [b.name for b in BACKENDS]
    p = ExecutionPlan("fused", "native", "cpu_sdpa", rejected=(("layers", "exact", "RADIX_EXACT=0"),))
    assert p.summary() == "layers=fused linear=native attention=cpu_sdpa"
    assert p.why_not("exact") == "RADIX_EXACT=0" and p.why_not("fused") is None
    assert "  not exact: RADIX_EXACT=0" in p.lines()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.layers = "stack"  # type: ignore[misc]


def test_only_the_plan_reads_the_kernel_settings():
    names = [ENV] + [name for name, _, _ in ALIASES]
    readers = [f"{p.relative_to(ROOT)}:{i}" for p in (ROOT / "engine").rglob("*.py") if p.name != "plan.py"
               for i, line in enumerate(p.read_text().splitlines(), 1)
               if ("environ" in line or "getenv" in line) and any(n in line for n in names)]
    assert not readers, readers


# ------------------------------------------------------------------ on the tiny model: the plan is what runs


def _calls(monkeypatch, cls, name: str) -> list[int]:
    calls: list[int] = []
    real = getattr(cls, name)

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(cls, name, spy)
    return calls


def test_the_tiny_runners_plan_is_what_runs(tiny_runner, monkeypatch):
    r, p = tiny_runner, tiny_runner.plan
    assert p.attention == r.attention.name
    modules = list(r.model.modules())
    assert (p.linear == "packed") == any(isinstance(m, PackedLinear) for m in modules) == (r.packed_linears > 0)
    assert (p.linear == "native") == any(isinstance(m, NativeLinear) for m in modules) == (r.native_linears > 0)
    assert p.layers in ("exact", "fused", "stack")  # a Llama on a CPU: the stack at least
    assert (p.layers == "exact") == r.runs_exact
    assert (p.layers in ("exact", "fused")) == (r.stack.fused is not None)
    assert p.fused_max_rows == (r.stack.fused.max_rows if r.stack.fused is not None else 0)
    for _, option, why in p.rejected:
        assert why, option
    # one decode row after a prefill: the driver the plan names runs it, and no other
    drivers = {"exact": (DecoderStack, "forward_exact"), "fused": (DecoderStack, "_fused"),
               "stack": (DecoderStack, "_layers")}
    spies = {name: _calls(monkeypatch, *where) for name, where in drivers.items()}
    kv = KVPool(r.num_layers, r.num_kv_heads, r.head_dim, r.dtype, r.device, 16 * r.kv_bytes_per_token)
    slots = kv.alloc(9)
    r.forward_paged(kv, [PagedSegment(list(range(3, 11)), 0, slots)])
    for spy in spies.values():
        spy.clear()
    r.forward_paged(kv, [PagedSegment([11], 8, slots)])
    assert {name for name, spy in spies.items() if spy} == {p.layers}


def test_a_named_driver_and_linear_kernel_are_what_runs(tokenizer, monkeypatch):
    from tests.conftest import make_tiny_runner

    monkeypatch.setenv(ENV, "layers=stack,linear=torch")
    r = make_tiny_runner(tokenizer)
    try:
        p = r.plan
        assert p.summary().startswith("layers=stack linear=torch attention=")
        assert r.stack is not None and r.stack.fused is None and not r.runs_exact
        assert not any(isinstance(m, NativeLinear | PackedLinear) for m in r.model.modules())
        assert p.why_not("exact") == p.why_not("fused") == "RADIX_KERNELS layers=stack names stack first"
        assert p.why_not("native") == "RADIX_KERNELS linear=torch names torch first"
        assert "RADIX_KERNELS" in r.forward_kind and dict(p.switches)[ENV] == "layers=stack,linear=torch"
    finally:
        r.close()


def test_zerogpu_settings_are_passed_not_written_to_the_environment(monkeypatch):
    """app.build_engine hands the runner its kernel settings (``plan.for_gpu_calls`` on ZeroGPU): PyTorch's
    linears and none of our CPU layers, said by that reason; the environment is left as it was."""
    import os

    from engine.model import plan

    before = dict(os.environ)
    s = plan.for_gpu_calls(plan.read_settings({"RADIX_KERNELS": "attention=cpu_sdpa"}))
    assert dict(os.environ) == before
    for option in ("packed", "native", "fused", "exact"):
        assert "ZeroGPU" in s.off[option]
    assert s.pinned("attention") == "cpu_sdpa" and dict(s.switches)["RADIX_KERNELS"] == "attention=cpu_sdpa"
    source = open(os.path.join(os.path.dirname(__file__), "..", "..", "app.py")).read()
    assert "os.environ[" not in source  # nothing steers the engine by writing variables
