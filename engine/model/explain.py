"""What runs a forward, in words: the runner's choices and the switches behind them (issue 47, item 1).

Owns: ``explain(runner)``, the lines ``python app.py --explain-kernels`` prints (and the engine info
reads): the model, device and dtype; the forward (exact, or the fast paths and their row rules); the
linears; the attention; the instruction set our C kernels were built for; each ``RADIX_*`` switch
that decides among them with its value; and why a kernel that is off is off. Knows nothing of
requests or the cache: it reads the runner's attributes, chosen once at start, and changes nothing.
"""

from __future__ import annotations

import os

# Every switch that changes what runs a forward, with what it turns off (read where each is used).
SWITCHES = (
    ("RADIX_EXACT", "0: the fast paths, whose bits depend on the batch (issue 44)"),
    ("RADIX_DECODER_STACK", "0: transformers' own forward"),
    ("RADIX_FUSED_DECODE", "0: PyTorch's ops around attention"),
    ("RADIX_NATIVE_LINEAR", "0: PyTorch's linears"),
    ("RADIX_PACKED_LINEAR", "0: PyTorch's linears, unpacked"),
    ("RADIX_NATIVE_ATTENTION", "0: PyTorch's flash kernel"),
    ("RADIX_ATTENTION_BACKEND", "cpu_native, cpu_sdpa or math_chunked"),
    ("RADIX_ISA", "native, avx2 or avx512: what our C kernels are built for"),
)


def explain(runner) -> list[str]:
    """The runner's forward, one fact a line (see the module docstring)."""
    from engine.model import native_linear
    from engine.model.attention import native

    lines = [f"model: {runner.name} on {runner.device} ({str(runner.dtype).removeprefix('torch.')})",
             f"forward: {runner.forward_kind}",
             f"linears: {runner.linear_kernels}",
             f"attention: {runner.attention.describe()}" + (" (the fast paths' only)" if runner.runs_exact else ""),
             f"our C kernels built for: {runner.kernel_isa or 'none of them runs'}"]
    for name, what in SWITCHES:
        value = os.environ.get(name)
        lines.append(f"switch {name}={value if value is not None else '(unset)'}  [{what}]")
    for kernel, why in (("linear kernel", native_linear.why()), ("attention kernel", native.why())):
        if why:
            lines.append(f"{kernel} off: {why}")
    return lines
