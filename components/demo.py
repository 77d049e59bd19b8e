"""The whole app: a title, a two-line story, and one tab per panel, all on one shared engine."""

from __future__ import annotations

import gradio as gr

from components.chat_panel import build_chat_panel
from engine.engine import Engine

TITLE = "Radix Cache Playground"
STORY = (
    "Every prompt you send runs on a real LLM whose KV cache lives in a **radix tree**: any prefix that an earlier "
    "request already computed is **served from the cache** instead of being prefilled again (SGLang's "
    "RadixAttention).  \nPut **static content first and per-request content last**, and watch prefill get several "
    "times faster; get the order wrong and the cache can't help."
)

CSS = """
.gradio-container {max-width: 1400px !important}
#story {font-size: 1.02rem}
"""


def launch_kwargs() -> dict:
    """Settings for ``demo.launch``: theme and CSS go here in Gradio 6, not to Blocks."""
    return dict(theme=gr.themes.Soft(), css=CSS, show_error=False, footer_links=[])


def build_demo(engine: Engine) -> gr.Blocks:
    with gr.Blocks(title=TITLE) as demo:
        gr.Markdown(f"# {TITLE}")
        gr.Markdown(STORY, elem_id="story")
        last_metrics = gr.State(None)
        with gr.Tabs():
            with gr.Tab("Chat"):
                build_chat_panel(engine, last_metrics)
    return demo
