"""Few-shot playground: an instruction and examples (static, cached once) before a
query (per request), one query at a time or N in a row, with an option to
shuffle the examples per request and watch reuse collapse.

Owns the ``fewshot`` and ``fewshot_batch`` endpoints. The prompt layout lives
in ``components.chat_presets.few_shot_prompt``; requests go through the same
server-side namespace rules as the chat (``chat_panel.build_request``).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import gradio as gr

from components.chat_presets import FEW_SHOT_PRESETS, few_shot_prompt
from components.panels.chat_panel import LOOP_GUARD_LABEL, baseline_skipped, build_request, stop_running, stream_request
from components.panels.common import TOKEN_COLORS, highlighted_prompt, metrics_markdown, warn
from components.session import RUNNING
from components.views.chart_style import empty_figure
from components.views.charts import reuse_bars
from components.views.format import clamp_int, fmt_ms, plural, ratio_words
from engine.api import EngineAPI
from engine.types import EngineError, RequestMetrics

MAX_EXAMPLES = 64
MAX_BATCH = 16
TABLE_HEADERS = ["#", "query", "answer", "cached / prompt", "prefill", "no reuse"]
DEFAULT_PRESET = next(iter(FEW_SHOT_PRESETS))


def parse_examples(value) -> list[tuple[str, str]]:
    """Rows of (input, output) from whatever the examples table hands over:
    a pandas frame, ``{"data": rows}`` from an API client, or a list of rows.
    Rows with nothing in them are dropped; extra columns are ignored."""
    if value is None:
        return []
    if hasattr(value, "values") and hasattr(value, "columns"):  # pandas
        rows = value.values.tolist()
    elif isinstance(value, dict):
        rows = value.get("data") or []
    elif isinstance(value, list | tuple):
        rows = list(value)
    else:
        return []
    out: list[tuple[str, str]] = []
    for row in rows:
        if isinstance(row, str):
            row = [row, ""]
        if not isinstance(row, list | tuple) or not row:
            continue
        cells = ["" if c is None else str(c) for c in list(row)[:2]] + [""]
        inp, outp = cells[0].strip(), cells[1].strip()
        if inp or outp:
            out.append((inp, outp))
    return out[:MAX_EXAMPLES]


def shuffled(examples: list[tuple[str, str]], rng: random.Random) -> list[tuple[str, str]]:
    """A different order than the given one whenever one exists (so "shuffle" always shows)."""
    order = list(examples)
    if len(set(order)) < 2:
        return order
    while order == examples:
        rng.shuffle(order)
    return order


def _messages(instruction: str, examples: list[tuple[str, str]], query: str) -> list[dict]:
    return [{"role": "user", "content": few_shot_prompt(instruction or "", examples, query)}]


def _preset_rows(name: str) -> list[list[str]]:
    return [list(e) for e in FEW_SHOT_PRESETS[name]["examples"]]


def _submit(engine: EngineAPI, instr, rows, text, shuffle_on, max_new_tokens, measure, guard, request, tag,
            rng: random.Random):
    exs = parse_examples(rows)
    if shuffle_on:
        exs = shuffled(exs, rng)
    req = build_request(engine, _messages(instr, exs, text), max_new_tokens, measure, request, tag=tag,
                        loop_guard=guard)
    handle = engine.submit(req)
    RUNNING.started(request, "fewshot", handle)  # Stop works from here on, even while it waits
    return req, handle


def run_one(engine: EngineAPI, instr, rows, text, shuffle_on, max_new_tokens, measure, guard=True,
            request: gr.Request | None = None) -> Iterator[tuple]:
    """One query: (answer, coloured prompt, numbers, last metrics) per step."""
    if not (text or "").strip():
        gr.Warning("Type a query first.")
        yield gr.skip(), gr.skip(), gr.skip(), gr.skip()
        return
    try:
        req, handle = _submit(engine, instr, rows, text, shuffle_on, max_new_tokens, measure, guard, request,
                              "few-shot", random.Random())
        skipped = baseline_skipped(engine, measure, req)
        yield "", [], "*Prefilling the prompt…*", None
        shown = None
        for answer, status, metrics in stream_request(engine, handle, request, "fewshot"):
            if metrics is not None:
                yield answer, highlighted_prompt(engine, metrics), metrics_markdown(metrics, skipped), metrics
            else:  # the status only when it changes, not once per token
                yield answer, gr.skip(), status if status != shown else gr.skip(), gr.skip()
                shown = status
    except EngineError as exc:
        warn(exc)
        yield gr.skip(), gr.skip(), gr.skip(), gr.skip()


def run_batch(engine: EngineAPI, instr, rows, queries_text, n, shuffle_on, max_new_tokens, measure, guard=True,
              request: gr.Request | None = None) -> Iterator[tuple]:
    """N queries in a row: (summary, chart, table, last metrics) after each; Stop ends the run
    after cancelling the request that is running."""
    lines = [q.strip() for q in str(queries_text or "").splitlines() if q.strip()]
    if not lines:
        gr.Warning("Add at least one query (one per line).")
        yield gr.skip(), gr.skip(), gr.skip(), gr.skip()
        return
    n = clamp_int(n, default=1, low=1, high=MAX_BATCH)
    rng, done, stopped = random.Random(), [], False
    for i in range(n):
        text = lines[i % len(lines)]
        yield _batch_summary(done, n, running=text), gr.skip(), gr.skip(), gr.skip()
        try:
            _, handle = _submit(engine, instr, rows, text, shuffle_on, max_new_tokens, measure, guard, request,
                                "few-shot batch", rng)
            last = None
            for _, _, metrics in stream_request(engine, handle, request, "fewshot"):
                last = metrics or last
        except EngineError as exc:
            warn(exc)
            break
        if last is None:
            stopped = True
            break
        done.append((text, last))
        if last.finish_reason == "cancelled":
            stopped = True
            break
        yield _batch_summary(done, n), _batch_chart(done), _batch_table(done), last
    yield (_batch_summary(done, n, stopped=stopped), _batch_chart(done) if done else gr.skip(),
           _batch_table(done) if done else gr.skip(), done[-1][1] if done else gr.skip())


def stop_fewshot(request: gr.Request):
    stop_running("fewshot", request)


def on_preset(name: str):
    p = FEW_SHOT_PRESETS.get(name) or FEW_SHOT_PRESETS[DEFAULT_PRESET]
    return p["instruction"], _preset_rows(name if name in FEW_SHOT_PRESETS else DEFAULT_PRESET), \
        p["queries"][0], "\n".join(p["queries"])


def build_fewshot_panel(engine: EngineAPI, last_metrics: gr.State) -> None:
    preset0 = FEW_SHOT_PRESETS[DEFAULT_PRESET]
    with gr.Row():
        preset = gr.Dropdown(list(FEW_SHOT_PRESETS), value=DEFAULT_PRESET, label="Example set", scale=1)
        max_new = gr.Slider(1, min(128, engine.max_new_tokens_cap), value=min(16, engine.max_new_tokens_cap),
                            step=1, label="Max new tokens", scale=1)
    with gr.Row():  # a column each, so that they wrap on a phone instead of squeezing
        with gr.Column(min_width=220):
            shuffle = gr.Checkbox(value=False, label="Shuffle example order per request (breaks the shared "
                                  "prefix: watch reuse collapse)")
        with gr.Column(min_width=220):
            baseline = gr.Checkbox(value=True, label="Measure prefill without reuse too")
        with gr.Column(min_width=220):
            guard = gr.Checkbox(value=True, label=LOOP_GUARD_LABEL)
    instruction = gr.Textbox(value=preset0["instruction"], label="Instruction (static: cached once)", lines=1)
    examples = gr.Dataframe(value=_preset_rows(DEFAULT_PRESET), headers=["Input", "Output"], column_count=(2, "fixed"),
                            row_count=(len(preset0["examples"]), "dynamic"), type="array", interactive=True,
                            label="Examples (static: cached once; edit freely, add rows)", wrap=True)
    shared = [instruction, examples, shuffle, max_new, baseline, guard]
    query = _build_one_query(engine, last_metrics, preset0, shared)
    queries = _build_batch(engine, last_metrics, preset0, shared)
    preset.change(on_preset, preset, [instruction, examples, query, queries], api_visibility="private")


def _build_one_query(engine: EngineAPI, last_metrics: gr.State, preset0: dict, shared: list) -> gr.Textbox:
    """One query at a time; returns its query box (a preset fills it)."""
    instruction, examples, shuffle, max_new, baseline, guard = shared
    with gr.Row():
        query = gr.Textbox(value=preset0["queries"][0], label="Query (per request: comes last)", scale=4,
                           max_length=20_000)
        run = gr.Button("Run query", variant="primary", scale=1, min_width=100)
        stop_one = gr.Button("Stop", variant="stop", scale=0, min_width=70)
    answer = gr.Textbox(label="Model output", lines=2, interactive=False)
    numbers = gr.Markdown("Run a query to see what the cache served.", elem_classes=["turn-numbers"])
    tokens = gr.HighlightedText(show_label=False, color_map=TOKEN_COLORS, combine_adjacent=True, show_legend=True)

    def one(instr, rows, text, shuffle_on, max_new_tokens, measure, loop_guard=True, request: gr.Request = None):
        yield from run_one(engine, instr, rows, text, shuffle_on, max_new_tokens, measure, loop_guard, request)

    one_inputs = [instruction, examples, query, shuffle, max_new, baseline, guard]
    one_outputs = [answer, tokens, numbers, last_metrics]
    run.click(one, one_inputs, one_outputs, api_name="fewshot", show_progress="minimal")
    query.submit(one, one_inputs, one_outputs, api_visibility="private", show_progress="minimal")
    stop_one.click(stop_fewshot, None, None, api_visibility="private", queue=False)
    return query


def _build_batch(engine: EngineAPI, last_metrics: gr.State, preset0: dict, shared: list) -> gr.Textbox:
    """N queries in a row, with a chart and a table; returns its queries box (a preset fills it)."""
    instruction, examples, shuffle, max_new, baseline, guard = shared
    gr.Markdown("#### Run N queries: watch reuse build up, request after request")
    with gr.Row():
        queries = gr.Textbox(value="\n".join(preset0["queries"]), label="Queries (one per line; cycled)", lines=4,
                             scale=3, max_length=200_000)
        with gr.Column(scale=1, min_width=160):
            n_runs = gr.Slider(1, MAX_BATCH, value=6, step=1, label="N requests")
            run_n = gr.Button("Run N queries", variant="primary")
            stop = gr.Button("Stop", variant="stop")
    summary = gr.Markdown()
    chart = gr.Plot(empty_figure("Run N queries: one bar per request, cached vs computed", 240), show_label=False)
    table = gr.Dataframe(headers=TABLE_HEADERS, interactive=False, wrap=True, max_height=320,
                         elem_classes=["fewshot-table"])

    def batch(instr, rows, queries_text, n, shuffle_on, max_new_tokens, measure, loop_guard=True,
              request: gr.Request = None):
        yield from run_batch(engine, instr, rows, queries_text, n, shuffle_on, max_new_tokens, measure, loop_guard,
                             request)

    run_n.click(batch, [instruction, examples, queries, n_runs, shuffle, max_new, baseline, guard],
                [summary, chart, table, last_metrics], api_name="fewshot_batch", show_progress="minimal")
    stop.click(stop_fewshot, None, None, api_visibility="private", queue=False)
    return queries


def _batch_summary(done: list[tuple[str, RequestMetrics]], n: int, running: str | None = None,
                   stopped: bool = False) -> str:
    head = f"**Request {len(done) + 1} of {n} running…** ({running[:60]})\n\n" if running else ""
    if stopped:
        head = f"**Stopped** after {plural(len(done), 'request')} of {n}.\n\n"
    if not done:
        return head or "No requests ran."
    ms = [m for _, m in done]
    prompt, cached = sum(m.prompt_tokens for m in ms), sum(m.cached_tokens for m in ms)
    line = (f"**{len(ms)} request{'s' * (len(ms) != 1)}: {cached:,} of {prompt:,} prompt tokens "
            f"({cached / prompt:.0%}) served from the cache.**")
    timed = [m for m in ms if m.baseline_prefill_ms is not None]
    if timed:
        with_reuse, without = sum(m.prefill_ms for m in timed), sum(m.baseline_prefill_ms for m in timed)
        line += (f" Prefill {fmt_ms(with_reuse)} with reuse vs {fmt_ms(without)} without"
                 f" ({ratio_words(without, with_reuse)} with reuse)." if with_reuse > 0 else "")
    return head + line


def _batch_chart(done: list[tuple[str, RequestMetrics]]):
    return reuse_bars([m.cached_tokens for _, m in done], [m.computed_tokens for _, m in done],
                      labels=[q[:60] for q, _ in done])


def _batch_table(done: list[tuple[str, RequestMetrics]]) -> list[list]:
    return [[i + 1, q, m.output_text.strip(), f"{m.cached_tokens:,} / {m.prompt_tokens:,}", fmt_ms(m.prefill_ms),
             fmt_ms(m.baseline_prefill_ms)] for i, (q, m) in enumerate(done)]
