"""Engine info: what runs behind the page (model, device, dtype, KV geometry and
cost per token, budget, context, isolation, limits), and the one-line version of
it shown next to the chat (``engine_line``)."""

from __future__ import annotations

import gradio as gr

from components.panels.common import audience_of
from components.panels.live import LiveView
from components.views.format import fmt_bytes, fmt_figure
from engine.api import EngineAPI, FiguresAPI, ServingAPI
from engine.visibility import Unit, everyone


def dtype_note(dtype: str) -> str:
    """What the number format means for a visitor reading the figures."""
    if dtype == "float32":
        return "full precision: reuse gives exactly the answers a cold run gives"
    if dtype in ("bfloat16", "float16"):
        return ("half precision: faster, half the KV bytes per token; logits agree with a cold run to about "
                "5e-2, so a near-tie can pick a different greedy token")
    return ""


def engine_line(engine: ServingAPI) -> str:
    """One short line: which model runs where, in which dtype, and what a token of KV costs."""
    i = engine.info()
    return (f"Running **{i.model_name}** on {i.device} in **{i.dtype}** · KV {fmt_bytes(i.kv_bytes_per_token)} "
            f"per token")


def info_markdown(engine: EngineAPI) -> str:
    i, s = engine.info(), engine.stats()
    bpt = i.kv_bytes_per_token
    backend = i.backend
    if engine.capabilities.remote:  # remote mode (server.remote.engine)
        return "\n".join([
            "| engine (remote) | |", "|---|---|",
            f"| server | **{backend}** |",
            f"| model | **{i.model_name}** (tokenized here with the same model's tokenizer) |",
            "| device · dtype · KV geometry · memory · budget | unknown from here (the server's) |",
            f"| cached tokens reported | {_reported(engine)} |",
            f"| prompt cap · new-token cap | {engine.max_prompt_tokens:,} · {engine.max_new_tokens_cap:,} tokens |",
            f"| visitor isolation | {'on: each visitor sends a cache salt of their own' if i.isolation else 'off'} |",
            f"| requests in flight (sent, not answered yet), everyone's | "
            f"{fmt_figure(everyone(s.running, Unit.COUNT), audience_of(engine))} |",
        ] + [f"| server metric `{k}` | {v:,.4g} |" for k, v in _backend_metrics(engine).items()])
    return "\n".join([
        "| engine | |", "|---|---|",
        f"| model | **{i.model_name}** |",
        f"| device | {i.device} |",
        f"| dtype | **{i.dtype}** ({dtype_note(i.dtype)}) |" if dtype_note(i.dtype) else f"| dtype | {i.dtype} |",
        f"| layers · KV heads · head dim | {i.num_layers} · {i.num_kv_heads} · {i.head_dim} |",
        *([f"| linear layers | {i.linear_kernels} |"] if i.linear_kernels else []),
        *([f"| execution plan | `{i.plan}` (`python app.py --explain-kernels` says why) |"] if i.plan else []),
        *([f"| forward | {i.forward} |"] if i.forward else []),
        *([f"| attention | {i.attention} |"] if i.attention else []),
        *([f"| kernels' instruction set | {i.isa} |"] if i.isa else []),
        f"| KV cache per token | **{bpt:,} bytes** (2 × {i.num_layers} layers × {i.num_kv_heads} heads × "
        f"{i.head_dim} dims × {bpt // max(1, 2 * i.num_layers * i.num_kv_heads * i.head_dim)} bytes) |",
        f"| cache budget | **{fmt_bytes(s.budget_bytes)}** = {s.budget_bytes // max(1, bpt):,} tokens |",
        f"| context length | {i.max_context:,} tokens |",
        f"| prompt cap · new-token cap | {engine.max_prompt_tokens:,} · {engine.max_new_tokens_cap:,} tokens |",
        f"| prefix cache | {'on (radix tree)' if i.cache_enabled else 'off (--no-cache)'} |",
        f"| visitor isolation | {'on: each visitor has a private cache namespace; app presets are shared' if i.isolation else 'off: all visitors share one cache'} |",
        f"| requests waiting, everyone's | {fmt_figure(everyone(s.queue_depth, Unit.COUNT), audience_of(engine))} |",
    ])


def _reported(engine: ServingAPI) -> str:
    reported = engine.info().cache_reported
    if reported is None:
        return "not yet known (no request sent)"
    return "yes" if reported else ("**no**: start vLLM with `--enable-prompt-tokens-details`, SGLang with "
                                   "`--enable-cache-report`")


def _backend_metrics(engine: FiguresAPI) -> dict[str, float]:
    return engine.backend_metrics()


def eviction_sentence(engine: ServingAPI) -> str:
    """How the cache picks what to evict, as the engine's policy states it ("" when unknown)."""
    eviction = engine.info().eviction
    if not eviction:
        return ""
    return f" When the pool is full, unlocked leaves are evicted {eviction}."


def build_info_panel(engine: EngineAPI, active: bool = False) -> LiveView:
    text = gr.Markdown(info_markdown(engine))
    gr.Markdown(
        "A scheduler runs the model step by step on one thread: each step decodes one token for every running "
        "request and prefills a bounded chunk of new prompts, in one forward (continuous batching; the "
        "*Scheduler* tab shows it live). A new request first looks up the longest cached prefix of its token "
        "ids in the radix tree, copies that KV from the pool, and prefills only the rest. After prefill the "
        "prompt is inserted; after generation, prompt plus reply, so a chat's next turn reuses the answer too."
        + eviction_sentence(engine))

    def refresh():
        return info_markdown(engine)

    live = LiveView(gr.Timer(10.0, active=active), refresh, [], [text])
    live.refresh_on(live.timer.tick)
    return live
