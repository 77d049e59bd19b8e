"""Radix Cache Playground: flags and env vars -> Engine -> build_demo(engine) -> launch.

Every flag and env var is a row of ``engine.settings.SETTINGS`` (``--help`` lists them all,
docs/CONFIG.md too); ``parse_args`` gives a checked ``AppConfig`` whose ``engine`` field is the
local engine's ``EngineConfig``."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time

from engine import settings
from engine.settings import AppConfig


def parse_args(argv: list[str] | None = None) -> AppConfig:
    """Flags, then env vars, then defaults: every setting is a row of ``engine.settings.SETTINGS``."""
    return settings.parse_args(argv)


def build_engine(args: AppConfig, runner=None):
    """The engine the flags describe (``args.engine``, its ``EngineConfig``, with the second tier's
    folder for this runner); ``runner`` (tests) skips loading ``args.model``."""
    from engine.engine import Engine
    from engine.model import plan
    from engine.model.loader import load_model
    from engine.model.runner import ModelRunner
    from engine.zerogpu.detect import SPACES, zerogpu_mode, zerogpu_model

    mode = zerogpu_mode()
    if runner is None:
        model, device, dtype, kernels = args.model, args.device, args.dtype, plan.read_settings()
        if mode == SPACES:  # a bigger model, built on the CPU with torch linears, then placed on cuda once, below
            model, device = zerogpu_model(model), "cpu"
            dtype = "bfloat16" if dtype == "auto" else dtype
            kernels = plan.for_gpu_calls(kernels)
        runner = ModelRunner(load_model(model, device=device, dtype=dtype), kernels)
    if mode == SPACES:  # ZeroGPU: the model on cuda at start, tree and pool here, one GPU call per turn
        from engine.zerogpu.runner import ZeroGPURunner, place_on_gpu

        place_on_gpu(runner)
        runner = ZeroGPURunner(runner)
    from engine.model.loader import cache_root

    tier_dir = str(cache_root() / "kv-tier") if runner.device.type == "cpu" else None  # a GPU's: host memory
    return Engine(runner, args.engine.replace(tier_dir=tier_dir))


def load_routing_lab(path: str) -> dict:
    """``--routing-lab FILE``: the report, checked (``components.views.routing_lab_report``);
    ``ValueError`` with one line saying what is wrong."""
    from components.views.routing_lab_report import MAX_BYTES, parse_report

    try:
        with open(path, "rb") as f:
            text = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"cannot read the routing-lab report {path!r}: {exc.strerror or exc}") from None
    try:
        return parse_report(text)
    except ValueError as exc:
        raise ValueError(f"{path!r} is not a routing-lab report: {exc}") from None


def build_app(engine, max_queue: int = 32, routing_lab: dict | None = None):
    """The Blocks with the queue a public page needs: at most 16 events run at once and
    ``4 * max_queue`` wait; beyond that Gradio answers "queue full", and the engine's own
    queue (``max_queue``) answers a friendly "busy" warning. On a public deployment
    (isolation) the queue is fair by address (``server.page_queue``): one address may hold
    ``share_of(max_queue)`` waiting events, in turns with everyone else's, so it cannot lock
    the others out. ``routing_lab``: a report for the Fleet tab (``load_routing_lab``)."""
    from components.demo import build_demo
    from components.page_sessions import bound_sessions
    from components.panels.hardening import harden
    from server.page_queue import fair_queue, share_of

    demo = harden(build_demo(engine, routing_lab=routing_lab))
    demo.queue(default_concurrency_limit=16, max_size=max_queue * 4)
    if engine.isolation:
        fair_queue(demo, share_of(max_queue))
    bound_sessions(demo)  # idle sessions and their state go: memory does not grow with events served
    calm_queue(demo)
    return demo


# Gradio's queue polls: its dispatch loop sleeps 1 ms when it has nothing to start (50 ms on
# Windows) and its progress loop 10 ms. In the engine's process that is over a thousand
# wake-ups a second of the event loop, each taking the GIL from the model's thread and a core
# from its OpenMP threads: measured with py-spy, the loop's thread alone used 4% of a core
# while idle. Gradio's Windows values instead: a page event starts at most 50 ms later.
QUEUE_POLL_S, PROGRESS_POLL_S = 0.05, 0.1


def calm_queue(demo) -> None:
    """Slow Gradio's queue polling (see ``QUEUE_POLL_S``) after ``demo.queue()``."""
    queue = getattr(demo, "_queue", None)
    if queue is not None and hasattr(queue, "sleep_when_free"):
        queue.sleep_when_free = max(queue.sleep_when_free, QUEUE_POLL_S)
        queue.progress_update_sleep_when_free = max(getattr(queue, "progress_update_sleep_when_free", 0.0),
                                                    PROGRESS_POLL_S)


def build_remote_engine(args: AppConfig, tokenizer=None):
    """Remote mode: the Engine facade over the server at ``args.backend``; checks the URL, key
    and model name once (``EngineError`` with one clear message when any is wrong)."""
    from engine.model.hub import load_tokenizer
    from server.remote.engine import RemoteEngine

    if tokenizer is None:
        tokenizer = load_tokenizer(args.model)
    engine = RemoteEngine(args.backend, args.backend_model, tokenizer,
                          api_key=args.backend_api_key or None, isolation=args.isolate,
                          max_queue=args.max_queue, max_prompt_tokens=args.max_prompt_tokens,
                          max_new_tokens_cap=args.max_new_tokens)
    engine.check_backend()
    fleet = args.fleet
    if fleet:  # the router's own /kv_event_sources would be one replica's: follow each replica instead
        engine.follow_fleet(fleet, args.backend_api_key or None)
    else:
        engine.follow_kv_events(args.backend_kv_events)
    return engine


def server_routes(engine, api_key: str | None = None, max_per_client: int | None = None,
                  operator_key: str | None = None, public_metrics: bool = False) -> list:
    """The HTTP routes served next to the page: the OpenAI-compatible API (with vLLM's render
    routes), ``/metrics`` and ``/health`` (remote mode: ``/metrics`` and ``/health``, the backend's;
    the backend serves its own API). ``max_per_client``: None for the deployment's default, 0 for no
    cap. Who may read ``/metrics`` and ``/kv_event_sources``: ``server.exposure``'s rule, from
    ``operator_key`` and ``public_metrics``; ``/health`` says only up or down, to anyone."""
    from server.exposure import ServerReadRule
    from server.health import health_routes
    from server.metrics import EngineMetrics, metrics_routes
    from server.openai_api import ApiState, api_routes
    from server.render import render_routes

    rule = ServerReadRule(bool(engine.isolation), operator_key or None, public_metrics)
    if engine.capabilities.remote:  # the backend serves its own API; /metrics adds what its events say
        return metrics_routes(EngineMetrics(lambda: engine), rule) + health_routes(lambda: engine)
    publisher = engine.kv_events  # the local engine's own KV-event stream (None without --kv-events-config)
    sources = {"0": publisher.config} if publisher is not None and publisher.config else None
    state = ApiState(get_engine=lambda: engine, api_key=api_key or None, max_per_client=max_per_client,
                     kv_event_sources=sources, server_read=rule)
    return (api_routes(state) + render_routes(state)  # render: the prompt's ids, for a kv_aware router
            + metrics_routes(EngineMetrics(lambda: engine), rule) + health_routes(lambda: engine))


def app_kwargs(engine, api_key: str | None = None, max_per_client: int | None = None,
               operator_key: str | None = None, public_metrics: bool = False) -> dict:
    """For ``demo.launch(app_kwargs=...)``: Gradio builds its FastAPI app with these routes
    first, so the page's catch-all routes cannot shadow them (same port as the page)."""
    return {"routes": server_routes(engine, api_key, max_per_client, operator_key, public_metrics)}


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be served (in use, not allowed, no such address), or None.
    Binds a socket the way the server will (``SO_REUSEADDR``, as uvicorn and Gradio do, so a
    port left in TIME_WAIT by the last run is free) and closes it at once."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"cannot resolve {host!r}: {exc.strerror or exc}"
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


# How long a thread may hold the GIL before one that waits for it asks for it (Python's default:
# 5 ms). The engine's compute thread spends a decode step inside C kernels that release the GIL
# and needs it back between them, while the HTTP server's threads run Python for the tokens
# already out; at 0.5 ms one float32 stream through /v1 ran 5% faster here (43.3 against 41.1
# tokens/s, two alternating pairs of runs; docs/CHANGELOG.md, sixth round).
SWITCH_INTERVAL_S = 0.0005


def tune_interpreter() -> None:
    """Serving-process settings for the local engine (``SWITCH_INTERVAL_S``)."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)


def _stop_on_sigterm() -> None:
    """A container's stop (SIGTERM) ends like Ctrl+C: the cache is written first. Once: a second
    signal while the server closes or the cache is written is ignored, never a traceback."""
    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


def main(argv: list[str] | None = None) -> int:
    from engine.zerogpu.detect import SPACES, zerogpu_mode

    if zerogpu_mode() == SPACES:
        import spaces  # noqa: F401  (ZeroGPU: before anything touches CUDA)
    args = parse_args(argv)
    if args.explain_kernels:  # no page, no port
        return _explain_kernels(args)
    # Before anything is loaded: a port that cannot be served ends here, in one line.
    problem = port_problem(args.host, args.port)
    if problem:
        print(f"error: cannot listen on {args.host}:{args.port} ({problem}); pick another with --port or "
              "GRADIO_SERVER_PORT", file=sys.stderr)
        return 1
    _stop_on_sigterm()
    try:
        return _serve(args)
    except KeyboardInterrupt:  # stopped (Ctrl+C, SIGTERM) while loading or warming: nothing to write yet
        print("Stopped.", flush=True)
        return 0


def _explain_kernels(args: AppConfig) -> int:
    """``--explain-kernels``: what runs this model's forward here, then exit (engine.model.explain)."""
    from engine.model.explain import explain
    from engine.model.hub import ModelLoadError
    from engine.model.loader import load_model
    from engine.model.runner import ModelRunner

    try:
        runner = ModelRunner(load_model(args.model, device=args.device, dtype=args.dtype))
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        print("\n".join(explain(runner)), flush=True)
    finally:
        runner.close()
    return 0


def _serve(args: AppConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    from engine.model.hub import ModelLoadError
    from engine.types import EngineError

    lab = None
    if args.routing_lab:  # checked before anything is loaded: a bad file ends here, in one line
        try:
            lab = load_routing_lab(args.routing_lab)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    if args.backend:
        print(f"Remote mode: tokenizer of {args.model!r}, backend {args.backend} ...", flush=True)
        try:
            engine = build_remote_engine(args)
        except (ModelLoadError, EngineError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"Backend ready: {engine.model} at {engine.base_url}, isolation "
              f"{'on' if engine.isolation else 'off'}", flush=True)
    else:
        print(f"Loading model {args.model!r} on device {args.device} ...", flush=True)
        tune_interpreter()
        try:
            engine = build_engine(args)
        except ModelLoadError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        info = engine.info()
        print(f"Model ready: {info.model_name} on {info.device} ({info.dtype}), KV {info.kv_bytes_per_token:,} "
              f"bytes/token, cache budget {engine.stats().budget_bytes / 2**20:.0f} MiB, isolation "
              f"{'on' if info.isolation else 'off'}; OpenAI-compatible API at /v1, metrics at /metrics", flush=True)
    from components.demo import launch_kwargs
    from components.warm_start import start_growth_curve, warm_start

    page_work = not args.backend and args.cache and not args.replica
    if page_work:
        warm_start(engine)  # shipped prompts cached before the page is served: the first question is a hit
    demo = build_app(engine, args.max_queue, routing_lab=lab)
    if page_work and args.growth_curve:
        start_growth_curve(engine)  # prefill time against cached length, measured once in the background
    elif page_work:
        print("Growth curve: not measured at start (--no-growth-curve); the Growth tab's Measure button measures it",
              flush=True)
    try:
        demo.launch(server_name=args.host, server_port=args.port, prevent_thread_lock=True,
                    **launch_kwargs(app_kwargs(engine, args.api_key, args.max_per_client, args.operator_key,
                                               args.public_metrics)))
        while demo.is_running:  # until Ctrl+C or SIGTERM, which may also come while launch() runs
            time.sleep(0.5)
    except OSError as exc:  # the port was taken between the check and now
        print(f"error: cannot listen on {args.host}:{args.port}: {str(exc).splitlines()[0][:200]}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        demo.close(verbose=False)
        written = engine.persist_cache()  # the local engine's cache on disk, for the next start
        if written is not None:
            print(f"Cache written to the second tier for the next start ({written} new chunks).", flush=True)
        engine.shutdown()  # in-flight requests cancelled, the engine's threads ended before the interpreter goes
    print("Stopped.", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
