"""ZeroGPU mode on the real ``spaces`` package, this CPU as the device (``harness``): one GPU call per
visitor turn, made in that visitor's Gradio request context and charged to that visitor's token, the
same computation as the CPU engine (``torch.equal``), the tree and pool of record in this process.

Needs the Space line (Python 3.12, torch 2.11.0, ``spaces`` 0.51.x: ``requirements.txt``); skipped
where ``spaces`` is absent, except in CI's Space-line run (``RADIX_REQUIRE_SPACES=1``), where a
missing package fails. ``spaces`` must be imported before anything touches CUDA and forks each
call's worker, so the tests run in a fresh interpreter (``test_in_a_fresh_process``)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

FRESH = os.environ.get("RADIX_ZEROGPU_FRESH_PROCESS") == "1"
REQUIRED = os.environ.get("RADIX_REQUIRE_SPACES") == "1"


def _missing() -> str:
    if importlib.util.find_spec("spaces") is None:
        return "the spaces package is not installed (the Space line, Python 3.12: requirements.txt)"
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build: spaces' ZeroGPU mode needs a CUDA build"
    return ""


MISSING = _missing()
if MISSING and REQUIRED:
    raise RuntimeError(f"RADIX_REQUIRE_SPACES=1 but {MISSING}")
pytestmark = pytest.mark.skipif(bool(MISSING), reason=MISSING)
fresh_only = pytest.mark.skipif(not FRESH, reason="run by test_in_a_fresh_process")

if FRESH and not MISSING:
    os.environ["RADIX_PACKED_LINEAR"] = os.environ["RADIX_NATIVE_LINEAR"] = "0"  # as app.build_engine on a Space
    from tests.zerogpu import harness

    API = harness.start()


@pytest.mark.skipif(FRESH, reason="this is the fresh process")
def test_in_a_fresh_process():
    env = {**os.environ, "RADIX_ZEROGPU_FRESH_PROCESS": "1", "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-s", __file__],
                         cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True, timeout=900)
    print(out.stdout[-4000:])
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-3000:]
    assert " passed" in out.stdout.strip().splitlines()[-1], out.stdout[-2000:]


# --------------------------------------------------------------- fixtures
def tiny_runner(tokenizer):
    """The tests' tiny random Llama (``tests/conftest.make_tiny_runner``) with room for the handbook."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.model.loader import LoadedModel
    from engine.model.runner import ModelRunner

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    return ModelRunner(LoadedModel(model=model, tokenizer=tokenizer, name="tiny-random-llama",
                                   device=torch.device("cpu"), dtype=torch.float32))


ARGS = ["--isolate", "--disk-cache-mb", "0"]  # as on a Space: each visitor's own namespace


class LogitsLog:
    """Every logits row each request's tokens were picked from, per request id (log-softmaxed)."""

    def __init__(self, engine) -> None:
        self.rows: dict[int, list] = {}
        post = engine.scheduler.post
        take = post._take_token

        def logged(r, logits):
            self.rows.setdefault(r.request_id, []).append(logits.float().log_softmax(-1).clone())
            return take(r, logits)

        post._take_token = logged

    def of(self, request_id: int):
        import torch

        return torch.stack(self.rows[request_id])


@pytest.fixture(scope="module")
def engines(tokenizer, make_module_engine):
    import app
    from engine.zerogpu.runner import ZeroGPURunner

    args = app.parse_args(ARGS)
    zero = app.build_engine(args, runner=tiny_runner(tokenizer))
    assert isinstance(zero.runner, ZeroGPURunner)
    reference = make_module_engine(tiny_runner(tokenizer), args.engine.replace(tier_dir=None))
    submitted = []
    submit = zero.submit

    def recorded(request):
        submitted.append(request)
        return submit(request)

    zero.submit = recorded
    yield zero, reference, LogitsLog(zero), LogitsLog(reference), submitted
    zero.close()  # app.build_engine's: not the factory's


def answer(result) -> str:
    """The last chat message's text in a ``/chat`` result."""
    content = result[0][-1]["content"]
    return content if isinstance(content, str) else "".join(part.get("text", "") for part in content)


def answered(result) -> bool:
    """The turn ran to its end: the page shows its numbers (a random model's answer may be empty)."""
    return "prompt tokens" in str(result[3])


def replay(reference, request) -> int:
    """``request`` through the CPU engine; its request id."""
    events = list(reference.submit(request))
    return events[-1].metrics.request_id


# ------------------------------------------------------------------ tests
@fresh_only
def test_model_is_placed_on_cuda_at_start(engines):
    import torch

    zero = engines[0]
    assert torch.cuda.is_available()  # spaces' emulation, in this process
    assert next(zero.runner.model.parameters()).device.type == "cuda"
    assert zero.runner.device.type == "cpu"  # the pool of record: host memory
    assert zero.cache.pool.device.type == "cpu"


@fresh_only
def test_a_turn_without_a_visitor_is_one_call_with_no_token_and_the_cpu_engines_logprobs(engines):
    """An API request (no Gradio request): one call, no token, the same logits as the CPU engine."""
    from engine.types import GenerationRequest, SamplingParams

    zero, reference, zlog, rlog, _ = engines
    before = len(API.schedules)
    req = GenerationRequest(prompt_ids=tuple(zero.text.encode("Radix trees share prefixes. Why?")),
                            sampling=SamplingParams(max_new_tokens=12, ignore_eos=True), namespace="api/k1")
    events = list(zero.submit(req))
    m = events[-1].metrics
    assert m.output_tokens == 12
    new = API.schedules[before:]
    assert [s.token for s in new] == [None] and new[0].status == 200
    rid = replay(reference, req)
    import torch

    assert torch.equal(zlog.of(m.request_id), rlog.of(rid))


@fresh_only
def test_two_visitors_through_the_page(engines):
    """The done-when test: two visitors ask a starter question on the page; each schedule carries
    its visitor's token; each answer's logprobs equal the CPU engine's; the second is served from
    the first's KV (cached tokens shown); a visitor's second turn reuses its first turn's KV."""
    import torch

    from components.chat_presets import HANDBOOK_STARTERS, HANDBOOK_SYSTEM
    from tests.helpers_app import launched_app
    from tests.zerogpu.device_api import visitor_token

    zero, reference, zlog, rlog, submitted = engines
    alice, bob = visitor_token("10.0.0.1"), visitor_token("10.0.0.2", user="bob")
    from gradio_client import Client

    with launched_app(zero) as url:
        assert API.startup_reports >= 1  # spaces packed the model at launch and reported
        a = Client(url, headers={"X-IP-Token": alice}, verbose=False, download_files=False)
        b = Client(url, headers={"X-IP-Token": bob}, verbose=False, download_files=False)
        out = []
        for client, question in ((a, HANDBOOK_STARTERS[0]), (b, HANDBOOK_STARTERS[1])):
            before, asked = len(API.schedules), len(submitted)
            result = client.predict(question, [], HANDBOOK_SYSTEM, "", 24, False, api_name="/chat")
            assert len(submitted) == asked + 1
            out.append((result, API.schedules[before:], submitted[-1]))
        follow_before = len(API.schedules)
        follow = a.predict("And for backpacks?", out[0][0][0], HANDBOOK_SYSTEM, "", 16, False, api_name="/chat")
        follow_schedules, follow_req = API.schedules[follow_before:], submitted[-1]
    (ra, sa, qa), (rb, sb, qb) = out
    assert answered(ra) and answered(rb) and answered(follow)
    assert [s.token for s in sa] == [alice], sa  # one call, Alice's token
    assert [s.token for s in sb] == [bob], sb
    assert [s.token for s in follow_schedules] == [alice]
    records = {m.prompt_ids and tuple(m.prompt_ids): m for m in zero.recent()}
    ma, mb, mf = records[tuple(qa.prompt_ids)], records[tuple(qb.prompt_ids)], records[tuple(follow_req.prompt_ids)]
    # Bob is served from the handbook's KV that Alice's turn brought back, and the page says so.
    assert mb.cached_tokens > 2000, mb.cached_tokens
    labels = [str(piece.get("class_or_confidence", "")).lower() for piece in rb[2]]  # the coloured prompt
    assert "cache" in labels[0], labels[:3]
    assert f"{mb.cached_tokens:,} of {mb.prompt_tokens:,} prompt tokens served from the cache" in rb[3], rb[3]
    # Alice's second turn is served from her first turn's KV (its prompt; a random model's reply does not
    # come back as the same tokens once the page re-encodes the history).
    assert mf.cached_tokens >= ma.prompt_tokens, (mf.cached_tokens, ma.prompt_tokens)
    assert ma.prefill_chunks > 1  # the first turn's prompt went through in several chunks, all in its one call
    # The same requests, in the same order, on the CPU engine: the same logits, bit for bit.
    for req, m in ((qa, ma), (qb, mb), (follow_req, mf)):
        rid = replay(reference, req)
        assert torch.equal(zlog.of(m.request_id), rlog.of(rid)), req.tag
    assert zero.scheduler.restarts == 0


@fresh_only
def test_a_spent_quota_gets_one_sentence_while_the_other_visitor_is_served(engines):
    from components.chat_presets import HANDBOOK_STARTERS, HANDBOOK_SYSTEM
    from tests.helpers_app import launched_app, shown_logs
    from tests.zerogpu.device_api import visitor_token

    zero = engines[0]
    carol, dave = visitor_token("10.0.0.3"), visitor_token("10.0.0.4")
    API.quota_override[API.visitor_of(carol)[0]] = 1.0  # Carol has spent her day's quota
    from gradio_client import Client

    with launched_app(zero) as url:
        c = Client(url, headers={"X-IP-Token": carol}, verbose=False, download_files=False)
        d = Client(url, headers={"X-IP-Token": dave}, verbose=False, download_files=False)
        jc = c.submit(HANDBOOK_STARTERS[2], [], HANDBOOK_SYSTEM, "", 16, False, api_name="/chat")  # at once
        jd = d.submit(HANDBOOK_STARTERS[0], [], HANDBOOK_SYSTEM, "", 16, False, api_name="/chat")
        rc, rd = jc.result(timeout=300), jd.result(timeout=300)
        warnings = [msg for msg, _ in shown_logs(jc)]
    assert answered(rd) and not shown_logs(jd), rd  # Dave answered
    assert len(warnings) == 1 and warnings[0].count(". ") == 0 and "quota" in warnings[0], warnings
    assert "Traceback" not in warnings[0]
    refused = [s for s in API.schedules if s.token == carol]
    assert refused and all(s.status == 429 for s in refused)
    print(f"\nspent quota, the visitor's one sentence: {warnings[0]}")
    assert answer(rc) == "", rc[0]


@fresh_only
def test_a_worker_killed_mid_call_fails_that_turn_and_the_next_turn_works(engines):
    from components.chat_presets import HANDBOOK_STARTERS, HANDBOOK_SYSTEM
    from tests.helpers_app import launched_app, shown_logs
    from tests.zerogpu.device_api import visitor_token

    zero = engines[0]
    erin = visitor_token("10.0.0.5")
    from gradio_client import Client

    with launched_app(zero) as url:
        e = Client(url, headers={"X-IP-Token": erin}, verbose=False, download_files=False)
        job = e.submit(HANDBOOK_STARTERS[1], [], HANDBOOK_SYSTEM, "", 200, False, api_name="/chat")
        deadline = time.monotonic() + 120
        while not API.running_pids() and time.monotonic() < deadline:
            time.sleep(0.01)
        pids = API.running_pids()
        assert pids, "no call under way"
        os.kill(pids[0], signal.SIGSTOP)  # frozen mid-call: scheduled, not released
        assert pids[0] in API.running_pids()
        os.kill(pids[0], signal.SIGKILL)
        job.result(timeout=300)
        warnings = [msg for msg, _ in shown_logs(job)]
        assert len(warnings) == 1 and "GPU" in warnings[0] and "Traceback" not in warnings[0], warnings
        retry = e.submit(HANDBOOK_STARTERS[1], [], HANDBOOK_SYSTEM, "", 8, False, api_name="/chat")
        again = retry.result(timeout=300)
        assert not shown_logs(retry)
    assert answered(again), again
    assert zero.healthy()
    print(f"\nworker killed mid-call, the visitor's one sentence: {warnings[0]}")


@pytest.mark.skipif(FRESH, reason="runs in the outer process: python app.py in a subprocess")
def test_app_py_starts_in_zerogpu_mode_with_the_model_placed_on_cuda(tokenizer, tmp_path):
    """``python app.py`` on a ZeroGPU Space: ``import spaces`` first, the model built and placed on
    ``cuda`` at start (not in a call), the page served, and ``spaces`` packing the weights at launch
    and reporting to the device API. No call is made: nothing here can start a real worker."""
    import httpx

    from tests.helpers_app import free_port
    from tests.zerogpu.device_api import DeviceAPI

    folder = tmp_path / "tiny"
    runner = tiny_runner(tokenizer)
    runner.model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    runner.close()
    api = DeviceAPI().start()
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1",
               RADIX_PLAYGROUND_CACHE=str(tmp_path / "cache"),  # the second tier on, as on a Space
               SPACES_ZERO_GPU="true", SPACES_ZERO_DEVICE_API_URL=api.url, ZEROGPU_OFFLOAD_DIR=str(tmp_path / "packs"),
               ZEROGPU_MMAP_AUTOPRUNE_PATTERN=str(tmp_path / "none" / "*"))
    proc = subprocess.Popen([sys.executable, "app.py", "--model", str(folder), "--port", str(port)],
                            cwd=Path(__file__).resolve().parents[2], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and api.startup_reports == 0 and proc.poll() is None:
            time.sleep(0.2)
        assert api.startup_reports == 1, "no start-up report"
        page = httpx.get(f"http://127.0.0.1:{port}/", timeout=30)
        assert page.status_code == 200
    except AssertionError as exc:
        proc.send_signal(signal.SIGTERM)
        raise AssertionError(f"{exc}: {proc.communicate(timeout=120)[0][-3000:]}") from None
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=120)[0] if proc.stdout and not proc.stdout.closed else ""
        api.close()
    lines = out.splitlines()
    ready = [line for line in lines if line.startswith("Model ready:")]
    assert ready and "ZeroGPU" in ready[0] and "bfloat16" in ready[0], out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert api.schedules == []  # starting costs no visitor anything


@fresh_only
@pytest.mark.slow
def test_a_starter_question_behind_the_cached_handbook_is_one_short_call():
    """The measurement (embedded model, bf16 as on a Space, this CPU as the device): a visitor's
    starter question with 96 new tokens behind the handbook another visitor's turn cached: its
    calls, the seconds they ask for, the wall time here, and the turns an unauthenticated
    visitor's 120 s cover."""
    import app
    from components.chat_presets import HANDBOOK_STARTERS, HANDBOOK_SYSTEM
    from tests.helpers_app import launched_app
    from tests.zerogpu.device_api import UNAUTHENTICATED_S, visitor_token

    os.environ["RADIX_ZEROGPU_MODEL"] = "embedded"
    engine = app.build_engine(app.parse_args(ARGS))
    submitted, submit = [], engine.submit
    engine.submit = lambda request: submitted.append(request) or submit(request)
    first, second = visitor_token("10.1.0.1"), visitor_token("10.1.0.2")
    from gradio_client import Client

    with launched_app(engine) as url:
        Client(url, headers={"X-IP-Token": first}, verbose=False).predict(
            HANDBOOK_STARTERS[0], [], HANDBOOK_SYSTEM, "", 96, False, api_name="/chat")
        before = len(API.schedules)
        calls_before = set(API.calls)
        t0 = time.monotonic()
        Client(url, headers={"X-IP-Token": second}, verbose=False).predict(
            HANDBOOK_STARTERS[1], [], HANDBOOK_SYSTEM, "", 96, False, api_name="/chat")
        page_s = time.monotonic() - t0
    asked = API.schedules[before:]
    calls = [c for k, c in API.calls.items() if k not in calls_before]
    m = engine.recent()[-1]
    # The same prompt again, all 96 tokens whatever the model says (no visitor: the Space's own quota).
    import dataclasses

    from engine.types import SamplingParams

    seen = set(API.calls)
    again = dataclasses.replace(submitted[-1], sampling=SamplingParams(max_new_tokens=96, ignore_eos=True))
    full = list(engine.submit(again))[-1].metrics
    [held96] = [c.wall_s for k, c in API.calls.items() if k not in seen]
    engine.close()
    assert [s.token for s in asked] == [second] and len(calls) == 1
    ask, wall = asked[0].duration_s, calls[0].wall_s
    by_ask = int(UNAUTHENTICATED_S // ask)
    by_use = int((UNAUTHENTICATED_S - ask) // wall) + 1 if wall < UNAUTHENTICATED_S else 0
    print(f"\nZeroGPU starter question, {engine.info().model_name} ({engine.info().dtype}), this CPU as the device: "
          f"{len(asked)} call, {ask} s asked, {wall:.1f} s held here ({page_s:.1f} s on the page); "
          f"{m.cached_tokens:,} of {m.prompt_tokens:,} prompt tokens cached, {m.output_tokens} new; "
          f"an unauthenticated visitor's {UNAUTHENTICATED_S:.0f} s: {by_ask} such turns counted at the ask, "
          f"{by_use} at this CPU's time; 96 tokens forced: {API.schedules[-1].duration_s} s asked, {held96:.1f} s held "
          f"({full.cached_tokens:,} cached, {full.output_tokens} new)")
    assert m.cached_tokens >= 2000 and by_ask >= 20
