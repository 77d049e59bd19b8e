"""A stand-in of ZeroGPU's device API, on loopback, for the real ``spaces`` package to talk to.

Written from ``spaces`` 0.51.3 (``spaces/zero/api.py``, ``client.py``, ``wrappers.py``) and Hugging
Face's ZeroGPU page (hub-docs 242f4a1, ``docs/hub/spaces-zerogpu.md``). What it answers:

- ``POST /schedule`` (``cgroupPath``, ``taskId``, ``enableQueue``, ``tokenVersion``,
  ``durationSeconds``, ``gpuSize``, ``token``): a free GPU slot as JSON ``{idle, nvidiaIndex,
  nvidiaUUID, allowToken}`` (``idle`` is true: the slot runs nothing, so ``spaces`` reuses the
  worker it keeps there); 429 ``{left, wait}`` with ``X-Authenticated`` when the duration asked is
  more than the visitor's quota left (``spaces`` turns that into "You have exceeded your ZeroGPU
  quota (N s requested vs. M s left)"); ``wait`` is negative (an illegal duration) above
  ``max_duration_s``; 503 when every slot is busy (``spaces``: "No GPU was available").
- ``POST /allow`` (``allowToken``, ``pid``: a new worker's process id, which tests may kill),
  ``POST /release`` (``allowToken``, ``fail``): the slot is free again and the visitor is charged
  the time the call held it, as ZeroGPU charges the GPU time used; ``POST /startup-report``;
  ``GET /queue-size``.

Quota per visitor, as the docs give it: 120 s a day unauthenticated, 300 s a free account, 2,400 s
PRO. The visitor is read from the ``X-IP-Token`` JWT ``spaces`` forwards (this stand-in's
convention for its payload: ``user`` for a logged-in visitor, ``plan`` "pro" for PRO, ``ip``
otherwise); a schedule with no token (a call made outside any Gradio request) is charged to one
bucket for the whole Space, with the unauthenticated quota. Every schedule is recorded with its
token, its visitor and the duration asked (``schedules``).
"""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

UNAUTHENTICATED_S, FREE_S, PRO_S = 120.0, 300.0, 2400.0
NO_TOKEN = "(no token: the Space's own quota)"


def visitor_token(ip: str, user: str | None = None, plan: str | None = None) -> str:
    """An ``X-IP-Token`` as ``spaces`` reads it: a JWT (unsigned here; ``spaces`` only decodes it)."""
    def part(obj: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")
    payload = {"ip": ip, **({"user": user} if user else {}), **({"plan": plan} if plan else {})}
    return f"{part({'alg': 'none', 'typ': 'JWT'})}.{part(payload)}.stand-in"


@dataclass
class Schedule:
    token: str | None
    visitor: str
    duration_s: int
    status: int  # 200, 429 or 503
    left_s: float  # the visitor's quota left when it asked


@dataclass
class Call:
    visitor: str
    index: int
    started: float
    pid: int | None = None
    wall_s: float | None = None
    failed: bool | None = None


class DeviceAPI:
    """The stand-in; ``start()`` serves it on a free loopback port (``url``)."""

    def __init__(self, gpus: int = 4, max_duration_s: int = 120) -> None:
        self.gpus, self.max_duration_s = gpus, max_duration_s
        self.lock = threading.Lock()
        self.schedules: list[Schedule] = []
        self.calls: dict[str, Call] = {}  # allow token -> call
        self.used: dict[str, float] = {}  # visitor -> seconds charged
        self.quota_override: dict[str, float] = {}  # visitor -> daily quota (tests)
        self.worker_pid: dict[int, int] = {}  # slot -> the pid its last worker allowed (spaces reuses it)
        self.startup_reports = 0
        self._server: ThreadingHTTPServer | None = None

    # ------------------------------------------------------------- facts
    @staticmethod
    def visitor_of(token: str | None) -> tuple[str, str | None, float]:
        """(visitor, auth level as the X-Authenticated header names it, daily quota)."""
        if token is None:
            return NO_TOKEN, None, UNAUTHENTICATED_S
        try:
            payload = json.loads(base64.urlsafe_b64decode(token.split(".")[1] + "=="))
        except Exception:
            return f"token {token[:16]}", None, UNAUTHENTICATED_S
        if payload.get("user"):
            pro = payload.get("plan") == "pro"
            return f"user {payload['user']}", "pro" if pro else "regular", PRO_S if pro else FREE_S
        return f"ip {payload.get('ip')}", None, UNAUTHENTICATED_S

    def left_s(self, visitor: str, quota_s: float | None = None) -> float:
        quota = self.quota_override.get(visitor, quota_s if quota_s is not None else UNAUTHENTICATED_S)
        return max(0.0, quota - self.used.get(visitor, 0.0))

    def tokens(self) -> list[str | None]:
        return [s.token for s in self.schedules if s.status == 200]

    # ----------------------------------------------------------- answers
    def schedule(self, params: dict[str, str]) -> tuple[int, dict, dict[str, str]]:
        token = params.get("token")
        duration = int(params.get("durationSeconds", 60))
        visitor, auth, quota = self.visitor_of(token)
        headers = {"X-Authenticated": auth} if auth else {}
        with self.lock:
            left = self.left_s(visitor, quota)
            if duration > self.max_duration_s:
                status, body = 429, {"left": int(left), "wait": -1}
            elif duration > left:
                status, body = 429, {"left": int(left), "wait": 3600}
            else:
                busy = {c.index for c in self.calls.values() if c.wall_s is None}
                free = [i for i in range(self.gpus) if i not in busy]
                if not free:
                    status, body = 503, {"detail": "no GPU free"}
                else:
                    allow = uuid.uuid4().hex
                    self.calls[allow] = Call(visitor, free[0], time.monotonic(), self.worker_pid.get(free[0]))
                    status, body = 200, {"idle": True, "nvidiaIndex": free[0],
                                         "nvidiaUUID": f"GPU-stand-in-{free[0]}", "allowToken": allow}
            self.schedules.append(Schedule(token, visitor, duration, status, left))
        return status, body, headers

    def allow(self, params: dict[str, str]) -> int:
        with self.lock:
            call = self.calls.get(params.get("allowToken", ""))
            if call is None:
                return 404
            call.pid = int(params.get("pid", 0)) or None
            if call.pid:
                self.worker_pid[call.index] = call.pid
            return 200

    def release(self, params: dict[str, str]) -> int:
        with self.lock:
            call = self.calls.get(params.get("allowToken", ""))
            if call is None or call.wall_s is not None:
                return 404
            call.wall_s = time.monotonic() - call.started
            call.failed = params.get("fail", "false").lower() == "true"
            self.used[call.visitor] = self.used.get(call.visitor, 0.0) + call.wall_s
            return 200

    def running_pids(self) -> list[int]:
        """Worker pids of the calls under way (a reused worker allows no pid again: its slot's last)."""
        with self.lock:
            return [c.pid for c in self.calls.values() if c.wall_s is None and c.pid]

    # ------------------------------------------------------------ server
    def start(self) -> DeviceAPI:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, body: object = None, headers: dict[str, str] | None = None) -> None:
                data = b"" if body is None else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                url = urlparse(self.path)
                params = {k: v[0] for k, v in parse_qs(url.query).items()}
                if url.path == "/schedule":
                    self._send(*api.schedule(params))
                elif url.path == "/allow":
                    self._send(api.allow(params))
                elif url.path == "/release":
                    self._send(api.release(params))
                elif url.path == "/startup-report":
                    api.startup_reports += 1
                    self._send(200)
                else:
                    self._send(404)

            def do_GET(self) -> None:
                self._send(200, 0) if urlparse(self.path).path == "/queue-size" else self._send(404)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, name="device-api", daemon=True).start()
        return self

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
