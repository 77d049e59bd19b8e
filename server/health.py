"""``GET /health``: whether this server takes requests, as vLLM answers it.

Owns: the health route a router or an orchestrator polls before it sends work (vLLM's router
waits at start until every worker's ``/health`` answers 200). The answer is vLLM's: 200 with an
empty body while the engine takes requests, 503 with an empty body while it loads, after it was
closed, or when its worker is gone (``EngineAPI.healthy``). In remote mode it is the backend's
own health (``RemoteEngine.healthy``), so a router in front of dashboards drops one whose backend
went away. The body is always empty: it tells nobody anything about other visitors, so it needs
no key and no operator rule. Knows nothing about Gradio, the page or the API's requests.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool
from starlette.routing import BaseRoute, Route

from engine.api import ServingAPI


def health_routes(get_engine: Callable[[], ServingAPI | None]) -> list[BaseRoute]:
    """The route to mount beside the API's (``app.server_routes``)."""

    async def health(request: Request) -> Response:
        engine = get_engine()
        # In a thread: a remote engine asks its backend (bounded by a short timeout).
        up = engine is not None and await run_in_threadpool(engine.healthy)
        return Response(status_code=200 if up else 503)

    return [Route("/health", health, methods=["GET"], include_in_schema=False)]
