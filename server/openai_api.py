"""The OpenAI-compatible routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``.

Owns: the HTTP flow of one API request (read the body, check it, have the engine key it,
submit it to the engine, stream or collect its events, cut at stop strings) and the mapping
of failures to OpenAI-shaped errors: 400 bad input (naming the parameter), 404 unknown
model, 503 queue full or not ready, 500 a fault of the server, never a traceback. A client
that goes away cancels its request. Requests go through the same engine as the page (tag
``"api"``), so they show in the live tree and charts. Knows nothing about Gradio:
``api_routes`` returns plain Starlette routes that ``app.py`` mounts ahead of the page's own.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect
from starlette.routing import BaseRoute

from engine.api import EngineAPI, TextAPI
from engine.handle import RequestHandle
from engine.types import (
    EngineBusy,
    EngineError,
    EngineFault,
    GenerationEvent,
    GenerationRequest,
    RequestMetrics,
    TokenLogprob,
)
from server import openai_logprobs as lps
from server import openai_protocol as proto
from server.cache_scope import keyed_request
from server.client_limits import ClientLimits, Lease, client_identity, default_max_per_client
from server.exposure import NOT_HERE, ServerReadRule
from server.openai_protocol import ApiError, ParsedRequest, StopMatcher
from server.request_guard import MAX_BODY_BYTES, BodyTooLarge

log = logging.getLogger(__name__)

API_TAG = "api"


@dataclass
class ApiState:
    """What the routes share: how to reach the engine (``None`` while it loads), the key, the limits."""

    get_engine: Callable[[], EngineAPI | None]
    model_name: str | None = None
    api_key: str | None = None  # when set, every request must carry "Authorization: Bearer <key>"
    # Requests one client may have queued or running (None: the default for the engine's
    # deployment, ``client_limits.default_max_per_client``; 0: no cap).
    max_per_client: int | None = None
    limits: ClientLimits | None = None
    # What ``GET /kv_event_sources`` serves, as vLLM does (``{"0": config}``): this engine's own
    # KV-event publisher, so a dashboard in front of this app finds its stream. None: 404.
    kv_event_sources: dict | None = None
    # Who may read server-wide routes (``/kv_event_sources``); None: those with an API key, if any.
    server_read: ServerReadRule | None = None

    def keys(self) -> list[str]:
        """The accepted keys: ``api_key`` may list several, comma-separated (one per client)."""
        return [k.strip() for k in (self.api_key or "").split(",") if k.strip()]

    def check_key(self, request: Request) -> None:
        keys = self.keys()
        if not keys:
            return
        given = request.headers.get("authorization", "").encode()
        if not any([hmac.compare_digest(given, f"Bearer {k}".encode()) for k in keys]):
            raise ApiError(401, "Incorrect API key: send 'Authorization: Bearer <key>' with the key this server "
                           "was started with.", "authentication_error", None, "invalid_api_key")

    def engine(self) -> EngineAPI:
        engine = self.get_engine()
        if engine is None:
            raise ApiError(503, "The model is still loading; try again in a moment.", "server_error", None,
                           "model_loading")
        if self.limits is None:
            cap = (default_max_per_client(bool(engine.isolation), engine.max_queue)
                   if self.max_per_client is None
                   else self.max_per_client or None)
            self.limits = ClientLimits(cap)
        if not self.model_name:
            self.model_name = engine.info().model_name
        return engine

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model '{model[:100]}' does not exist here; this server serves "
                           f"'{self.model_name}' (GET /v1/models).", "invalid_request_error", "model",
                           "model_not_found")

    def client_of(self, request: Request) -> str:
        """Who sent ``request``, as limits and cache shares count clients (``client_limits``)."""
        return client_identity(request.headers, request.client.host if request.client else None, bool(self.keys()))

    def take_place(self, client: str) -> Lease:
        """One more request of ``client`` in flight, or ``ApiError`` 429 at its cap."""
        assert self.limits is not None
        return self.limits.take(client)


async def released(stream: AsyncIterator[bytes], lease: Lease) -> AsyncIterator[bytes]:
    """``stream``, with ``lease`` given back when it ends, fails or is closed (a client gone)."""
    try:
        async for item in stream:
            yield item
    finally:
        lease.release()


class SafeJSONResponse(JSONResponse):
    """JSON that always encodes: text with a lone surrogate (``"\\ud800"`` is valid JSON, and a
    prompt may carry one into ``echo`` or an error) goes out \\u-escaped, as the streamed chunks
    (``sse``) always do, instead of raising ``UnicodeEncodeError`` mid-response (a 500 with a
    traceback, and the connection reset)."""

    def render(self, content) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(exc: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
    return SafeJSONResponse(exc.body(), status_code=exc.status, headers=headers)


def api_error(exc: BaseException, param: str | None = None) -> ApiError:
    """Any failure as the error a client gets: a message for a person, no traceback.

    Faults of the server are 5xx, so clients retry them and monitoring counts them:
    ``EngineFault`` (the engine failed: a bug, out of memory) 500 ``server_error`` with one
    log line, ``EngineBusy`` (the queue is full) 503 with ``Retry-After``, anything else
    unexpected 500 with its traceback in the log. Only ``EngineError`` proper is the
    request's fault: 400, naming ``param`` (the prompt or messages it was about)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, EngineBusy):
        return ApiError(503, str(exc), "server_error", None, "queue_full")
    if isinstance(exc, EngineFault):
        log.error("API request failed in the engine: %s", exc)
        return ApiError(500, f"The server failed on this request: {exc}"[:400], "server_error")
    if isinstance(exc, EngineError):
        return ApiError(400, str(exc), "invalid_request_error", param)
    log.exception("API request failed")
    return ApiError(500, f"The server failed on this request ({type(exc).__name__}).", "server_error")


def completion_tokens(out: Outcome) -> int:
    """What ``usage.completion_tokens`` says: the tokens the client got. Cut at a stop string,
    those are the tokens streamed up to it (the engine may have generated one or two more
    before it saw the cancel); else all the engine's output tokens (a remote backend may
    send several per chunk, so the chunk count would be wrong)."""
    assert out.metrics is not None
    return min(len(out.token_ids), out.metrics.output_tokens) if out.stopped else out.metrics.output_tokens


def body_too_large(limit: int = MAX_BODY_BYTES) -> ApiError:
    return ApiError(413, f"The request body is over the server's limit of {limit:,} bytes.",
                    "invalid_request_error", None, "request_too_large")


async def read_json(request: Request) -> object:
    """The body as JSON, within the server's one body limit (``request_guard.MAX_BODY_BYTES``,
    enforced by the guard around every route; counted here too, for an app without it)."""
    body = b""
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise body_too_large()
    except BodyTooLarge as exc:
        raise body_too_large(exc.limit) from None
    except ClientDisconnect:  # gone before the body ended: nobody reads the answer, no traceback logged
        raise proto.bad_request("The client closed the connection before the body ended.") from None
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise proto.bad_request("The request body is not valid JSON.") from None
    except RecursionError:  # deeper than the decoder's own limit
        raise proto.bad_request(f"The request body nests deeper than {MAX_JSON_DEPTH} levels.") from None
    if nested_deeper(value, MAX_JSON_DEPTH):
        raise proto.bad_request(f"The request body nests deeper than {MAX_JSON_DEPTH} levels.")
    return value


# No request of this API nests deeper than a few levels (messages -> content parts -> fields).
MAX_JSON_DEPTH = 32


def nested_deeper(value: object, limit: int) -> bool:
    """Whether ``value`` (parsed JSON) nests lists or objects deeper than ``limit``; iterative, so
    no depth can exhaust the stack."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


async def events_of(handle: RequestHandle) -> AsyncIterator[GenerationEvent]:
    """The handle's events on the event loop, with no thread per stream and no hop per token
    (``RequestHandle.__aiter__``); cancelling the consumer (a client gone) cancels the request
    at its next step."""
    try:
        async for event in handle:
            yield event
    finally:
        handle.cancel()


@dataclass
class Outcome:
    """What one request produced, as the client sees it (text cut at a stop string)."""

    text: str = ""
    metrics: RequestMetrics | None = None
    stopped: bool = False
    token_ids: list[int] = field(default_factory=list)  # generated, up to a stop string
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token in ``token_ids``, where asked
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None  # with echo and logprobs, once prefilled


async def deltas(handle: RequestHandle, stops: tuple[str, ...], out: Outcome) -> AsyncIterator[str]:
    """New visible text as it comes; fills ``out`` (the final text and metrics) on the way."""
    matcher = StopMatcher(stops)
    async for event in events_of(handle):
        if event.prompt_logprobs is not None:  # the prompt is scored (echo): a stream sends it now
            out.prompt_logprobs = event.prompt_logprobs
            yield ""
            continue
        if event.done:
            out.metrics = event.metrics
            if not matcher.stopped:
                text = matcher.visible(event.text, final=True)
                if len(text) > len(out.text):
                    yield text[len(out.text):]
                    out.text = text
            break
        if event.token_id is None or matcher.stopped:  # progress events; or past a stop string
            continue
        out.token_ids.append(event.token_id)
        if event.logprob is not None:
            out.logprobs.append(event.logprob)
        text = matcher.visible(event.text)
        if matcher.stopped:
            handle.cancel()  # the engine ends it at the next token and reports its metrics
        if len(text) > len(out.text) and text.startswith(out.text):
            yield text[len(out.text):]
            out.text = text
    out.stopped = matcher.stopped


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


async def watch_disconnect(request: Request, handle: RequestHandle) -> None:
    """Cancel ``handle`` when the client closes its connection (the body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            handle.cancel()
            return


class OpenAIApi:
    def __init__(self, state: ApiState) -> None:
        self.state = state

    async def models(self, request: Request) -> Response:
        try:
            self.state.check_key(request)
            self.state.engine()
        except ApiError as exc:
            return error_response(exc)
        return JSONResponse(proto.models_list(self.state.model_name or ""))

    async def kv_event_sources(self, request: Request) -> Response:
        rule = self.state.server_read
        if rule is not None and not rule.allows(request.headers):
            return error_response(ApiError(404, NOT_HERE, "invalid_request_error", None, "not_found"))
        if rule is None or not rule.isolation:
            try:
                self.state.check_key(request)
            except ApiError as exc:
                return error_response(exc)
        if not self.state.kv_event_sources:
            return error_response(ApiError(404, "This server publishes no KV events (start it with "
                                           "--kv-events-config).", "invalid_request_error", None, "not_found"))
        return JSONResponse(self.state.kv_event_sources)

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, proto.parse_chat, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, proto.parse_completion, chat=False)

    async def _serve(self, request: Request, parse: Callable[..., ParsedRequest], chat: bool) -> Response:
        try:
            self.state.check_key(request)
            engine = self.state.engine()
            parsed = parse(await read_json(request), engine.max_new_tokens_cap)
            self.state.check_model(parsed.model)
            client = self.state.client_of(request)
            if parsed.logprobs is not None and not engine.capabilities.logprobs:
                raise proto.bad_request("This server cannot give log-probabilities: its engine is a client of another "
                                        "server (remote mode) and does not pass them through.", "logprobs")
            gen = GenerationRequest(messages=parsed.messages, prompt=parsed.prompt, prompt_ids=parsed.prompt_ids,
                                    sampling=parsed.sampling, tag=API_TAG, logprobs=parsed.logprobs,
                                    prompt_logprobs=parsed.logprobs if parsed.echo else None)
            lease = self.state.take_place(client)  # 429 at the client's cap, before any work
        except Exception as exc:
            return error_response(api_error(exc))
        try:
            # Keyed by the engine for this client (tokenized once); a long prompt takes a while.
            handle = await run_in_threadpool(lambda: engine.submit(keyed_request(engine, gen, client,
                                                                                 parsed.cache_salt)))
        except Exception as exc:  # bad input here is about the prompt: name it
            lease.release()
            return error_response(api_error(exc, "messages" if chat else "prompt"))
        model = self.state.model_name or ""
        if parsed.stream:
            return StreamingResponse(released(self._stream(handle, parsed, model, chat, engine), lease),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watcher = asyncio.create_task(watch_disconnect(request, handle))
        out = Outcome()
        try:
            async for _ in deltas(handle, parsed.stop, out):
                pass
        except Exception as exc:
            return error_response(api_error(exc))
        finally:
            watcher.cancel()
            lease.release()
        if out.metrics is None:
            return error_response(ApiError(500, "The request ended without a result.", "server_error"))
        finish, use = proto.finish_reason(out.metrics, out.stopped), proto.usage(out.metrics, completion_tokens(out))
        try:
            if chat:
                logprobs = None if parsed.logprobs is None else lps.chat_logprobs(out.logprobs, engine.token_texts)
                body = proto.chat_response(proto.new_id("chatcmpl"), model, out.text, finish, use, logprobs)
            else:
                echoed = echo_text(engine, parsed)
                logprobs = None
                if parsed.logprobs is not None:
                    ids = [e.token_id for e in out.logprobs]
                    logprobs = lps.completion_logprobs(ids, out.logprobs, engine.token_texts, engine.token_pieces,
                                                       len(echoed))
                    if parsed.echo:
                        logprobs = lps.joined(prompt_logprobs(engine, handle, out), logprobs)
                body = proto.completion_response(proto.new_id("cmpl"), model, echoed + out.text, finish, use,
                                                 logprobs)
        except Exception as exc:
            return error_response(api_error(exc))
        if parsed.return_token_ids:
            body["prompt_token_ids"] = out.metrics.prompt_ids
            body["choices"][0]["token_ids"] = out.token_ids
        return SafeJSONResponse(body)

    async def _stream(self, handle: RequestHandle, parsed: ParsedRequest, model: str, chat: bool,
                      engine: TextAPI) -> AsyncIterator[bytes]:
        rid = proto.new_id("chatcmpl" if chat else "cmpl")
        usage_field = parsed.include_usage  # OpenAI sends "usage": null on every chunk but the last then
        out = Outcome()
        ids_sent = 0
        # completions with echo: the prompt goes first, in a chunk of its own (with its logprobs, once scored)
        echo_pending = parsed.echo
        trail = None if parsed.logprobs is None else lps.LogprobTrail(chat, engine.token_texts, engine.token_pieces)

        def chunk(text: str, finish: str | None = None) -> bytes:
            nonlocal ids_sent
            if chat:
                body = proto.chat_chunk(rid, model, {"content": text} if finish is None else {}, finish,
                                        with_usage_field=usage_field)
            else:
                body = proto.completion_chunk(rid, model, text, finish, with_usage_field=usage_field)
            if trail is not None and (finish is None or trail.sent < len(out.logprobs)):
                body["choices"][0]["logprobs"] = trail.part(out.logprobs)  # the tokens since the last chunk
            if parsed.return_token_ids:  # vLLM's shape: each chunk carries its new token ids
                body["choices"][0]["token_ids"] = out.token_ids[ids_sent:]
                ids_sent = len(out.token_ids)
                if finish is not None and out.metrics is not None:
                    body["prompt_token_ids"] = out.metrics.prompt_ids
            return sse(body)

        try:
            if chat:
                yield sse(proto.chat_chunk(rid, model, {"role": "assistant", "content": ""},
                                           with_usage_field=usage_field))
            if echo_pending and parsed.logprobs is None:  # nothing to wait for
                echo_pending = False
                yield sse(self._echo_chunk(rid, model, parsed, engine, handle, out, trail, usage_field))
            async for delta in deltas(handle, parsed.stop, out):
                if echo_pending and out.prompt_logprobs is not None:  # scored: before any token
                    echo_pending = False
                    yield sse(self._echo_chunk(rid, model, parsed, engine, handle, out, trail, usage_field))
                if delta:
                    yield chunk(delta)
            if out.metrics is None:
                raise ApiError(500, "The request ended without a result.", "server_error")
            yield chunk("", proto.finish_reason(out.metrics, out.stopped))
            if parsed.include_usage:
                use = proto.usage(out.metrics, completion_tokens(out))
                yield sse(proto.chat_chunk(rid, model, {}, use=use) if chat
                          else proto.completion_chunk(rid, model, "", use=use))
        except Exception as exc:  # headers are sent: report in the stream, as vLLM does
            yield sse(api_error(exc).body())
        finally:
            handle.cancel()
        yield sse("[DONE]")

    @staticmethod
    def _echo_chunk(rid: str, model: str, parsed: ParsedRequest, engine: TextAPI, handle: RequestHandle,
                    out: Outcome, trail: lps.LogprobTrail | None, usage_field: bool) -> dict:
        """The stream's first completion chunk under ``echo``: the prompt's text (and its logprobs);
        the answer's text offsets then go on after it."""
        text = echo_text(engine, parsed)
        body = proto.completion_chunk(rid, model, text, with_usage_field=usage_field)
        if trail is not None:
            body["choices"][0]["logprobs"] = prompt_logprobs(engine, handle, out)
            trail.offset = len(text)
        return body


def echo_text(engine: TextAPI, parsed: ParsedRequest) -> str:
    """The prompt as echoed (completions' ``echo``): the text given, or the ids given decoded; "" without echo."""
    if not parsed.echo:
        return ""
    return parsed.prompt if parsed.prompt is not None else engine.decode(list(parsed.prompt_ids or ()))


def prompt_logprobs(engine: TextAPI, handle: RequestHandle, out: Outcome) -> dict:
    """The echoed prompt's completion ``logprobs`` (its ids as the engine ran them), from the
    entries its prefill sent."""
    if out.prompt_logprobs is None or handle.ids is None:
        raise ApiError(500, "The prompt's log-probabilities did not come.", "server_error")
    return lps.completion_logprobs(handle.ids, out.prompt_logprobs, engine.token_texts, engine.token_pieces)


def api_routes(state: ApiState) -> list[BaseRoute]:
    """The routes to mount ahead of the page's (``FastAPI(routes=...)``, via Gradio's ``app_kwargs``)."""
    api = OpenAIApi(state)
    router = APIRouter()
    router.add_api_route("/v1/models", api.models, methods=["GET"], include_in_schema=False)
    router.add_api_route("/kv_event_sources", api.kv_event_sources, methods=["GET"], include_in_schema=False)
    router.add_api_route("/v1/chat/completions", api.chat, methods=["POST"], include_in_schema=False)
    router.add_api_route("/v1/completions", api.completions, methods=["POST"], include_in_schema=False)
    return list(router.routes)
