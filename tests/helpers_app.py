"""Helpers for tests that launch the app: a free port, the app launched in-process on it
(the same Blocks and queue settings as ``python app.py``), gradio_client visitors, what a
visitor was shown (streamed outputs and warning toasts), the engine's idle checks, and
counting scheduler steps from the step log (fairness asserted in steps, never in seconds:
the test machine is shared and noisy)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from engine.engine import Engine
from tools.load_test import flat_text  # noqa: F401 - the tests' name for it

# Headless Debian Chromium for the browser tests: no sandbox (root in CI), no GPU, nothing fetched.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def free_port() -> int:
    """A port nobody listens on now (never 7860: the lead's app lives there)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port != 7860:
            return port


@contextmanager
def launched_app(engine: Engine, max_queue: int = 32, api_key: str | None = None,
                 max_per_client: int | None = None) -> Iterator[str]:
    """``app.build_app(engine)`` served on a free local port (with ``api_key`` and
    ``max_per_client`` as ``python app.py`` takes them); yields its URL."""
    import app
    from components.demo import launch_kwargs

    demo = app.build_app(engine, max_queue)
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=free_port(), quiet=True,
                **launch_kwargs(app.app_kwargs(engine, api_key, max_per_client)))
    try:
        yield demo.local_url
    finally:
        demo.close()


def visitor(url: str):
    """A gradio_client visitor: its own session hash, like a browser tab."""
    from gradio_client import Client

    return Client(url, verbose=False, download_files=False)


def shown_logs(job) -> list[tuple[str, str]]:
    """(message, level) of every toast (``gr.Warning``/``gr.Info``) the job's visitor got.

    Call after the job is done: it drains the client's status queue (gradio_client 2.7)."""
    out = []
    comm = getattr(job, "communicator", None)
    if comm is None:
        return out
    while not comm.updates.empty():
        update = comm.updates.get_nowait()
        log = getattr(update, "log", None)
        if log:
            out.append(tuple(log))
    return out


def wait_idle(engine: Engine, timeout_s: float = 120.0) -> None:
    """Block until no request waits or runs (the worker holds the runner's lock while it runs)."""
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while quiet < 3:
        if time.monotonic() > deadline:
            raise TimeoutError("the engine did not become idle")
        # busy(): also a request the worker took from the inbox but has not scheduled yet
        busy = engine.busy() or engine.stats().queue_depth > 0 or engine.runner.lock.locked()
        quiet = 0 if busy else quiet + 1
        time.sleep(0.05)


def wait_for(cond, timeout_s: float = 60.0, what: str = "a condition") -> None:
    """Poll ``cond`` until it is true (a deadline only against a hang, never a measurement)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.01)


def last_step_id(engine: Engine) -> int:
    """The id of the scheduler's last logged step (0 before any)."""
    log = engine.step_log(1)
    return log[-1].step_id if log else 0


def first_chunk_step(engine: Engine, request_id: int) -> int | None:
    """The step of ``request_id``'s first prefill chunk (it was admitted then or before)."""
    return min((s.step_id for s in engine.step_log() if request_id in s.prefill_request_ids), default=None)


def first_token_step(engine: Engine, request_id: int) -> int | None:
    """The step that sampled ``request_id``'s first token: the one that ran its last prefill chunk."""
    return max((s.step_id for s in engine.step_log() if request_id in s.prefill_request_ids), default=None)


class StepGate:
    """Lets the engine's scheduler run only the steps the test allows (``allow``), so that a
    request can arrive at an exact point of another's work whatever the machine's speed;
    ``open`` lets every step through again. A step waits at the gate after the engine moved
    its inbox into the scheduler, so a request that arrives meanwhile waits for that step too,
    as one that arrives during a step does."""

    def __init__(self, engine: Engine) -> None:
        self._scheduler = engine.scheduler
        self._step = engine.scheduler.step
        self._permits = threading.Semaphore(0)
        self._open = False
        self.held = False  # a step waits at the gate now (the engine's worker is parked there)
        engine.scheduler.step = self._gated  # type: ignore[method-assign]

    def _gated(self):
        if not self._open:
            self.held = True
            self._permits.acquire()
            self.held = False
        return self._step()

    def allow(self, steps: int) -> None:
        self._permits.release(steps)

    def open(self) -> None:
        self._open = True
        self._permits.release(1)  # the step waiting at the gate now, if any

    def close(self) -> None:
        """Hold every step again (call while no step waits at the gate: the engine idle)."""
        self._open = False
        while self._permits.acquire(blocking=False):  # a permit ``open`` left unused
            pass


def assert_clean(engine: Engine) -> None:
    """Idle engine: invariants hold, no lock left, every used pool slot belongs to the tree."""
    engine.check_invariants()
    cache = engine.cache
    if hasattr(cache, "pool"):  # local caches (the cache-off twin's tree stays empty)
        assert cache.locked_tokens() == 0, "a lock leaked"
        assert cache.running_tokens == 0, "a running request's slots leaked"
        assert cache.pool.num_used == cache.tree.num_tokens, "a pool slot leaked"
        assert cache.pool.bytes_in_use <= cache.pool.budget_bytes
        assert all(n.lock_ref == 0 for n in cache.tree.nodes()), "a lock leaked"


def fn_id(client, api_name: str) -> int:
    """The server's id of the event called ``api_name`` (what a browser sends as fn_index)."""
    return next(d["id"] for d in client.config["dependencies"] if d.get("api_name") == api_name.lstrip("/"))


def raw_call(url: str, fn_index: int, data: list, timeout_s: float = 300) -> dict:
    """Call an event the way a browser does (queue/join, then the event stream), with a JSON
    body written as Python does by default: lone surrogates as ``\\ud800`` escapes, NaN and
    infinities as literals. gradio_client refuses to send either. Returns
    ``{"success", "output", "error", "logs"}`` from the stream's messages."""
    import json
    import uuid

    import httpx

    session = uuid.uuid4().hex[:11]
    body = json.dumps({"data": data, "fn_index": fn_index, "session_hash": session, "event_data": None,
                       "trigger_id": None})  # ensure_ascii and allow_nan: the defaults
    with httpx.Client(base_url=url, timeout=timeout_s) as http:
        join = http.post("gradio_api/queue/join", content=body.encode("ascii"),
                         headers={"content-type": "application/json"})
        if join.status_code != 200:
            return {"success": False, "output": None, "error": f"HTTP {join.status_code}: {join.text[:200]}",
                    "logs": []}
        logs, last = [], None
        with http.stream("GET", "gradio_api/queue/data", params={"session_hash": session}) as stream:
            # Split on b"\n" only: iter_lines() would also split inside the JSON at U+2028, U+0085...
            buffer = b""
            for chunk in stream.iter_bytes():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue
                    msg = json.loads(line[5:])
                    if msg.get("msg") == "log":
                        logs.append(str(msg.get("log")))
                    if msg.get("msg") == "process_completed":
                        last = msg
                        break
                if last is not None:
                    break
    if last is None:
        return {"success": False, "output": None, "error": "the event stream ended without a result", "logs": logs}
    output = last.get("output") or {}
    return {"success": bool(last.get("success")), "output": output.get("data"), "error": output.get("error"),
            "logs": logs}


def save_tiny_model(folder, tokenizer, seed: int = 0, max_positions: int = 2048) -> str:
    """The tests' tiny random Llama (``tests/conftest.make_tiny_runner``'s shape) with the real
    tokenizer saved next to it, as any checkpoint folder: for ``python app.py --model <folder>``
    in a subprocess. Returns the folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)
