"""One registry of settings (``engine.settings.SETTINGS``), one checked engine config
(``engine.config.EngineConfig``): a flag and its env var give the same config, a bad value is
one line and exit code 2, ``--help`` and ``docs/CONFIG.md`` list every row, every ``RADIX_*``
name the code reads is a row, and ``Engine(runner, config)`` is ``Engine(runner, **fields)``."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import ConfigError, EngineConfig
from engine.settings import SETTINGS, AppConfig, build_parser, markdown_table, parse_args

ROOT = Path(__file__).resolve().parents[2]

# A value unlike the default for every setting with a flag and an env var (a new setting needs one here).
SAMPLES = {
    "model": "some/model", "device": "cpu", "dtype": "float32", "cache_budget_mb": "64", "disk_cache_mb": "0",
    "max_prompt_tokens": "100", "max_new_tokens": "7", "max_queue": "5", "max_batch": "2", "chunk_tokens": "32",
    "kv_events_config": '{"publisher": "zmq", "topic": "t"}', "eviction_policy": "lfu", "host": "0.0.0.0",
    "port": "8080", "api_key": "k1,k2", "operator_key": "op", "max_per_client": "2", "backend": "http://r",
    "backend_model": "m", "backend_kv_events": "off", "fleet": "http://a,http://b", "routing_lab": "lab.json",
}
SWITCHES = {"cache", "isolate", "public_metrics", "replica", "growth_curve"}
NEEDS = {"fleet": {"backend": "http://r"}, "routing_lab": {"backend": "http://r", "fleet": "http://a"}}

# What the tools read for themselves (their own command lines', not the app's): left out of the registry.
TOOLS_OWN = {"RADIX_VLLM_VENV", "RADIX_ROUTER_VENV", "RADIX_ROUTER_LOG_LEVEL"}


def _row(name: str):
    return next(s for s in SETTINGS if s.name == name)


def test_the_registry_is_well_formed():
    names = [s.name for s in SETTINGS if s.name]
    envs = [s.env for s in SETTINGS if s.env] + [a for s in SETTINGS for a in s.aliases]
    flags = [s.flag for s in SETTINGS if s.flag]
    assert len(set(names)) == len(names) and len(set(envs)) == len(envs) and len(set(flags)) == len(flags)
    assert all(s.flag or s.env for s in SETTINGS) and all(s.help for s in SETTINGS)
    assert all(s.read_by and (ROOT / s.read_by).exists() for s in SETTINGS), "read_by names a file"
    fields = {f.name for f in dataclasses.fields(AppConfig)} - {"engine"}
    assert fields == set(names), "one AppConfig field per named setting"
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    filled = {s.field for s in SETTINGS if s.field}
    assert filled <= engine_fields and engine_fields - filled == {"history_size", "tier_dir"}, filled


def test_the_dataclass_defaults_are_the_registry_defaults():
    assert parse_args([], environ={}) == AppConfig()
    assert parse_args([], environ={}).engine == AppConfig().engine == EngineConfig(tier_bytes=2048 * 2**20)


@pytest.mark.parametrize("name", sorted(SAMPLES) + sorted(SWITCHES))
def test_a_flag_and_its_env_var_give_the_same_config(name):
    row = _row(name)
    assert row.flag and row.env
    base_argv = [a for dep, text in NEEDS.get(name, {}).items() for a in (_row(dep).flag, text)]
    base_env = {_row(dep).env: text for dep, text in NEEDS.get(name, {}).items()}
    if name in SWITCHES:
        default = _row(name).parse(row.default or "0")
        flag, text = (f"--no-{row.flag[2:]}", "0") if default else (row.flag, "1")
    else:
        flag, text = row.flag, SAMPLES[name]
    by_flag = parse_args([*base_argv, flag] + ([] if name in SWITCHES else [text]), environ={})
    by_env = parse_args(base_argv, environ={**base_env, row.env: text})
    assert by_flag == by_env and by_flag.engine == by_env.engine
    assert getattr(by_flag, name) != getattr(parse_args(base_argv, environ={}), name), "the sample is not the default"
    assert parse_args([*base_argv, flag] + ([] if name in SWITCHES else [text]), environ={row.env: "junk!"}) == by_flag


def test_a_flag_asking_for_the_default_still_beats_the_env_var():
    assert parse_args(["--chunk-tokens", "0"], environ={"RADIX_CHUNK_TOKENS": "64"}).chunk_tokens is None
    assert parse_args(["--disk-cache-mb", "0"], environ={"RADIX_DISK_CACHE_MB": "64"}).engine.tier_bytes == 0
    assert parse_args(["--no-isolate"], environ={"SYSTEM": "spaces", "RADIX_ISOLATE": "1"}).isolate is False


def test_every_named_setting_has_a_sample():
    both = {s.name for s in SETTINGS if s.name and s.flag and s.env}
    assert both == set(SAMPLES) | SWITCHES


def test_flags_reach_the_engine_config():
    config = parse_args(["--cache-budget-mb", "0.5", "--disk-cache-mb", "0", "--no-cache", "--isolate",
                         "--max-batch", "3", "--chunk-tokens", "0", "--eviction-policy", "LFU"], environ={}).engine
    assert config == EngineConfig(budget_bytes=2**19, enable_cache=False, isolation=True, max_prompt_tokens=4096,
                                  max_new_tokens_cap=256, max_batch=3, eviction_policy="lfu")


@pytest.mark.parametrize("argv, env, said", [
    (["--max-batch", "0"], {}, "argument --max-batch: must be at least 1, got 0"),
    (["--max-queue", "x"], {}, "argument --max-queue: expected a whole number, got 'x'"),
    ([], {"RADIX_MAX_BATCH": "0"}, "argument --max-batch (from RADIX_MAX_BATCH): must be at least 1, got 0"),
    ([], {"RADIX_MAX_NEW_TOKENS": "lots"}, "RADIX_MAX_NEW_TOKENS='lots' (for --max-new-tokens): expected a whole"),
    ([], {"RADIX_ISOLATE": "maybe"}, "RADIX_ISOLATE='maybe' (for --isolate): expected 1 or 0"),
    (["--cache-budget-mb", "inf"], {}, "argument --cache-budget-mb: must be finite"),
    (["--eviction-policy", "mru"], {}, "argument --eviction-policy: unknown eviction policy 'mru'"),
    (["--kv-events-config", "[1]"], {}, "argument --kv-events-config: must be a JSON object"),
    (["--kv-events-config", "{"], {}, "argument --kv-events-config: not JSON"),
    (["--port", "70000"], {}, "argument --port: must be between 0 and 65535"),
    (["--fleet", "http://a"], {}, "--fleet needs --backend"),
    ([], {"RADIX_ATTENTION_WORKSPACE_MB": "lots"}, "RADIX_ATTENTION_WORKSPACE_MB='lots': expected a number"),
])
def test_a_bad_value_is_one_line_and_exit_code_2(argv, env, said, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, environ=env)
    assert exc.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and said in errors[0], errors


def test_the_app_stops_in_one_line_with_no_traceback():
    env = {**os.environ, "RADIX_MAX_QUEUE": "-4"}
    run = subprocess.run([sys.executable, "app.py", "--max-batch", "2"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert "error: argument --max-queue (from RADIX_MAX_QUEUE): must be at least 1, got -4" in run.stderr


def test_help_lists_every_setting():
    text = build_parser().format_help()
    for s in SETTINGS:
        for name in filter(None, (s.flag, s.env, *s.aliases)):
            assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), f"--help does not name {name}"


def _radix_names_in(path: Path) -> set[str]:
    return set(re.findall(r"\bRADIX_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))


def _c_names() -> set[str]:
    """The C side's constants and status codes (``RADIX_OK``, ``RADIX_MAX_ROWS``): not variables."""
    sources = [p for ext in ("*.c", "*.h") for p in (ROOT / "engine").rglob(ext)]
    abi = ROOT / "engine" / "model" / "native_abi.py"
    return set().union(*(_radix_names_in(p) for p in sources + ([abi] if abi.exists() else [])))


def test_every_radix_variable_in_the_code_is_a_setting():
    """What the app, its packages and the tools read is declared, or named as a tool's own."""
    files = [ROOT / "app.py"] + [p for top in ("engine", "server", "components", "analysis", "tools")
                                 for p in (ROOT / top).rglob("*.py")]
    found = {name: path for path in files for name in _radix_names_in(path)}
    declared = {s.env for s in SETTINGS if s.env} | {a for s in SETTINGS for a in s.aliases}
    known = declared | TOOLS_OWN | _c_names()
    missing = {name: str(path.relative_to(ROOT)) for name, path in found.items() if name not in known}
    assert not missing, f"RADIX_* variables read but not in engine.settings.SETTINGS: {missing}"
    assert "RADIX_KERNELS" in found and "RADIX_ISA" in found  # the scan sees the deep reads


def test_docs_config_lists_the_registry():
    text = (ROOT / "docs" / "CONFIG.md").read_text()
    start, end = "<!-- generated from engine/settings.py: python -m engine.settings -->\n", "<!-- end of the generated"
    assert start in text and end in text
    table = text.split(start, 1)[1].split(end, 1)[0]
    assert table == markdown_table(), "docs/CONFIG.md is stale: paste the output of python -m engine.settings"


@pytest.mark.parametrize("changes, said", [
    (dict(max_batch=0), "max_batch: must be at least 1, got 0"),
    (dict(chunk_tokens=-3), "chunk_tokens: must be at least 1"),
    (dict(budget_bytes=0.5), "budget_bytes: must be at least 1, got 0"),
    (dict(budget_bytes=float("nan")), "budget_bytes: must be a whole number, got nan"),
    (dict(max_batch=2.5), "max_batch: must be a whole number, got 2.5"),
    (dict(max_queue="8"), "max_queue: must be a whole number, got '8'"),
    (dict(isolation=1), "isolation: must be True or False"),
    (dict(tier_bytes=-1), "tier_bytes: must be at least 0"),
    (dict(tier_dir=""), "tier_dir: must be a folder's path or None"),
    (dict(kv_events_config="nope"), "kv_events_config: not JSON"),
    (dict(eviction_policy="mru"), "eviction_policy: unknown eviction policy 'mru': choose one of lfu, lru"),
])
def test_engine_config_rules(changes, said):
    with pytest.raises(ConfigError) as exc:
        EngineConfig(**changes)
    assert str(exc.value).startswith(said) and "\n" not in str(exc.value)
    with pytest.raises(ConfigError):
        EngineConfig().replace(**changes)  # a copy is checked again


def test_engine_config_normalises():
    config = EngineConfig(budget_bytes=2**20 + 0.7, max_batch=4.0, eviction_policy=" LFU ")
    assert config.budget_bytes == 2**20 and type(config.budget_bytes) is int and config.eviction_policy == "lfu"
    assert config.max_batch == 4 and type(config.max_batch) is int
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_batch = 2  # type: ignore[misc]


def test_engine_takes_a_config_or_its_fields_alike(tiny_runner):
    from engine.engine import Engine

    fields = dict(budget_bytes=300 * tiny_runner.kv_bytes_per_token, isolation=True, max_queue=6, max_batch=3,
                  chunk_tokens=16, max_prompt_tokens=10**9, max_new_tokens_cap=9, eviction_policy="lfu")
    by_config = Engine(tiny_runner, EngineConfig(**fields))  # by hand: the constructor is the subject
    by_fields = Engine(tiny_runner, **fields)  # by hand: the constructor is the subject
    try:
        for engine in (by_config, by_fields):
            assert engine.config == EngineConfig(**fields)
            assert (engine.isolation, engine.max_queue, engine.max_new_tokens_cap) == (True, 6, 9)
            assert engine.max_prompt_tokens == tiny_runner.max_context  # never over the model's context
            assert (engine.scheduler.config.max_batch, engine.scheduler.config.chunk_tokens) == (3, 16)
            assert engine.cache.budget_bytes == by_config.cache.budget_bytes and engine.eviction_policy.name == "lfu"
    finally:
        by_config.close()
        by_fields.close()
    with pytest.raises(TypeError, match="max_batches"):
        Engine(tiny_runner, max_batches=2)  # by hand: the constructor's refusal
    with pytest.raises(TypeError, match="not both"):
        Engine(tiny_runner, EngineConfig(), max_batch=2)  # by hand: the constructor's refusal
    with pytest.raises(ConfigError, match="max_batch: must be at least 1"):
        Engine(tiny_runner, max_batch=0)  # by hand: the constructor's refusal
