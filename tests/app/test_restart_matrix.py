"""The second run (issue #27): ``python app.py`` as a user runs it, stopped with SIGTERM, then started
again on the folder the first run left, with other flags, another process beside it, a full disk
and altered files. Each second run starts, answers exactly as a run with no cache does, and,
under isolation, shows nothing of the first run's chats.

Real processes on the embedded model (fp32, where reuse is exact), real files, real signals. One
first run feeds every case: its cache folder is copied for each, so the cases do not depend on
each other's order. The no-cache answers come from the app served in this test process (the
session's model, no cache), so no process starts only to be the reference."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers_app import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SECRET = "my locker code is 7319 WALRUS"
DOCUMENT = " ".join(f"Section {i}: the warehouse in district {i} ships parcels on weekday {i % 5} and "
                    f"keeps {i * 7} spare pallets for returns." for i in range(16))  # ~480 tokens
QUESTIONS = [
    ([{"role": "system", "content": DOCUMENT}, {"role": "user", "content": "Which district keeps 70 pallets?"}]),
    ([{"role": "user", "content": f"Remember this: {SECRET}. Say OK."}]),
]
OPERATOR_KEY = "restart-matrix-operator"  # /metrics of an isolated run answers the operator only
# Every run after run 1 leaves the growth curve to the Growth tab: measured in the background at each
# start it took both cores for as long as the run lived (about half of this file's time), and nothing
# here reads it. Run 1 keeps the defaults, the curve included.
SECOND_RUN = {"RADIX_GROWTH_CURVE": "0"}
START_LIMIT_S = 600  # a usual start is 15-40 s on a quiet machine (model load, warm start); a hang or a crash is not


def post_chat(url: str, model: str, messages: list[dict], max_tokens: int = 12) -> tuple[str, dict]:
    """A greedy chat completion from the app at ``url``: (its text, its usage)."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "messages": messages}
    r = httpx.post(url.rstrip("/") + "/v1/chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    data = r.json()
    return data["choices"][0]["message"]["content"], data["usage"]


class App:
    """One ``python app.py`` process on a free port, its output in a file."""

    def __init__(self, root: Path, *flags: str, env: dict | None = None, name: str = "app", preexec=None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / f"{name}-{self.port}.log"
        full_env = {**os.environ, "RADIX_PLAYGROUND_CACHE": str(root), "RADIX_DISK_CACHE_MB": "2048",
                    "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1",
                    "RADIX_OPERATOR_KEY": OPERATOR_KEY, **SECOND_RUN, **(env or {})}
        self.started = time.monotonic()
        self._out = open(self.log, "w")
        self.proc = subprocess.Popen([sys.executable, "app.py", "--port", str(self.port), *flags], cwd=REPO,
                                     env=full_env, stdout=self._out, stderr=subprocess.STDOUT,
                                     preexec_fn=preexec)
        self.ready_s = self._wait_ready()

    def _wait_ready(self) -> float:
        deadline = self.started + START_LIMIT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the app exited ({self.proc.returncode}) before serving:\n{self.output()}")
            try:
                r = httpx.get(self.url + "/v1/models", timeout=5)
                if r.status_code == 200:
                    self.model = r.json()["data"][0]["id"]
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.proc.kill()
        raise AssertionError(f"the app did not serve within {START_LIMIT_S} s:\n{self.output()}")

    def output(self) -> str:
        if not self._out.closed:
            self._out.flush()
        return self.log.read_text(errors="replace")

    def chat(self, messages: list[dict], max_tokens: int = 12) -> tuple[str, dict]:
        return post_chat(self.url, self.model, messages, max_tokens)

    def metrics(self) -> dict[str, float]:
        out = {}
        r = httpx.get(self.url + "/metrics", headers={"Authorization": f"Bearer {OPERATOR_KEY}"}, timeout=30)
        assert r.status_code == 200, r.text
        for line in r.text.splitlines():
            if line.startswith("radix_") and " " in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def snapshot_text(self) -> str:
        """Every text the tree tab's API shows to a fresh visitor (as JSON text)."""
        from gradio_client import Client

        client = Client(self.url, verbose=False, download_files=False)
        return json.dumps(client.predict(api_name="/tree_snapshot"))

    def stop(self) -> str:
        """SIGTERM, as a container's stop sends; the app writes its tier and exits cleanly."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"the app did not stop on SIGTERM:\n{self.output()}") from None
        self._out.close()
        return self.log.read_text(errors="replace")


def answers(app: App) -> list[str]:
    return [app.chat(q)[0] for q in QUESTIONS]


def no_cache_answers(make_engine, runner, questions: list[list[dict]] = QUESTIONS) -> list[str]:
    """What a run with no cache answers: the app served in this process on ``runner``, on an engine
    from ``make_engine`` (the same Blocks, the same /v1 route and the same model files as
    ``python app.py --no-cache``, without a second process loading the model again)."""
    from tests.helpers_app import launched_app

    engine = make_engine(runner, enable_cache=False, isolation=False, max_new_tokens_cap=64)
    with launched_app(engine) as url:
        model = httpx.get(url + "v1/models", timeout=30).json()["data"][0]["id"]
        return [post_chat(url, model, messages)[0] for messages in questions]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, real_runner, make_module_engine):
    """Run 1 with the defaults; returns (its cache folder, the no-cache answers)."""
    from engine.model.loader import converted_cache_dir

    converted = converted_cache_dir()  # the session's model load made it
    root = tmp_path_factory.mktemp("run1")
    (root / converted.name).symlink_to(converted)
    app = App(root, "--no-isolate", name="run1", env={"RADIX_GROWTH_CURVE": "1"})
    got = answers(app)
    out = app.stop()
    assert "Traceback" not in out, out
    assert "Cache written to the second tier" in out, out
    tier = root / "kv-tier"
    assert any(tier.rglob("*.kv")), "run 1 wrote no chunk"
    reference = no_cache_answers(make_module_engine, real_runner)
    assert got == reference, "run 1 itself differs from a run with no cache"
    return root, reference


def second_root(first_run, tmp_path: Path) -> Path:
    """A copy of run 1's cache folder (the converted model linked, the tier copied)."""
    root, _ = first_run
    new = tmp_path / "root"
    new.mkdir()
    for entry in root.iterdir():
        if entry.is_symlink():
            (new / entry.name).symlink_to(os.readlink(entry))
        elif entry.is_dir():
            shutil.copytree(entry, new / entry.name)
    return new


def tier_folders(root: Path) -> list[Path]:
    return sorted(p for p in (root / "kv-tier").iterdir() if p.is_dir())


def check_second_run(app: App, reference: list[str]) -> None:
    assert app.ready_s < START_LIMIT_S
    assert "Growth curve: not measured at start" in app.output()  # SECOND_RUN: no background curve
    assert answers(app) == reference, "the second run answers differently from a run with no cache"
    out = app.stop()
    assert "Traceback" not in out, out


def test_smaller_budget_with_isolation_starts_and_answers(first_run, tmp_path):
    """The issue's own case: ``RADIX_ISOLATE=1 RADIX_CACHE_BUDGET_MB=64 python app.py`` after a default
    run. Isolated, it shows nothing of run 1's chats, loads nothing of run 1's shared tier, and
    keeps a tier folder of its own (the shared run's is gone: this configuration cannot read it)."""
    root = second_root(first_run, tmp_path)
    app = App(root, env={"RADIX_ISOLATE": "1", "RADIX_CACHE_BUDGET_MB": "64"}, name="small-isolated")
    text = app.snapshot_text()
    assert SECRET.split()[-1] not in text and "pallets" not in text, "an isolated run shows run 1's chats"
    assert app.metrics().get("radix_tier_loaded_tokens_total", 0) == 0
    check_second_run(app, first_run[1])
    (folder,) = tier_folders(root)
    assert folder.name.endswith("-isolated")


def test_smaller_budget_reloads_from_the_tier_and_stays_exact(first_run, tmp_path):
    root = second_root(first_run, tmp_path)
    app = App(root, "--no-isolate", "--cache-budget-mb", "96", name="small")
    _, usage = app.chat(QUESTIONS[0])
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 384, usage  # the document came back from disk
    assert app.metrics()["radix_tier_loaded_tokens_total"] > 0
    check_second_run(app, first_run[1])


def test_another_dtype_never_reads_the_first_runs_chunks(first_run, tmp_path):
    root = second_root(first_run, tmp_path)
    app = App(root, "--no-isolate", "--dtype", "bfloat16", name="bf16")
    app.chat(QUESTIONS[0])
    assert app.metrics().get("radix_tier_loaded_tokens_total", 0) == 0
    out = app.stop()
    assert "Traceback" not in out, out
    assert [f.name for f in tier_folders(root)] != [f.name for f in tier_folders(first_run[0])]


def test_a_second_process_on_the_same_folder_runs_without_the_tier(first_run, tmp_path):
    root = second_root(first_run, tmp_path)
    owner = App(root, "--no-isolate", name="owner")
    try:
        other = App(root, "--no-isolate", name="other")
        assert "second tier" in other.output() and "in use" in other.output(), other.output()
        assert other.metrics().get("radix_tier_budget_bytes") in (None, 0.0)
        check_second_run(other, first_run[1])
    finally:
        check_second_run(owner, first_run[1])
    assert not list(root.rglob("*.tmp*")), "temporary files left behind"


def test_a_full_disk_costs_the_tier_not_the_answers(first_run, tmp_path):
    """Every file write over 64 KiB fails (RLIMIT_FSIZE: EFBIG, as a full disk fails a write)."""
    import resource

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    root = second_root(first_run, tmp_path)
    for chunk in root.rglob("*.kv"):  # nothing to read back: everything must be written, and fails
        chunk.unlink()
    app = App(root, "--no-isolate", "--cache-budget-mb", "48", preexec=small_files, name="fulldisk")
    check_second_run(app, first_run[1])
    assert not list(root.rglob("*.tmp*")), "a failed write left a temporary file"
    assert app.output().count("could not write") <= 2, "one warning per chunk instead of one"


def test_altered_files_cost_a_recompute_not_a_crash(first_run, tmp_path):
    root = second_root(first_run, tmp_path)
    (folder,) = tier_folders(root)
    chunks = sorted(folder.glob("*.kv"))
    assert len(chunks) >= 8
    header = struct.Struct("<6s40s16sIIIIQI")
    for i, path in enumerate(chunks):
        data = bytearray(path.read_bytes())
        kind = i % 5
        if kind == 0:  # a flipped payload byte: the checksum catches it
            data[-1] ^= 0xFF
        elif kind == 1:  # truncated
            data = data[: len(data) // 2]
        elif kind == 2:  # a torch attribute that is not a dtype
            fields = list(header.unpack_from(data))
            fields[2] = b"Tensor"
            data[: header.size] = header.pack(*fields)
        elif kind == 3:  # one layer too many, same byte count
            fields = list(header.unpack_from(data))
            fields[3] += 1
            data[: header.size] = header.pack(*fields)
        else:  # fewer tokens than a chunk
            fields = list(header.unpack_from(data))
            fields[5] = 32
            data[: header.size] = header.pack(*fields)
        path.write_bytes(bytes(data))
    (folder / "spilled-paths.json").write_text(
        '{"version": 1, "paths": [{"ids": [18446744073709551615, 5], "namespace": "", "public_len": 2}, '
        '{"ids": "nope"}, 7]}')
    app = App(root, "--no-isolate", name="altered")
    check_second_run(app, first_run[1])


def test_another_checkpoint_at_the_same_path_never_reads_the_old_kv(tmp_path, tokenizer, make_engine):
    """Retrained weights saved over the same folder: the tier is named by the weights, so the new
    model computes everything itself (a tiny random Llama, saved as any HF checkpoint is)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = tmp_path / "checkpoint"

    def save(seed: int) -> None:  # the tests' tiny Llama (tests/conftest.py), as files
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                          tie_word_embeddings=True)
        LlamaForCausalLM(cfg).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)

    root = tmp_path / "root"
    root.mkdir()
    save(0)
    first = App(root, "--model", str(model_dir), "--no-isolate", name="ckpt-a")
    answers(first)
    assert "Traceback" not in first.stop()
    before = tier_folders(root)
    save(1)  # the same path, other weights
    from engine.model.loader import load_model
    from engine.model.runner import ModelRunner

    reference = no_cache_answers(make_engine, ModelRunner(load_model(str(model_dir))))  # the new weights, no cache
    second = App(root, "--model", str(model_dir), "--no-isolate", name="ckpt-b")
    assert second.metrics().get("radix_tier_loaded_tokens_total", 0) == 0
    check_second_run(second, reference)
    assert len(tier_folders(root)) == 1 and tier_folders(root) != before
