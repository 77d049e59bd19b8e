"""Chat playground: multi-turn chat under a system prompt, streamed, with the prompt
coloured token by token (served from cache vs computed) and prefill timed with and
without reuse on the same request.

Owns the ``chat`` endpoint, the loop-guard setting shared with the few-shot panel,
and the request each panel sends (``build_request``: namespace and shareable length
set server-side). Handlers are module-level functions of the engine, testable
without building the Blocks; ``build_chat_panel`` only lays out and wires.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import gradio as gr

from components.chat_presets import CUSTOM_SYSTEM, DEFAULT_SYSTEM, STARTERS_BY_PRESET, SYSTEM_PRESETS
from components.common import (
    MODEL_NOTE,
    TOKEN_COLORS,
    highlighted_prompt,
    long_prompt_note,
    metrics_markdown,
    status_markdown,
    warn,
)
from components.format import clamp_int, plural
from components.session import ISOLATION_NOTE, RELOAD_NOTE, RUNNING, public_len, visitor_namespace
from engine.engine import Engine
from engine.types import EngineError, GenerationRequest, RequestMetrics, SamplingParams
from engine.validation import flatten_content

__all__ = ["build_chat_panel", "build_request", "chat_messages", "clamp_int", "respond", "stop_running"]

# Loop guard, on by default: chosen by reading every starter answer and few-shot preset
# on the real model (no guard, n = 3/4/5, penalty 1.1-1.3). Without it the 135M model
# repeats a sentence until the token limit; n = 4 with a 1.1 penalty ended those answers
# early and kept the few-shot JSON intact (1.3 broke its spacing).
LOOP_GUARD_NGRAM = 4
LOOP_GUARD_PENALTY = 1.1
LOOP_GUARD_LABEL = f"Loop guard: no repeated {LOOP_GUARD_NGRAM}-grams, repetition penalty {LOOP_GUARD_PENALTY}"
# Above this many prompt tokens the no-reuse measurement (a second full prefill) is skipped.
BASELINE_MAX_TOKENS = 2048
IDLE_NUMBERS = "Send a message to see what the cache served."
START_HINT = (
    "**Start here: click two of these questions, one after the other.** The second prompt repeats the long "
    "system prompt and the first exchange, so most of it is served from the cache (green below), and its "
    "prefill is several times faster."
)
CUSTOM_HINT = ("**Your own system prompt:** type it, then ask two questions one after the other. The second reuses "
               "your system prompt and the first exchange from the cache.")


def chat_messages(system: str, history: list[dict], message: str) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system.strip() else []
    for turn in history or []:
        if isinstance(turn, dict) and turn.get("role") in ("user", "assistant"):
            msgs.append({"role": turn["role"], "content": flatten_content(turn.get("content"))})
    msgs.append({"role": "user", "content": message})
    return msgs


def sampling_for(engine: Engine, max_new_tokens, loop_guard) -> SamplingParams:
    max_new = clamp_int(max_new_tokens, default=32, low=1, high=engine.max_new_tokens_cap)
    on = loop_guard is None or bool(loop_guard)  # API clients that leave it out get the default (on)
    return SamplingParams(max_new_tokens=max_new, no_repeat_ngram_size=LOOP_GUARD_NGRAM if on else 0,
                          repetition_penalty=LOOP_GUARD_PENALTY if on else 1.0)


def build_request(engine: Engine, messages: list[dict], max_new_tokens, measure_baseline,
                  request: gr.Request | None, tag: str, loop_guard=True) -> GenerationRequest:
    """Tokenize once, then set the cache namespace and shareable length server-side.
    The no-reuse measurement is left off above ``BASELINE_MAX_TOKENS`` (see ``baseline_skipped``)."""
    ids = engine.prompt_ids(GenerationRequest(messages=tuple(messages)))
    measure = bool(measure_baseline) and len(ids) <= BASELINE_MAX_TOKENS
    return GenerationRequest(prompt_ids=tuple(ids), sampling=sampling_for(engine, max_new_tokens, loop_guard),
                             measure_baseline=measure, namespace=visitor_namespace(request, engine),
                             public_len=public_len(engine, ids), tag=tag)


def baseline_skipped(asked, req: GenerationRequest) -> str | None:
    """What to tell a visitor who asked for the no-reuse measurement and did not get it."""
    if not bool(asked) or req.measure_baseline:
        return None
    return (f"No-reuse measurement skipped: the prompt is {len(req.prompt_ids):,} tokens (over "
            f"{BASELINE_MAX_TOKENS:,}), and timing it would prefill the whole prompt a second time.")


def system_text(preset_name, custom_text) -> str:
    return (custom_text or "") if preset_name == CUSTOM_SYSTEM else SYSTEM_PRESETS.get(str(preset_name), "")


def stream_request(engine: Engine, handle, request, panel: str) -> Iterator[tuple[str, str, RequestMetrics | None]]:
    """(text so far, status, final metrics or None) for each event of ``handle``, registered
    so that Stop can cancel it; ends with the metrics, or a "stopped" status if it never ran."""
    RUNNING.started(request, panel, handle)
    started = time.monotonic()
    text, got_metrics = "", False
    try:
        for event in handle:
            text = event.text
            if event.done and event.metrics is not None:
                got_metrics = True
                yield text, "", event.metrics
            else:
                yield text, status_markdown(event, time.monotonic() - started), None
    finally:
        RUNNING.finished(request, panel, handle)
    if not got_metrics and handle.cancelled.is_set():
        yield text, "**Stopped** before the request ran: nothing was computed.", None


def respond(engine: Engine, text, history, preset_name, custom_text, max_new_tokens, measure, loop_guard=True,
            request: gr.Request | None = None) -> Iterator[tuple]:
    """The chat turn: (chatbot, message box, coloured prompt, numbers, last metrics) per step."""
    history = list(history or [])
    text = text or ""
    try:
        req = build_request(engine, chat_messages(system_text(preset_name, custom_text), history, text),
                            max_new_tokens, measure, request, tag="chat", loop_guard=loop_guard)
        ahead = engine.stats().queue_depth
        handle = engine.submit(req)
        RUNNING.started(request, "chat", handle)  # Stop works from here on, even while it waits
    except EngineError as exc:
        warn(exc)
        yield history, text, gr.skip(), gr.skip(), gr.skip()
        return
    skipped = baseline_skipped(measure, req)
    history = history + [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]
    waiting = (f"*Waiting for {plural(ahead, 'request')} ahead of you…*" if ahead else
               "*Prefilling the prompt…*")
    notes = [n for n in (long_prompt_note(engine, len(req.prompt_ids)), skipped) if n]
    yield history, "", [], waiting + "".join(f"\n\n*{n}*" for n in notes), None
    shown = None
    try:
        for answer, status, metrics in stream_request(engine, handle, request, "chat"):
            history[-1] = {"role": "assistant", "content": answer}
            if metrics is not None:
                yield history, "", highlighted_prompt(engine, metrics), metrics_markdown(metrics, skipped), metrics
            else:  # the status only when it changes, not once per token
                yield history, "", gr.skip(), status if status != shown else gr.skip(), gr.skip()
                shown = status
    except EngineError as exc:
        warn(exc)
        yield history, "", gr.skip(), "*The request failed; see the message above.*", gr.skip()


def stop_running(panel: str, request: gr.Request | None = None) -> None:
    """Stop: cancel this visitor's request; its stream then ends with the partial numbers."""
    RUNNING.cancel(request, panel)


def stop_chat(request: gr.Request):
    stop_running("chat", request)


def on_preset(name: str):
    """A new system prompt starts a new chat, with starter questions that fit it."""
    is_custom = name == CUSTOM_SYSTEM
    starters = STARTERS_BY_PRESET.get(str(name), [])
    buttons = [gr.update(value=starters[i], visible=True) if i < len(starters) else gr.update(visible=False)
               for i in range(3)]
    return (gr.update(visible=is_custom), gr.update(value=SYSTEM_PRESETS.get(name, ""), visible=not is_custom),
            CUSTOM_HINT if is_custom else START_HINT, [], [], IDLE_NUMBERS, None, *buttons)


def new_chat():
    return [], "", [], IDLE_NUMBERS, None


def build_chat_panel(engine: Engine, last_metrics: gr.State) -> None:
    with gr.Row(elem_classes=["system-row"]):
        preset = gr.Dropdown(list(SYSTEM_PRESETS) + [CUSTOM_SYSTEM], value=DEFAULT_SYSTEM, label="System prompt",
                             scale=1, min_width=270, elem_classes=["system-pick"])
        custom = gr.Textbox(label="Custom system prompt", lines=3, visible=False, scale=2, placeholder="You are …")
        system_view = gr.Textbox(value=SYSTEM_PRESETS[DEFAULT_SYSTEM], label="Its text (static: cached once, "
                                 "reused by every question)", lines=3, interactive=False, max_lines=3, scale=2)
    hint = gr.Markdown(START_HINT, elem_classes=["start-hint"])
    with gr.Row(elem_classes=["starters"]):
        starters = [gr.Button(q, size="md", variant="secondary", elem_classes=["starter"])
                    for q in STARTERS_BY_PRESET[DEFAULT_SYSTEM]]
    chatbot = gr.Chatbot(label="Chat (yours only)", show_label=False, height=280, buttons=["copy"],
                         elem_classes=["chat-box"])
    with gr.Row(elem_classes=["send-row"]):
        message = gr.Textbox(placeholder="Ask something…", show_label=False, scale=1, min_width=180,
                             max_length=200_000)
        send = gr.Button("Send", variant="primary", scale=0, min_width=80)
        stop = gr.Button("Stop", variant="stop", scale=0, min_width=70)
        clear = gr.Button("New chat", scale=0, min_width=100)
    with gr.Row():  # a column each, so that they wrap on a phone instead of squeezing
        with gr.Column(min_width=220):
            baseline = gr.Checkbox(value=True, label="Measure prefill without reuse too (skipped above "
                                   f"{BASELINE_MAX_TOKENS:,} prompt tokens)")
        with gr.Column(min_width=220):
            loop_guard = gr.Checkbox(value=True, label=LOOP_GUARD_LABEL)
        with gr.Column(min_width=220):
            max_new = gr.Slider(1, engine.max_new_tokens_cap, value=min(48, engine.max_new_tokens_cap), step=1,
                                label="Max new tokens")
    numbers = gr.Markdown(IDLE_NUMBERS, elem_classes=["turn-numbers"])
    notes = ([ISOLATION_NOTE] if engine.isolation else []) + [MODEL_NOTE, RELOAD_NOTE]
    gr.Markdown("  \n".join(notes), elem_classes=["chat-notes"])
    gr.Markdown("**Your last prompt, token by token** (chat template included): green = served from the radix "
                "cache, orange = computed now")
    tokens = gr.HighlightedText(show_label=False, color_map=TOKEN_COLORS, combine_adjacent=True,
                                show_legend=True, elem_classes=["prompt-tokens"])

    preset.change(on_preset, preset, [custom, system_view, hint, chatbot, tokens, numbers, last_metrics, *starters],
                  api_visibility="private")

    def chat(text, history, preset_name, custom_text, max_new_tokens, measure, guard=True,
             request: gr.Request = None):
        yield from respond(engine, text, history, preset_name, custom_text, max_new_tokens, measure, guard, request)

    inputs = [message, chatbot, preset, custom, max_new, baseline, loop_guard]
    outputs = [chatbot, message, tokens, numbers, last_metrics]
    # The public ``chat`` endpoint keeps its six inputs (raw-protocol clients send exactly those) and
    # runs with the loop guard on; its trigger never shows. Registered first, so it owns the name.
    gr.Button(visible=False).click(chat, inputs[:-1], outputs, api_name="chat", show_progress="minimal")
    send.click(chat, inputs, outputs, api_visibility="private", show_progress="minimal")
    message.submit(chat, inputs, outputs, api_visibility="private", show_progress="minimal")
    for b in starters:
        b.click(lambda q: q, b, message, api_visibility="private").then(
            chat, inputs, outputs, api_visibility="private", show_progress="minimal")
    stop.click(stop_chat, None, None, api_visibility="private", queue=False)  # never behind a busy queue
    clear.click(new_chat, None, [chatbot, message, tokens, numbers, last_metrics], api_visibility="private")
