"""Engine info: what runs behind the page (model, device, dtype, KV geometry and
cost per token, budget, context, isolation, limits)."""

from __future__ import annotations

import gradio as gr

from components.format import fmt_bytes
from components.live import LiveView
from engine.engine import Engine


def info_markdown(engine: Engine) -> str:
    i, s = engine.info(), engine.stats()
    bpt = i.kv_bytes_per_token
    return "\n".join([
        "| engine | |", "|---|---|",
        f"| model | **{i.model_name}** |",
        f"| device | {i.device} |",
        f"| dtype | {i.dtype} |",
        f"| layers · KV heads · head dim | {i.num_layers} · {i.num_kv_heads} · {i.head_dim} |",
        f"| KV cache per token | **{bpt:,} bytes** (2 × {i.num_layers} layers × {i.num_kv_heads} heads × "
        f"{i.head_dim} dims × {bpt // max(1, 2 * i.num_layers * i.num_kv_heads * i.head_dim)} bytes) |",
        f"| cache budget | **{fmt_bytes(s.budget_bytes)}** = {s.budget_bytes // max(1, bpt):,} tokens |",
        f"| context length | {i.max_context:,} tokens |",
        f"| prompt cap · new-token cap | {engine.max_prompt_tokens:,} · {engine.max_new_tokens_cap:,} tokens |",
        f"| prefix cache | {'on (radix tree)' if i.cache_enabled else 'off (--no-cache)'} |",
        f"| visitor isolation | {'on: each visitor has a private cache namespace; app presets are shared' if i.isolation else 'off: all visitors share one cache'} |",
        f"| requests waiting | {s.queue_depth} |",
    ])


def build_info_panel(engine: Engine, active: bool = False) -> LiveView:
    text = gr.Markdown(info_markdown(engine))
    gr.Markdown(
        "One worker thread runs the model, one request at a time; every request first looks up the longest "
        "cached prefix of its token ids in the radix tree, copies that KV from the pool, and prefills only the "
        "rest. After prefill the prompt is inserted; after generation, prompt plus reply, so a chat's next turn "
        "reuses the answer too. When the pool is full, unlocked leaves are evicted least recently used first.")

    def refresh():
        return info_markdown(engine)

    live = LiveView(gr.Timer(10.0, active=active), refresh, [], [text])
    live.refresh_on(live.timer.tick)
    return live
