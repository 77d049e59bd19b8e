"""What runs a forward, in words: the runner's execution plan and the settings behind it (issue 47, item 1).

Owns: ``explain(runner)``, the lines ``python app.py --explain-kernels`` prints: the model, device
and dtype; its family's recipe (``engine.model.families``) or why it has none; the plan (``engine.model.plan``: each decision's choice and why each option before it
was set aside); the forward, the linears and the attention as the engine info says them; the
instruction set our C kernels were built for; and each setting the plan read, with its value.
Also the runner's facts in words that the engine info shows (``forward_kind``, ``linear_kernels``,
``kernel_isa``, ``family``). Knows nothing of requests or the cache: it reads the plan, chosen once
at start, and changes nothing.
"""

from __future__ import annotations

from engine.model import families, native_build
from engine.model.plan import ALIASES, ENV


def explain(runner) -> list[str]:
    """The runner's forward, one fact a line (see the module docstring)."""
    plan = runner.plan
    lines = [f"model: {runner.name} on {runner.device} ({str(runner.dtype).removeprefix('torch.')})",
             f"family: {runner.family}",
             f"plan: {plan.summary()}", *(f"  {line}" for line in plan.lines()),
             f"forward: {runner.forward_kind}",
             f"linears: {runner.linear_kernels}",
             f"attention: {runner.attention.describe()}" + (" (the fast paths' only)" if runner.runs_exact else ""),
             f"our C kernels built for: {runner.kernel_isa or 'none of them runs'}"]
    said = dict(plan.switches)
    for name, what in ((ENV, "<decision>=<option> or <option>=off, comma-separated (engine.model.plan)"),
                       *((name, f"alias: {what}") for name, what, _ in ALIASES)):
        value = said.get(name)
        lines.append(f"switch {name}={value if value is not None else '(unset)'}  [{what}]")
    return lines


def family(runner) -> str:
    """The model's family recipe in words (``engine.model.families``), or why it has none."""
    recipe = families.recipe_of(runner.model)
    return recipe.describe() if recipe is not None else families.refusal(runner.model)


def forward_kind(runner) -> str:
    """What runs the scheduler's forward, in words (for the engine info)."""
    plan, stack = runner.plan, runner.stack
    if plan.layers == "exact":
        return (f"exact: every row, whatever its batch, through {stack.parts.recipe.name}'s layers in fused C "
                "calls, our attention in blocks fixed by position and our final norm and head, so a row's logits "
                "do not depend on its batch, its chunk or the cache, bit for bit (RADIX_KERNELS=exact=off for the "
                "faster paths)")
    why = plan.why_not("exact")
    not_exact = f" (not exact: {why})" if why else ""
    if plan.layers == "fused":
        return ("decoder stack: the model's layers called directly, decode steps of up to "
                f"{plan.fused_max_rows} rows in two fused C calls a layer, all layers in one C call when "
                "no two rows share a prefix (RADIX_KERNELS=fused=off for PyTorch's ops, stack=off for transformers' "
                "forward)" + not_exact)
    if plan.layers == "stack":
        return ("decoder stack: the model's layers called directly (RADIX_KERNELS=stack=off for transformers' "
                "forward)" + not_exact)
    return "transformers' forward" + ("" if runner.can_batch else ", one request per forward") + not_exact


def linear_kernels(runner) -> str:
    """How the linear layers multiply, in words (for the engine info)."""
    plan = runner.plan
    if plan.layers == "exact":
        return "ours at any number of rows, in the fused layers and the head (the exact forward)"
    if runner.packed_linears:
        ours = f"ours in the fused decode steps (up to {plan.fused_max_rows} rows), " if plan.layers == "fused" else ""
        return f"{ours}oneDNN, weights packed once (RADIX_KERNELS=packed=off for PyTorch's default)"
    if runner.native_linears and plan.linear_max_rows:
        return (f"ours up to {plan.linear_max_rows} rows (decode steps, short prefill chunks), MKL's for "
                "longer chunks (RADIX_KERNELS=native=off for PyTorch's alone)")
    if runner.native_linears:
        return "ours at any number of rows (RADIX_KERNELS=native=off for PyTorch's alone)"
    return "PyTorch's default"


def kernel_isa(runner) -> str:
    """The instruction set our C kernels are built for, in words (``RADIX_ISA``); "" where none runs."""
    ours = runner.native_linears or runner.plan.layers in ("exact", "fused") or runner.attention.name == "cpu_native"
    return native_build.describe_isa() if ours else ""
