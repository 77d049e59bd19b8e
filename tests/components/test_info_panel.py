"""The UI says which dtype runs: the Engine info tab and the one-line engine note beside the chat."""

from __future__ import annotations

import dataclasses

import gradio as gr

from components.panels.info_panel import engine_line, info_markdown
from components.panels.overview_panel import build_overview_panel


def test_the_dtype_is_named_with_what_it_means(tiny_runner_bf16, make_engine):
    fast, exact = make_engine(tiny_runner_bf16), make_engine()
    assert "in **bfloat16**" in engine_line(fast) and "KV 256 B per token" in engine_line(fast)
    assert "in **float32**" in engine_line(exact) and "KV 512 B per token" in engine_line(exact)
    assert "| dtype | **bfloat16** (half precision" in info_markdown(fast)
    assert "| dtype | **float32** (full precision" in info_markdown(exact)


def test_the_engine_line_sits_beside_the_chat(tiny_runner_bf16, make_engine):
    engine = make_engine(tiny_runner_bf16)
    with gr.Blocks():
        build_overview_panel(engine, gr.State(None))
        blocks = gr.context.Context.root_block.blocks.values()
    line = next(b for b in blocks if getattr(b, "elem_id", None) == "engine-line")
    assert line.value == engine_line(engine) and "tiny-random-llama" in line.value and "bfloat16" in line.value


def test_the_linear_kernels_and_the_forward_are_named(tiny_runner, tiny_runner_bf16, make_engine):
    """bf16 where the CPU has native bf16 multiplies through oneDNN-packed weights (and ours in its fused
    decode steps), fp32 through our kernel for decode steps where it builds (PyTorch's otherwise), bf16
    without native bf16 through ours at any number of rows; both run the decoder stack (a Llama), fused where
    our kernel builds; the info tab says which."""
    packed = "oneDNN, weights packed once (RADIX_KERNELS=packed=off"
    for runner in (r for r in (tiny_runner, tiny_runner_bf16) if r.runs_exact):  # where our kernels build
        text = info_markdown(make_engine(runner))
        assert "| forward | exact: every row, whatever its batch" in text and "bit for bit" in text
        assert "| linear layers | ours at any number of rows, in the fused layers and the head" in text
    saved = tiny_runner.plan, tiny_runner_bf16.plan
    for runner in (tiny_runner, tiny_runner_bf16):  # the fast paths (RADIX_KERNELS=exact=off)
        if runner.plan.layers == "exact":
            runner.plan = dataclasses.replace(runner.plan, layers="fused")
    try:
        fast_paths_are_named(make_engine, tiny_runner, tiny_runner_bf16, packed)
    finally:
        tiny_runner.plan, tiny_runner_bf16.plan = saved


def fast_paths_are_named(make_engine, tiny_runner, tiny_runner_bf16, packed: str) -> None:
    fp32 = info_markdown(make_engine())
    assert tiny_runner.packed_linears == 0
    assert "| linear layers | " + ("ours up to 128 rows (decode steps, short prefill chunks)" if tiny_runner.native_linears
                                   else "PyTorch's default |") in fp32
    assert "| forward | decoder stack: the model's layers called directly" in fp32
    assert ("two fused C calls a layer" in fp32) == (tiny_runner.stack.fused is not None)
    bf16 = info_markdown(make_engine(tiny_runner_bf16))
    fused = tiny_runner_bf16.stack.fused
    assert ("two fused C calls a layer" in bf16) == (fused is not None)
    if tiny_runner_bf16.packed_linears:
        assert "| linear layers | " + ("ours in the fused decode steps (up to 8 rows), " if fused else "") + packed \
            in bf16
    else:
        assert "| linear layers | " + ("ours at any number of rows" if tiny_runner_bf16.native_linears
                                       else "PyTorch's default |") in bf16


def test_the_kernels_instruction_set_is_named(tiny_runner, make_engine):
    """The ISA our C kernels were built for (RADIX_ISA, issue 48) shows where they run."""
    text = info_markdown(make_engine())
    ours = tiny_runner.native_linears or tiny_runner.attention.name == "cpu_native"
    assert ("| kernels' instruction set | native (-march=native" in text) == bool(ours)


def test_the_execution_plan_is_named(tiny_runner, make_engine):
    assert f"| execution plan | `{tiny_runner.plan.summary()}`" in info_markdown(make_engine())


def test_the_attention_kernel_is_named(tiny_runner, make_engine):
    line = next(x for x in info_markdown(make_engine()).splitlines() if x.startswith("| attention |"))
    assert tiny_runner.attention.describe() in line
    assert "cpu_native" in line or "cpu_sdpa" in line  # ours where it builds, PyTorch's flash kernel otherwise
