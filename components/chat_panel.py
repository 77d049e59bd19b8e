"""Chat playground: multi-turn chat under a system prompt, streamed, with the prompt
coloured token by token (served from cache vs computed) and prefill timed with and
without reuse on the same request."""

from __future__ import annotations

import gradio as gr

from components.chat_presets import CUSTOM_SYSTEM, DEFAULT_SYSTEM, STARTER_QUESTIONS, SYSTEM_PRESETS
from components.common import TOKEN_COLORS, highlighted_prompt, metrics_markdown, warn
from components.session import public_len, visitor_namespace
from engine.engine import Engine
from engine.types import EngineError, GenerationRequest, SamplingParams
from engine.validation import flatten_content


def chat_messages(system: str, history: list[dict], message: str) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system.strip() else []
    for turn in history or []:
        if isinstance(turn, dict) and turn.get("role") in ("user", "assistant"):
            msgs.append({"role": turn["role"], "content": flatten_content(turn.get("content"))})
    msgs.append({"role": "user", "content": message})
    return msgs


def clamp_int(value, default: int, low: int, high: int) -> int:
    """A slider's value as an int in [low, high]; junk from an API client becomes ``default``."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return default
    if number != number:  # NaN
        return default
    return int(max(low, min(high, number)))


def build_request(engine: Engine, messages: list[dict], max_new_tokens: int, measure_baseline: bool,
                  request: gr.Request | None, tag: str) -> GenerationRequest:
    """Tokenize once, then set the cache namespace and shareable length server-side."""
    ids = engine.prompt_ids(GenerationRequest(messages=tuple(messages)))
    max_new = clamp_int(max_new_tokens, default=32, low=1, high=engine.max_new_tokens_cap)
    return GenerationRequest(prompt_ids=tuple(ids), sampling=SamplingParams(max_new_tokens=max_new),
                             measure_baseline=bool(measure_baseline), namespace=visitor_namespace(request, engine),
                             public_len=public_len(engine, ids), tag=tag)


START_HINT = (
    "**Start here: click two of these questions, one after the other.** The second prompt repeats the long "
    "system prompt and the first exchange, so most of it is served from the cache (green below), and its "
    "prefill is several times faster."
)


def build_chat_panel(engine: Engine, last_metrics: gr.State) -> None:
    with gr.Row():
        preset = gr.Dropdown(list(SYSTEM_PRESETS) + [CUSTOM_SYSTEM], value=DEFAULT_SYSTEM, label="System prompt",
                             scale=1, min_width=180)
        custom = gr.Textbox(label="Custom system prompt", lines=3, visible=False, scale=2,
                            placeholder="You are …")
        system_view = gr.Textbox(value=SYSTEM_PRESETS[DEFAULT_SYSTEM], label="Its text (static: cached once, "
                                 "reused by every question)", lines=3, interactive=False, max_lines=3, scale=2)
    gr.Markdown(START_HINT, elem_classes=["start-hint"])
    with gr.Row(elem_classes=["starters"]):
        starters = [gr.Button(q, size="md", variant="secondary", elem_classes=["starter"]) for q in STARTER_QUESTIONS]
    chatbot = gr.Chatbot(label="Chat (yours only: other visitors have their own)", height=280, buttons=["copy"])
    with gr.Row():
        message = gr.Textbox(placeholder="Ask something, or click a starter question above", show_label=False,
                             scale=1, max_length=200_000)
        send = gr.Button("Send", variant="primary", scale=0, min_width=90)
        stop = gr.Button("Stop", variant="stop", scale=0, min_width=80)
        clear = gr.Button("New chat", scale=0, min_width=120)
    with gr.Row():
        baseline = gr.Checkbox(value=True, label="Measure prefill without reuse too (turn off for long prompts)")
        max_new = gr.Slider(1, engine.max_new_tokens_cap, value=min(48, engine.max_new_tokens_cap), step=1,
                            label="Max new tokens")
    numbers = gr.Markdown("Send a message to see what the cache served.", elem_classes=["turn-numbers"])
    gr.Markdown("**Your last prompt, token by token** (chat template included): green = served from the radix "
                "cache, orange = computed now")
    tokens = gr.HighlightedText(show_label=False, color_map=TOKEN_COLORS, combine_adjacent=True,
                                show_legend=True, elem_classes=["prompt-tokens"])

    def on_preset(name: str):
        is_custom = name == CUSTOM_SYSTEM
        return gr.update(visible=is_custom), gr.update(value=SYSTEM_PRESETS.get(name, ""), visible=not is_custom)

    preset.change(on_preset, preset, [custom, system_view], api_visibility="private")

    def respond(text, history, preset_name, custom_text, max_new_tokens, measure, request: gr.Request):
        history = list(history or [])
        text = (text or "")
        system = custom_text if preset_name == CUSTOM_SYSTEM else SYSTEM_PRESETS.get(preset_name, "")
        try:
            req = build_request(engine, chat_messages(system or "", history, text), max_new_tokens, measure,
                                request, tag="chat")
            handle = engine.submit(req)
        except EngineError as exc:
            warn(exc)
            yield history, text, gr.skip(), gr.skip(), gr.skip()
            return
        history = history + [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]
        yield history, "", gr.skip(), "*Thinking… (prefilling the prompt)*", gr.skip()
        try:
            for event in handle:
                history[-1] = {"role": "assistant", "content": event.text}
                if event.done and event.metrics is not None:
                    m = event.metrics
                    yield history, "", highlighted_prompt(engine, m), metrics_markdown(m), m
                else:
                    yield history, "", gr.skip(), gr.skip(), gr.skip()
        except EngineError as exc:
            warn(exc)
            yield history, "", gr.skip(), gr.skip(), gr.skip()

    inputs = [message, chatbot, preset, custom, max_new, baseline]
    outputs = [chatbot, message, tokens, numbers, last_metrics]
    ev_send = send.click(respond, inputs, outputs, api_name="chat", show_progress="minimal")
    ev_submit = message.submit(respond, inputs, outputs, api_visibility="private", show_progress="minimal")
    starter_events = [
        b.click(lambda q=b.value: q, None, message, api_visibility="private").then(
            respond, inputs, outputs, api_visibility="private", show_progress="minimal")
        for b in starters]
    stop.click(None, None, None, cancels=[ev_send, ev_submit, *starter_events], api_visibility="private")
    clear.click(lambda: ([], "", None, "Send a message to see what the cache served."), None,
                [chatbot, message, tokens, numbers], api_visibility="private")
