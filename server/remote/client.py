"""The HTTP side of remote mode: one OpenAI-compatible server, spoken to with httpx.

Owns: the connection (base URL, API key, timeouts), the start-up check (``GET /v1/models``:
URL, key and model name), one streamed ``/v1/completions`` request with the prompt as token
ids (``stream``), its time to first token measured here, the server's ``/metrics`` where it
has them, and turning every way a server can fail (refused connection, wrong key, 404, 429,
an error chunk, a connection dropped mid-answer) into one message for a person: an
``EngineFault`` when the backend or this dashboard's setup failed (the API answers 500), an
``EngineBusy`` when the backend is overloaded, an ``EngineError`` only when the backend
refused the request itself (HTTP 400, 413, 422). Knows nothing about trees, namespaces or the UI.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine.types import EngineBusy, EngineError, EngineFault, GenerationEvent, SamplingParams
from server.remote.usage import BackendUsage, error_message, parse_choice, parse_usage

# What a server's /metrics may say about its cache and queue (vLLM, SGLang, this app).
BACKEND_METRICS = (
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_requests_running",
    "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
    "sglang:cache_hit_rate", "sglang:token_usage", "sglang:num_running_reqs", "sglang:num_queue_reqs",
    "radix_prefix_cache_queries_total", "radix_prefix_cache_hits_total", "radix_cache_bytes",
    "radix_cache_budget_bytes", "radix_evicted_tokens_total", "radix_num_requests_waiting",
    "radix_num_requests_running", "radix_kv_tree_bytes", "radix_cache_tokens",
    "llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total", "llamacpp:requests_processing",
    "llamacpp:requests_deferred", "llamacpp:n_busy_slots_per_decode",
)


@dataclass
class StreamResult:
    text: str
    token_ids: list[int]
    usage: BackendUsage | None
    finish: str
    ttft_ms: float
    decode_tokens_per_s: float | None
    logprobs: list[float] | None = None  # the chosen tokens' (asked with ``logprobs``); None: none came


class BackendClient:
    def __init__(self, base_url: str, model: str = "", api_key: str | None = None, timeout_s: float = 300.0) -> None:
        url = base_url.rstrip("/")
        self.base_url = url[: -len("/v1")] if url.endswith("/v1") else url
        self.model = model
        self.timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.base_url, headers=headers,
                                 timeout=httpx.Timeout(timeout_s, connect=10.0))
        self._metrics: dict[str, float] = {}
        self._metrics_at: float | None = None
        self._health, self._health_at = False, None  # healthy()'s last answer and when (monotonic)
        self.owned_by = ""  # /v1/models' "owned_by" of the served model ("llamacpp", "vllm", ...), once checked

    def check(self) -> None:
        """Ask ``GET /v1/models`` once: a wrong URL, key or model name fails here with one clear message."""
        body = self._get_json("/v1/models")
        names = [m.get("id") for m in body.get("data", []) if isinstance(m, dict)] if isinstance(body, dict) else []
        if not self.model:
            if not names:
                raise EngineError(f"The backend at {self.base_url} lists no models at /v1/models: pass "
                                  "--backend-model.")
            self.model = str(names[0])
        if names and self.model not in names:
            raise EngineError(f"The backend at {self.base_url} does not serve '{self.model}'; it serves "
                              f"{', '.join(map(str, names[:5]))}. Pass one of them as --backend-model.")
        owners = [m.get("owned_by") for m in body.get("data", []) if isinstance(m, dict) and m.get("id") == self.model]
        self.owned_by = str(owners[0]) if owners and owners[0] else ""

    def healthy(self, max_age_s: float = 1.0) -> bool:
        """Whether the backend is up: its ``GET /health`` answered 200 (vLLM, SGLang, this app), or
        ``GET /v1/models`` where it serves no ``/health``; 2 s at most, the answer kept ``max_age_s``."""
        now = time.monotonic()
        if self._health_at is not None and now - self._health_at < max_age_s:
            return self._health
        try:
            r = self.http.get("/health", timeout=2.0)
            if r.status_code in (404, 405):
                r = self.http.get("/v1/models", timeout=2.0)
            up = r.status_code == 200
        except httpx.HTTPError:
            up = False
        self._health, self._health_at = up, time.monotonic()
        return up

    def _get_json(self, path: str) -> object:
        try:
            r = self.http.get(path)
        except httpx.HTTPError as exc:
            raise self._transport_error(exc) from None
        if r.status_code != 200:
            raise self._status_error(r.status_code, r.content)
        try:
            return r.json()
        except ValueError:
            raise EngineError(f"The backend at {self.base_url} answered {path} with something that is not "
                              "JSON: is --backend the server's address?") from None

    def _transport_error(self, exc: httpx.HTTPError) -> EngineError:
        if isinstance(exc, httpx.ConnectError):
            return EngineFault(f"Cannot reach the backend at {self.base_url} ({exc or 'connection refused'}): "
                               "is it running, and is --backend right?")
        if isinstance(exc, httpx.TimeoutException):
            return EngineFault(f"The backend at {self.base_url} did not answer within {self.timeout_s:.0f} s.")
        return EngineFault(f"The connection to the backend at {self.base_url} failed: {type(exc).__name__}.")

    def _status_error(self, status: int, content: bytes) -> EngineError:
        try:
            message = error_message(json.loads(content))
        except ValueError:
            message = None
        message = (message or content[:200].decode("utf-8", "replace")).strip()[:300]
        if status in (401, 403):
            return EngineFault(f"The backend at {self.base_url} refused the API key (HTTP {status}): set "
                               f"RADIX_BACKEND_API_KEY to a key it accepts. It said: {message}")
        if status in (429, 503):
            return EngineBusy(f"The backend is busy (HTTP {status}): {message}")
        if status == 404:
            return EngineFault(f"The backend at {self.base_url} answered HTTP 404: {message} (check --backend and "
                               "--backend-model).")
        if status in (400, 413, 422):  # the request itself: the same request would fail anywhere
            return EngineError(f"The backend refused the request (HTTP {status}): {message}")
        return EngineFault(f"The backend failed on the request (HTTP {status}): {message}")

    def _body(self, ids: list[int], p: SamplingParams, max_new: int, salt: str | None, cold: bool = False,
              logprobs: int | None = None) -> dict:
        body = {"model": self.model, "prompt": ids, "max_tokens": max_new, "temperature": p.temperature,
                "top_p": p.top_p, "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True}
        if logprobs is not None:  # completions' count of alternatives; 0: the chosen token's alone
            body["logprobs"] = logprobs
        if p.seed is not None:
            body["seed"] = p.seed
        if p.repetition_penalty != 1.0:
            body["repetition_penalty"] = p.repetition_penalty
        if p.no_repeat_ngram_size:
            body["no_repeat_ngram_size"] = p.no_repeat_ngram_size
        if p.ignore_eos:
            body["ignore_eos"] = True
        if salt is not None:
            body["cache_salt"] = salt
        if cold:  # llama.cpp ignores cache_salt and reuses any slot's prefix: this is how it skips its cache
            body["cache_prompt"] = False
        return body

    def stream(self, ids: list[int], sampling: SamplingParams, max_new: int, salt: str | None,
               cancelled: threading.Event, cold: bool = False, logprobs: int | None = None) -> Iterator[GenerationEvent]:
        """Send one request and yield its text as it streams (``yield from`` it: it returns a
        ``StreamResult``). Setting ``cancelled`` closes the connection at the next chunk. ``cold``
        asks the server not to reuse any cache (a fresh ``salt`` does it on vLLM and SGLang,
        ``cache_prompt: false`` on llama.cpp, which ignores salts). ``logprobs`` (0: the chosen
        token's only) asks for log-probabilities; the result's ``logprobs`` is None when any chunk
        came without them."""
        text, token_ids, usage, finish = "", [], None, "length"
        chosen: list[float] | None = [] if logprobs is not None else None
        t0 = time.perf_counter()
        t_first = t_last = None
        try:
            with self.http.stream("POST", "/v1/completions", json=self._body(ids, sampling, max_new, salt, cold, logprobs)) as r:
                if r.status_code != 200:
                    raise self._status_error(r.status_code, r.read())
                for line in r.iter_lines():
                    if cancelled.is_set():
                        finish = "cancelled"
                        break
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        raise EngineFault("The backend sent a stream chunk that is not JSON.") from None
                    message = error_message(chunk)
                    if message and not chunk.get("choices"):
                        raise EngineFault(f"The backend stopped this request: {message}"[:300])
                    usage = parse_usage(chunk) or usage
                    delta = parse_choice(chunk)
                    if delta is None:
                        continue
                    t_last = time.perf_counter()
                    if t_first is None:
                        t_first = t_last
                    token_ids += delta.token_ids
                    if chosen is not None and (delta.token_ids or delta.text):
                        chosen = chosen + list(delta.logprobs) if delta.logprobs is not None else None
                    if delta.finish_reason:
                        finish = "stop" if delta.finish_reason != "length" else "length"
                    if delta.text:
                        text += delta.text
                        yield GenerationEvent(text=text, token_id=delta.token_ids[-1] if delta.token_ids else -1)
        except httpx.HTTPError as exc:
            if isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError) and t_first is not None:
                raise EngineFault(f"The backend at {self.base_url} closed the connection in the middle of the "
                                  f"answer ({len(text):,} characters in). Try again.") from None
            raise self._transport_error(exc) from None
        if finish != "cancelled" and t_first is None and usage is None:
            raise EngineFault(f"The backend at {self.base_url} ended the stream without an answer.")
        ttft_ms = ((t_first or time.perf_counter()) - t0) * 1000
        n = len(token_ids) or (usage.completion_tokens if usage and usage.completion_tokens else 0)
        tps = (n - 1) / (t_last - t_first) if n > 1 and t_first and t_last and t_last > t_first else None
        return StreamResult(text, token_ids, usage, finish, ttft_ms, tps, chosen)

    def metrics(self, max_age_s: float = 10.0) -> dict[str, float]:
        """The cache and queue numbers the server's ``/metrics`` exposes, where it has them
        (vLLM, SGLang with ``--enable-metrics``, this app), summed over labels; ``{}`` when
        it has none. Read at most every ``max_age_s`` seconds."""
        now = time.monotonic()
        if self._metrics_at is not None and now - self._metrics_at < max_age_s:
            return self._metrics
        self._metrics_at = now
        try:
            r = self.http.get("/metrics", timeout=2.0)
            text = r.text if r.status_code == 200 else ""
            found: dict[str, float] = {}
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name in BACKEND_METRICS:
                        found[sample.name] = found.get(sample.name, 0.0) + float(sample.value)
        except (httpx.HTTPError, ValueError):
            found = {}
        self._metrics = found
        return found

    def close(self) -> None:
        self.http.close()
