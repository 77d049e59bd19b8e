"""vLLM's render routes: ``POST /v1/chat/completions/render`` and ``POST /v1/completions/render``.

Owns: answering "which token ids would this request's prompt be?" without running it, in vLLM's
shape (its ``GenerateRequest``: ``token_ids``, ``sampling_params``, ``model``, ...; the
completions route answers a list of one). vLLM's router asks every worker this before a
``kv_aware`` decision ("HTTP worker pools do not tokenize in the router"): with the ids it walks
each worker's blocks, as their KV events told it, and sends the request where the longest prefix
is cached. Without these routes it routes blind (its log says ``render_unavailable``).

The ids are the engine's own (``EngineAPI.prompt_ids``: the chat template and the same checks as
``submit``), so the router's blocks line up with the ones the replica publishes. A render tells the
caller only about its own request, nothing about the cache or other visitors, and is behind the
API's key like every ``/v1`` route. Knows nothing about Gradio or the KV events.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool
from starlette.routing import BaseRoute

from engine.types import GenerationRequest
from server import openai_protocol as proto
from server.openai_api import ApiState, SafeJSONResponse, api_error, error_response, read_json
from server.openai_protocol import ParsedRequest


def rendered(parsed: ParsedRequest, ids: list[int], model: str) -> dict:
    """One rendered request, as vLLM's ``GenerateRequest`` writes it (the fields a router reads)."""
    s = parsed.sampling
    return {"request_id": proto.new_id("render"), "token_ids": ids, "model": model, "stream": parsed.stream,
            "cache_salt": parsed.cache_salt,
            "sampling_params": {"max_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
                                "seed": s.seed, "stop": list(parsed.stop)}}


def render_routes(state: ApiState) -> list[BaseRoute]:
    """The two routes, sharing the API's state (key, model name, engine)."""

    async def render(request: Request, parse: Callable[..., ParsedRequest], chat: bool) -> Response:
        try:
            state.check_key(request)
            engine = state.engine()
            parsed = parse(await read_json(request), engine.max_new_tokens_cap)
            state.check_model(parsed.model)
            gen = GenerationRequest(messages=parsed.messages, prompt=parsed.prompt, prompt_ids=parsed.prompt_ids,
                                    sampling=parsed.sampling)
            ids = await run_in_threadpool(engine.prompt_ids, gen)  # a long prompt takes a while to tokenize
        except Exception as exc:
            return error_response(api_error(exc, "messages" if chat else "prompt"))
        body = rendered(parsed, list(ids), state.model_name or "")
        return SafeJSONResponse(body if chat else [body])

    async def chat(request: Request) -> Response:
        return await render(request, proto.parse_chat, chat=True)

    async def completions(request: Request) -> Response:
        return await render(request, proto.parse_completion, chat=False)

    router = APIRouter()
    router.add_api_route("/v1/chat/completions/render", chat, methods=["POST"], include_in_schema=False)
    router.add_api_route("/v1/completions/render", completions, methods=["POST"], include_in_schema=False)
    return list(router.routes)
