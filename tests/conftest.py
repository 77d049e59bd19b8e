"""Shared fixtures: a tiny random Llama for fast engine logic, the real model for slow tests."""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RADIX_DISK_CACHE_MB", "0")  # no second tier unless a test asks: runs must not share disk state

import pytest
import torch

from engine.model.loader import LoadedModel, load_model, load_tokenizer
from engine.model.runner import ModelRunner
from tests.engines import EngineFactory


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer()


def make_tiny_runner(tokenizer, seed: int = 0, dtype: torch.dtype = torch.float32) -> ModelRunner:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval().to(dtype)  # the same weights in any dtype, rounded
    return ModelRunner(LoadedModel(model=model, tokenizer=tokenizer, name="tiny-random-llama",
                                   device=torch.device("cpu"), dtype=dtype))


def fast_paths(runner: ModelRunner, monkeypatch) -> None:
    """The fast paths for this test (as ``RADIX_KERNELS=exact=off`` would have chosen): a runner whose
    plan chose the exact forward gets the fused driver below it; the stack and its layers are there."""
    if runner.plan.layers == "exact":
        monkeypatch.setattr(runner, "plan", dataclasses.replace(runner.plan, layers="fused"))


@pytest.fixture(scope="session")
def tiny_runner(tokenizer) -> ModelRunner:
    return make_tiny_runner(tokenizer)


@pytest.fixture(autouse=True)
def _shared_runners_stay_running(request):
    """A test that stops a session's shared runner (``runner.close()``, an app's exit through
    ``Engine.shutdown``) fails here, by name, instead of every later test on it failing."""
    yield
    for name in ("tiny_runner", "tiny_runner_bf16", "real_runner"):
        if name in request.fixturenames and request.getfixturevalue(name).compute.stopped:
            pytest.fail(f"{request.node.nodeid} stopped the session's shared {name}: give it a runner of its own")


@pytest.fixture(scope="session")
def tiny_runner_bf16(tokenizer) -> ModelRunner:
    """The same tiny model cast to bfloat16 (the CPU fast mode, ``--dtype bfloat16``)."""
    return make_tiny_runner(tokenizer, dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def real_runner() -> ModelRunner:
    return ModelRunner(load_model())


def _engine_factory(request):
    factory = EngineFactory(lambda: request.getfixturevalue("tiny_runner"))
    yield factory
    factory.close_all()


@pytest.fixture
def make_engine(request):
    """``make_engine(runner=None, config=None, **settings) -> Engine``: an engine on ``runner`` (the
    tiny random Llama when None), closed when the test ends, passed or failed."""
    yield from _engine_factory(request)


@pytest.fixture(scope="module")
def make_module_engine(request):
    """``make_engine`` for a module's fixtures: its engines are closed when the module's tests end."""
    yield from _engine_factory(request)


@pytest.fixture(scope="session")
def chromium_executable() -> str:
    """Debian's Chromium for browser tests. Skips when missing, unless CI demands it
    (RADIX_REQUIRE_BROWSER=1, set by .ci/run, which installs it)."""
    import shutil

    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path:
        return path
    if os.environ.get("RADIX_REQUIRE_BROWSER") == "1":
        pytest.fail("Chromium is required (apt-get install chromium)")
    pytest.skip("Chromium not installed (apt-get install chromium)")


@pytest.fixture(scope="session")
def native_template(tmp_path_factory):
    """Our two C kernels (attention, linear) built once per session into a folder of their own, or
    None where they do not build. Tests about what a kernel computes start from a copy of it
    (``seed_native``); the tests about the build itself (a fresh folder, a damaged file, another
    CPU, threads racing to build) still build."""
    from engine.model import native_build, native_linear
    from engine.model.attention import native

    folder = tmp_path_factory.mktemp("native-template")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(native_build.ENV_DIR, str(folder))
        native.reset()
        native_linear.reset()
        built = native.kernel() is not None and native_linear.kernel() is not None
        native.reset()
        native_linear.reset()
    return folder if built else None


def seed_native(template, folder) -> None:
    """``folder`` made as a copy of the session's built kernels (mode 0o700, as a build makes it)."""
    import shutil

    if template is None:
        return
    folder.mkdir(parents=True, mode=0o700, exist_ok=True)
    for lib in template.glob("*.so"):
        shutil.copy2(lib, folder / lib.name)
