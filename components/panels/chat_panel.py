"""Chat playground: multi-turn chat under a system prompt, streamed, with the prompt
coloured token by token (served from cache vs computed) and prefill timed with and
without reuse on the same request.

Owns the ``chat`` endpoint, the loop-guard setting shared with the few-shot panel,
and the request each panel sends (``build_request``: namespace and shareable length
set server-side). Handlers are module-level functions of the engine, testable
without building the Blocks; ``build_chat_panel`` only lays out and wires.

With a local engine, the two prefills the card compares are timed after the answer,
back to back under the same conditions (``analysis.prefill_timing``: the reuse path
and the no-reuse prefill, median of pairs); the request's own prefill inside the
batch is shown next to them as the live figure. A remote engine has no such timer:
its card compares the request with the same prompt under a fresh cache salt.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from functools import partial

import gradio as gr

from analysis.no_reuse import cutoff_tokens, no_reuse_for, skip_reason, skipped_note, with_no_reuse
from analysis.prefill_timing import timer_for
from components.chat_presets import CUSTOM_SYSTEM, STARTERS_BY_PRESET, SYSTEM_PRESETS, chat_messages
from components.panels.common import (
    MODEL_NOTE,
    TOKEN_COLORS,
    audience_of,
    highlighted_prompt,
    long_prompt_note,
    metrics_markdown,
    status_markdown,
    warn,
)
from components.session import ISOLATION_NOTE, RELOAD_NOTE, RUNNING, page_keyed
from components.views.format import clamp_int, fmt_figure
from components.views.timing_view import PENDING, turn_markdown, wants_timing
from components.warm_start import chat_default, system_tokens, warm_note
from engine.api import EngineAPI, ServingAPI
from engine.types import EngineError, GenerationEvent, GenerationRequest, RequestMetrics, SamplingParams
from engine.visibility import Unit, everyone

__all__ = ["build_chat_panel", "build_request", "chat_messages", "clamp_int", "respond", "stop_running"]

# Loop guard, on by default: chosen by reading every starter answer and few-shot preset
# on the real model (no guard, n = 3/4/5, penalty 1.1-1.3). Without it the 135M model
# repeats a sentence until the token limit; n = 4 with a 1.1 penalty ended those answers
# early and kept the few-shot JSON intact (1.3 broke its spacing).
LOOP_GUARD_NGRAM = 4
LOOP_GUARD_PENALTY = 1.1
LOOP_GUARD_LABEL = f"Loop guard: no repeated {LOOP_GUARD_NGRAM}-grams, repetition penalty {LOOP_GUARD_PENALTY}"
IDLE_NUMBERS = "Send a message to see what the cache served."
START_HINT = (
    "**Start here: click two of these questions, one after the other.** Each prompt starts with the long "
    "handbook above, already in the cache, so almost all of it is served from there (green below) and only "
    "your question is computed; the card compares that prefill with computing every token."
)
SHORT_HINT = (
    "**Click two of these questions, one after the other.** The second prompt repeats the system prompt and "
    "the first exchange, so most of it is served from the cache (green below). With a prompt this short the "
    "win is small: the long handbook shows it plainly."
)
LONG_PRESET_TOKENS = 1000  # a system prompt at least this long gets START_HINT


def start_hint(engine: EngineAPI, name: str) -> str:
    """The hint above the starters for preset ``name`` (with the warm-start sentence when there is one)."""
    text = SYSTEM_PRESETS.get(str(name), "")
    hint = START_HINT if text and system_tokens(engine, text) >= LONG_PRESET_TOKENS else SHORT_HINT
    note = warm_note(engine)
    return hint + (f"  \n{note}" if note else "")


SETTLE_S = 1.0  # between the answer and its paired timing, so the page's redraws of the answer are over
CUSTOM_HINT = ("**Your own system prompt:** type it, then ask two questions one after the other. The second reuses "
               "your system prompt and the first exchange from the cache.")


def sampling_for(engine: ServingAPI, max_new_tokens, loop_guard) -> SamplingParams:
    max_new = clamp_int(max_new_tokens, default=32, low=1, high=engine.max_new_tokens_cap)
    on = loop_guard is None or bool(loop_guard)  # API clients that leave it out get the default (on)
    return SamplingParams(max_new_tokens=max_new, no_repeat_ngram_size=LOOP_GUARD_NGRAM if on else 0,
                          repetition_penalty=LOOP_GUARD_PENALTY if on else 1.0)


def build_request(engine: EngineAPI, messages: list[dict], max_new_tokens, measure_baseline,
                  request: gr.Request | None, tag: str, loop_guard=True) -> GenerationRequest:
    """Tokenized and keyed once by the engine for this visitor (``EngineAPI.key_for``: the
    namespace and shareable length, as the warm start keys the shipped part).
    The no-reuse measurement is asked for only where ``analysis.no_reuse.skip_reason`` allows it
    (see ``baseline_skipped``)."""
    keyed = page_keyed(engine, GenerationRequest(messages=tuple(messages)), request)
    measure = bool(measure_baseline) and skip_reason(engine, len(keyed.ids)) is None
    return keyed.request(GenerationRequest(sampling=sampling_for(engine, max_new_tokens, loop_guard),
                                           measure_baseline=measure, tag=tag))


def baseline_skipped(engine: EngineAPI, asked, req: GenerationRequest) -> str | None:
    """What to tell a visitor who asked for the no-reuse measurement and did not get it
    (``analysis.no_reuse.skipped_note``: the one sentence)."""
    if not bool(asked) or req.measure_baseline:
        return None
    return skipped_note(engine, True, len(req.prompt_ids))


def system_text(preset_name, custom_text) -> str:
    """The system prompt of ``preset_name``; an unknown name (the ``/chat`` API takes any value)
    is a ``gr.Error`` naming the choices, never a silent empty system prompt."""
    if preset_name == CUSTOM_SYSTEM:
        return custom_text or ""
    if not isinstance(preset_name, str) or preset_name not in SYSTEM_PRESETS:
        choices = ", ".join(repr(n) for n in [*SYSTEM_PRESETS, CUSTOM_SYSTEM])
        raise gr.Error(f"Unknown system prompt preset {str(preset_name)[:80]!r}: choose one of {choices}.",
                       print_exception=False)
    return SYSTEM_PRESETS[preset_name]


def stream_request(engine: EngineAPI, handle, request, panel: str) -> Iterator[tuple[str, str, RequestMetrics | None]]:
    """(text so far, status, final metrics or None) for each event of ``handle``; ends with the
    metrics, or a "stopped" status if it never ran. The caller registers ``handle`` with
    ``RUNNING`` right after submitting it (so Stop works while it waits); this unregisters it.
    A request with ``measure_baseline`` on a local engine gets its no-reuse figure after the
    answer (``analysis.no_reuse``), before the metrics come out; Stop skips it."""
    started = time.monotonic()
    text, got_metrics = "", False
    try:
        for events in handle.batches():  # one redraw per batch: the page skips no text, only redraws
            last = events[-1]
            text = last.text
            if last.done and last.metrics is not None:
                got_metrics = True
                metrics = last.metrics
                if handle.request.measure_baseline and no_reuse_for(engine) is not None:
                    yield text, status_markdown(GenerationEvent(text, phase="baseline")), None
                    metrics = with_no_reuse(engine, metrics, should_stop=handle.cancelled.is_set)
                yield text, "", metrics
            else:
                yield text, status_markdown(last, time.monotonic() - started), None
    finally:
        RUNNING.finished(request, panel, handle)
    if not got_metrics and handle.cancelled.is_set():
        yield text, "**Stopped** before the request ran: nothing was computed.", None


def gpu_call_note(engine: ServingAPI) -> str:
    """On ZeroGPU: why an answer may pause, and what it costs the visitor ("" elsewhere)."""
    if not engine.capabilities.gpu_calls:
        return ""
    return ("On ZeroGPU this answer runs in one GPU call, charged to your own daily GPU quota (a few seconds a "
            "question); a pause before the first token is the call waiting in ZeroGPU's queue for a GPU.")


def respond(engine: EngineAPI, text, history, preset_name, custom_text, max_new_tokens, measure, loop_guard=True,
            request: gr.Request | None = None) -> Iterator[tuple]:
    """The chat turn: (chatbot, message box, coloured prompt, numbers, last metrics, last timing) per step.

    With a local engine and ``measure`` on, the answer is followed by the paired timing
    (``analysis.prefill_timing``, whose no-reuse side is ``analysis.no_reuse``'s one measurement)
    and the card compares those two numbers; the request itself asks for no after-answer figure,
    which the paired timing replaces. A remote engine answers ``measure_baseline`` its own way."""
    history = list(history or [])
    text = text or ""
    timer = timer_for(engine) if measure else None
    try:
        req = build_request(engine, chat_messages(system_text(preset_name, custom_text), history, text),
                            max_new_tokens, measure and timer is None, request, tag="chat", loop_guard=loop_guard)
        ahead = everyone(engine.stats().queue_depth, Unit.COUNT)  # everyone's requests: coarse on a public page
        handle = engine.submit(req)
        RUNNING.started(request, "chat", handle)  # Stop works from here on, even while it waits
    except EngineError as exc:
        warn(exc)
        yield history, text, gr.skip(), gr.skip(), gr.skip(), gr.skip()
        return
    skipped = baseline_skipped(engine, measure, req) if timer is None else None
    history = history + [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]
    waiting = (f"*Waiting for {fmt_figure(ahead, audience_of(engine))} request(s) ahead of you…*" if ahead.value else
               "*Prefilling the prompt…*")
    notes = [n for n in (long_prompt_note(engine, len(req.prompt_ids)), skipped, gpu_call_note(engine)) if n]
    yield history, "", [], waiting + "".join(f"\n\n*{n}*" for n in notes), None, None
    shown, final = None, None
    try:
        for answer, status, metrics in stream_request(engine, handle, request, "chat"):
            history[-1] = {"role": "assistant", "content": answer}
            if metrics is not None:
                final = metrics
                if timer is not None and wants_timing(metrics):
                    # The side cards and the tree show this answer at once, the speed card says the
                    # timing is under way; the timing starts after SETTLE_S, once those redraws are done.
                    yield (history, "", highlighted_prompt(engine, metrics), turn_markdown(metrics, None, running=True),
                           metrics, (metrics.request_id, PENDING))
                    continue
                numbers = turn_markdown(metrics, None) if timer is not None else metrics_markdown(metrics, skipped)
                yield history, "", highlighted_prompt(engine, metrics), numbers, metrics, None
            else:  # the status only when it changes, not once per token
                yield history, "", gr.skip(), status if status != shown else gr.skip(), gr.skip(), gr.skip()
                shown = status
    except EngineError as exc:
        warn(exc)
        yield history, "", gr.skip(), "*The request failed; see the message above.*", gr.skip(), gr.skip()
        return
    if timer is None or final is None or not wants_timing(final):
        return
    time.sleep(SETTLE_S)  # the page draws the answer first
    try:
        timing = timer.time_request(final.request_id, engine.cache_key(list(req.prompt_ids), req),
                                    final.cached_tokens)
    except EngineError as exc:
        warn(exc)
        yield history, "", gr.skip(), turn_markdown(final, None), final, None
        return
    # Every output again (not skips): an API client's result is the last message.
    yield history, "", highlighted_prompt(engine, final), turn_markdown(final, timing), final, (final.request_id, timing)


def stop_running(panel: str, request: gr.Request | None = None) -> None:
    """Stop: cancel this visitor's request; its stream then ends with the partial numbers."""
    RUNNING.cancel(request, panel)


def stop_chat(request: gr.Request):
    stop_running("chat", request)


def on_preset(engine: EngineAPI, name: str):
    """A new system prompt starts a new chat, with starter questions that fit it."""
    is_custom = name == CUSTOM_SYSTEM
    starters = STARTERS_BY_PRESET.get(str(name), [])
    buttons = [gr.update(value=starters[i], visible=True) if i < len(starters) else gr.update(visible=False)
               for i in range(3)]
    return (gr.update(visible=is_custom), gr.update(value=SYSTEM_PRESETS.get(name, ""), visible=not is_custom),
            CUSTOM_HINT if is_custom else start_hint(engine, name), [], [], IDLE_NUMBERS, None, None, *buttons)


def new_chat():
    return [], "", [], IDLE_NUMBERS, None, None


def build_chat_panel(engine: EngineAPI, last_metrics: gr.State, last_timing: gr.State | None = None) -> None:
    """``last_timing`` holds this visitor's last ``(request_id, PrefillTiming)`` (the side card reads it)."""
    last_timing = last_timing if last_timing is not None else gr.State(None)
    first = chat_default(engine)
    timed = timer_for(engine) is not None
    cutoff = cutoff_tokens(engine)
    with gr.Row(elem_classes=["system-row"]):
        preset = gr.Dropdown(list(SYSTEM_PRESETS) + [CUSTOM_SYSTEM], value=first, label="System prompt",
                             scale=1, min_width=270, elem_classes=["system-pick"])
        custom = gr.Textbox(label="Custom system prompt", lines=3, visible=False, scale=2, placeholder="You are …")
        system_view = gr.Textbox(value=SYSTEM_PRESETS[first], label="Its text (static: cached once, "
                                 "reused by every question)", lines=3, interactive=False, max_lines=3, scale=2)
    hint = gr.Markdown(start_hint(engine, first), elem_classes=["start-hint"])
    with gr.Row(elem_classes=["starters"]):
        starters = [gr.Button(q, size="md", variant="secondary", elem_classes=["starter"])
                    for q in STARTERS_BY_PRESET[first]]
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
            baseline = gr.Checkbox(value=True, label=(
                "After each answer, time prefill with and without reuse, back to back (median of pairs)" if timed
                else "Measure prefill without reuse too" + (f" (skipped above {cutoff:,} prompt tokens)" if cutoff else "")))
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

    preset.change(partial(on_preset, engine), preset,
                  [custom, system_view, hint, chatbot, tokens, numbers, last_metrics, last_timing, *starters],
                  api_visibility="private")

    def chat(text, history, preset_name, custom_text, max_new_tokens, measure, guard=True,
             request: gr.Request = None):
        yield from respond(engine, text, history, preset_name, custom_text, max_new_tokens, measure, guard, request)

    inputs = [message, chatbot, preset, custom, max_new, baseline, loop_guard]
    outputs = [chatbot, message, tokens, numbers, last_metrics, last_timing]
    # The public ``chat`` endpoint keeps its six inputs (raw-protocol clients send exactly those) and
    # runs with the loop guard on; its trigger never shows. Registered first, so it owns the name.
    gr.Button(visible=False).click(chat, inputs[:-1], outputs, api_name="chat", show_progress="minimal")
    send.click(chat, inputs, outputs, api_visibility="private", show_progress="minimal")
    message.submit(chat, inputs, outputs, api_visibility="private", show_progress="minimal")
    for b in starters:
        b.click(lambda q: q, b, message, api_visibility="private").then(
            chat, inputs, outputs, api_visibility="private", show_progress="minimal")
    stop.click(stop_chat, None, None, api_visibility="private", queue=False)  # never behind a busy queue
    clear.click(new_chat, None, [chatbot, message, tokens, numbers, last_metrics, last_timing],
                api_visibility="private")
