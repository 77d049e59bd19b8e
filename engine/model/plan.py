"""What runs a forward, chosen once: the execution plan (issue 47, item 1).

Owns: the one reader of the kernel settings (``RADIX_KERNELS`` and the older per-kernel switches,
its aliases), the ordered registry of options for each decision with each option's "runs here?"
check, and ``ExecutionPlan``, the frozen record of what ``ModelRunner`` chose at start and why each
option before the chosen one was set aside. The runner, the decoder stack and the linears act on
the plan; nothing else in the engine reads these settings. Knows nothing of requests or the cache.

Three decisions, each an ordered list of options; the first that runs here is chosen::

    layers     exact         every row, whatever its batch, through the fused C layers (the family's recipe),
                             our attention in blocks fixed by position and our head: a row's bits its own
               fused         the decoder stack, steps of up to ``fused_max_rows`` rows in two fused C calls
                             a layer (all layers in one where no two rows share a prefix)
               stack         the decoder stack on PyTorch's ops (``engine.model.decoder_stack``)
               transformers  transformers' forward with the pool-reading attention registered in it
               gathered      one request per forward, its KV gathered into a buffer (sliding windows)
    linear     packed        oneDNN, weights packed once (bfloat16 by default; float32 only when named)
               native        our C kernel (``engine.model.native_linear``)
               torch         PyTorch's default
    attention  ``engine.model.attention.BACKENDS`` in their order (cpu_native, cpu_sdpa, math_chunked)

For a Llama-shaped decoder each layer driver builds on the one below it (exact on fused, fused on
stack, stack on transformers), so its check asks about that one first; the exact forward of any
other family of ``engine.model.families`` is checked against transformers' own forward instead, and
a family outside that registry is not exact, with the reason. The checks are
``engine.model.layer_checks``. ``ExecutionPlan.driver_for``
is the one rule that applies the plan to a step: a ``fused`` step of more rows than its cap runs the
stack unfused.

``RADIX_KERNELS``: items separated by commas, each ``<decision>=<option>`` (that option is tried
first: the ones before it are set aside) or ``<option>=off`` (that option is set aside). A named
attention backend must run here (an error otherwise); a named layer driver or linear kernel that
does not run leaves the next one that does, and the plan says why. An unknown name is a
``ValueError`` that lists the valid ones. Example::

    RADIX_KERNELS=linear=packed,attention=cpu_sdpa,fused=off

The older switches still work, as aliases of these items (``ALIASES``); where both speak,
``RADIX_KERNELS`` comes last and a pin there wins.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from engine.model import native_linear, packed_linear
from engine.model.attention import BACKENDS, AttentionBackend, native
from engine.types import EngineError

ENV = "RADIX_KERNELS"
OFF = "off"
_FALSE = ("0", "false", "no", "off")  # what the older on/off switches took as "off"

# Every decision's options, in order of preference: (name, what it runs, in words).
LAYERS = (("exact", "every row through the fused C layers and attention in fixed blocks: bits independent "
                    "of the batch"),
          ("fused", "the decoder stack, a few rows in two fused C calls a layer"),
          ("stack", "the decoder stack on PyTorch's ops"),
          ("transformers", "transformers' forward, attention over the pool"),
          ("gathered", "one request per forward, its KV gathered into a buffer"))
LINEAR = (("packed", "oneDNN, weights packed once"),
          ("native", "our C kernel"),
          ("torch", "PyTorch's default"))
_BACKEND_WORDS = {"cpu_native": "our C kernel for decode rows, PyTorch's flash kernel for the rest",
                  "cpu_sdpa": "PyTorch's flash kernel", "math_chunked": "plain PyTorch ops in chunks, any device"}
ATTENTION = tuple((b.name, _BACKEND_WORDS.get(b.name, b.__name__)) for b in BACKENDS)
DECISIONS: dict[str, tuple[tuple[str, str], ...]] = {"layers": LAYERS, "linear": LINEAR, "attention": ATTENTION}
STRICT = ("attention",)  # decisions whose named option must run here (as RADIX_ATTENTION_BACKEND always did)


def _off_if(items: str, is_off: Callable[[str], bool] = lambda v: v.strip().lower() in _FALSE):
    return lambda value: items if is_off(value) else ""


# The older switches: (name, what it does, value -> RADIX_KERNELS items).
ALIASES: tuple[tuple[str, str, Callable[[str], str]], ...] = (
    ("RADIX_EXACT", "0: the fast paths, whose bits depend on the batch (issue 44)", _off_if("exact=off")),
    ("RADIX_DECODER_STACK", "0: transformers' own forward", _off_if("stack=off", lambda v: v.strip() == "0")),
    ("RADIX_FUSED_DECODE", "0: PyTorch's ops around attention", _off_if("fused=off")),
    ("RADIX_NATIVE_LINEAR", "0: PyTorch's linears (and no fused layers)", _off_if("native=off,fused=off,exact=off")),
    ("RADIX_PACKED_LINEAR", "0: PyTorch's linears, unpacked; 1: float32 packed too",
     lambda v: {"0": "packed=off", "1": "linear=packed"}.get(v.strip(), "")),
    ("RADIX_NATIVE_ATTENTION", "0: PyTorch's flash kernel (and no exact forward)", _off_if("cpu_native=off,exact=off")),
    ("RADIX_ATTENTION_BACKEND", "cpu_native, cpu_sdpa or math_chunked", lambda v: f"attention={v}" if v else ""),
)


@dataclass(frozen=True)
class KernelSettings:
    """What the settings ask for: ``pins`` (decision -> the option tried first, and the setting that
    said so), ``off`` (option -> the setting that set it aside), ``switches`` (each setting read and
    its value, None when unset: what ``explain`` prints)."""

    pins: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    off: Mapping[str, str] = field(default_factory=dict)
    switches: tuple[tuple[str, str | None], ...] = ()

    def refusal(self, decision: str, option: str) -> str:
        """Why the settings set ``option`` aside ("" where they do not)."""
        if option in self.off:
            return self.off[option]
        pin = self.pins.get(decision)
        if pin is not None:
            names = [name for name, _ in DECISIONS[decision]]
            if names.index(option) < names.index(pin[0]):
                return f"{pin[1]} names {pin[0]} first"
        return ""

    def pinned(self, decision: str) -> str | None:
        pin = self.pins.get(decision)
        return pin[0] if pin else None


def _option_names() -> dict[str, str]:
    return {name: decision for decision, options in DECISIONS.items() for name, _ in options}


def parse(text: str, source: str = ENV, into: KernelSettings | None = None) -> KernelSettings:
    """``text`` (``RADIX_KERNELS``'s syntax, module docstring) over ``into``; ``source`` names the
    setting in the reasons. Raises ``ValueError`` naming the valid decisions, options or values."""
    pins, off = dict(into.pins) if into else {}, dict(into.off) if into else {}
    options = _option_names()
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq or not value:
            raise ValueError(f"{source}: {item!r} is not <decision>=<option> or <option>=off")
        if key in DECISIONS:
            valid = [name for name, _ in DECISIONS[key]]
            if value not in valid:
                raise ValueError(f"{source}: unknown {key} option {value!r}; valid: {', '.join(valid)}")
            pins[key] = (value, source if source != ENV else f"{ENV} {key}={value}")
        elif key in options:
            if value != OFF:
                raise ValueError(f"{source}: {key}={value!r}: an option takes only 'off' "
                                 f"(or name it as {options[key]}={key})")
            off[key] = source if source != ENV else f"{ENV} {key}=off"
        else:
            raise ValueError(f"{source}: unknown name {key!r}; decisions: {', '.join(DECISIONS)}; "
                             f"options: {', '.join(options)}")
    return KernelSettings(pins, off, into.switches if into else ())


def read_settings(environ: Mapping[str, str] | None = None) -> KernelSettings:
    """The kernel settings of ``environ`` (the process's environment by default): the aliases
    first, then ``RADIX_KERNELS``. The one place that reads them."""
    env = os.environ if environ is None else environ
    settings = KernelSettings()
    switches = []
    for name, _, items in ALIASES:
        value = env.get(name)
        switches.append((name, value))
        if value is not None and items(value):
            settings = parse(items(value), f"{name}={value.strip()}", settings)
    value = env.get(ENV)
    switches.append((ENV, value))
    if value:
        settings = parse(value, ENV, settings)
    return KernelSettings(settings.pins, settings.off, tuple(switches))


def for_gpu_calls(settings: KernelSettings) -> KernelSettings:
    """``settings`` for a model kept on the CPU and moved to a GPU for each call (ZeroGPU): PyTorch's
    linears, unpacked, and none of our CPU layers (what the runner there gets is the model as loaded)."""
    return parse("packed=off,native=off,fused=off,exact=off", "the model moves to a GPU per call (ZeroGPU)",
                 settings)


@dataclass(frozen=True)
class ExecutionPlan:
    """What runs a forward, chosen once at start (module docstring): the option of each decision,
    the options set aside before it with why (``rejected``: (decision, option, why)), the row caps
    the chosen kernels keep (0: none), and the settings read."""

    layers: str
    linear: str
    attention: str
    rejected: tuple[tuple[str, str, str], ...] = ()
    fused_max_rows: int = 0  # a step of more rows runs the stack's layers unfused
    linear_max_rows: int = 0  # our float32 linears: more rows go to PyTorch's product (0: any, or not ours)
    switches: tuple[tuple[str, str | None], ...] = ()

    def driver_for(self, rows: int) -> str:
        """The layer driver that runs a step of ``rows`` tokens: the chosen one, but ``stack`` for a
        ``fused`` step of more than ``fused_max_rows`` rows (a prefill chunk). The one rule by rows."""
        return "stack" if self.layers == "fused" and rows > self.fused_max_rows else self.layers

    def why_not(self, option: str) -> str | None:
        """Why ``option`` was set aside; None where it was chosen or not tried."""
        return next((why for _, name, why in self.rejected if name == option), None)

    def summary(self) -> str:
        """One line: ``layers=exact linear=native attention=cpu_native``."""
        return f"layers={self.layers} linear={self.linear} attention={self.attention}"

    def lines(self) -> list[str]:
        """Each decision's choice, then each option set aside before it with the reason, then the
        row caps."""
        out = []
        for decision, options in DECISIONS.items():
            chosen = getattr(self, decision)
            out.append(f"{decision}: {chosen} ({dict(options)[chosen]})")
            out += [f"  not {name}: {why}" for d, name, why in self.rejected if d == decision]
        if self.fused_max_rows and self.layers == "fused":
            out.append(f"fused layers: steps of up to {self.fused_max_rows} rows (more run unfused)")
        if self.linear_max_rows:
            out.append(f"our linears: up to {self.linear_max_rows} float32 rows (more go to PyTorch's product)")
        return out


def choose(decision: str, settings: KernelSettings, runs: Callable[[str], str]) -> tuple[str, list[tuple[str, str, str]]]:
    """The first option of ``decision`` that the settings leave and ``runs(option)`` (its check:
    "" where it runs here, else why not) accepts, and the ones set aside before it. A named option
    of a ``STRICT`` decision that does not run raises ``EngineError``."""
    rejected = []
    for name, _ in DECISIONS[decision]:
        why = settings.refusal(decision, name) or runs(name)
        if not why:
            return name, rejected
        if decision in STRICT and settings.pinned(decision) == name:
            raise EngineError(f"the {decision} option {name!r} named by the settings does not run here: {why}")
        rejected.append((decision, name, why))
    raise EngineError(f"no {decision} option runs here: " + "; ".join(f"{n}: {w}" for _, n, w in rejected))


# ------------------------------------------------------------------ the checks that need no runner
def packed_dtypes(settings: KernelSettings) -> tuple[torch.dtype, ...]:
    """The weight dtypes packing takes under ``settings``: float32 too where they name packed."""
    return (torch.float32, torch.bfloat16) if settings.pinned("linear") == "packed" else packed_linear.DEFAULT_DTYPES


def linear_check(model: torch.nn.Module, settings: KernelSettings) -> Callable[[str], str]:
    """The linear kernels' "runs here?" checks on ``model``."""
    checks = {"packed": lambda: packed_linear.refusal(model, packed_dtypes(settings)),
              "native": lambda: native_linear.refusal(model), "torch": lambda: ""}
    return lambda name: checks[name]()


def choose_attention(device: torch.device, settings: KernelSettings) -> tuple[AttentionBackend, list[tuple[str, str, str]]]:
    """The attention backend for ``device`` under ``settings``, and the ones set aside before it."""
    by_name = {b.name: b for b in BACKENDS}

    def runs(name: str) -> str:
        if by_name[name].runs_on(device):
            return ""
        built = native.why() if name == "cpu_native" and device.type == "cpu" else ""
        return f"does not run on {device.type}" + (f": {built}" if built else "")

    name, rejected = choose("attention", settings, runs)
    return by_name[name](), rejected
