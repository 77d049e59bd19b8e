"""What runs a forward, in words: the runner's execution plan and the settings behind it (issue 47, item 1).

Owns: ``explain(runner)``, the lines ``python app.py --explain-kernels`` prints: the model, device
and dtype; its family's recipe (``engine.model.families``) or why it has none; the plan (``engine.model.plan``: each decision's choice and why each option before it
was set aside); the forward, the linears and the attention as the engine info says them; the
instruction set our C kernels were built for; and each setting the plan read, with its value.
Knows nothing of requests or the cache: it reads the plan, chosen once at start, and changes nothing.
"""

from __future__ import annotations

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
