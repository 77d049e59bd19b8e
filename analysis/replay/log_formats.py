"""Prompt logs as people have them: one request per line, streamed, malformed lines reported.

Owns: reading a JSONL log line by line (never whole) and turning each line into
``LogRecord``s, whatever format it is in:

- ``{"messages": [{"role", "content"}, ...]}``: a chat request (chat template applied);
- ``{"prompt": "..."}``: raw text, tokenized as is;
- OpenAI Batch API request lines: ``{"custom_id", "body": {"messages": ...}}`` (or ``body.prompt``);
- ShareGPT: ``{"conversations": [{"from": "human"|"gpt"|"system", "value"}]}``: every
  user turn becomes one request holding the history before it; the reply that
  follows it in the log is kept as that request's ``response``;

with optional fields ``timestamp`` (ISO 8601 or epoch seconds), ``session`` (a
cache namespace), ``max_new_tokens`` and ``response`` (the logged answer: text a
serving engine would also have cached, since it decoded it).

Timestamps order the requests: a bounded reorder window (``window`` records)
sorts a log that is roughly in time order without loading it; a record that
comes later than that is replayed where it stands and counted as ``late``.

A malformed line raises ``LogLineError`` with its reason; ``read_log`` reports it
through ``on_skip`` (with the line number) and goes on, or stops with ``strict``.
Knows nothing about tokenizers, caches or the UI.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone

from engine.types import EngineError
from engine.validation import check_messages, flatten_content

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
                  "system": "system"}
REORDER_WINDOW = 4096
MAX_LINE_CHARS = 4_000_000


class LogLineError(EngineError):
    """One line of the log cannot be replayed; the message says why."""


@dataclass(frozen=True, slots=True)
class LogRecord:
    line: int  # 1-based line number in the log
    messages: tuple[dict, ...] | None  # exactly one of messages and prompt
    prompt: str | None
    response: str | None = None
    timestamp: float | None = None  # epoch seconds
    session: str = ""
    max_new_tokens: int | None = None
    turn: int = 0  # ShareGPT: which user turn of the conversation (0-based)
    fmt: str = "messages"  # messages | prompt | batch | sharegpt


@dataclass(frozen=True, slots=True)
class SkippedLine:
    line: int
    reason: str


def parse_line(text: str, line: int) -> list[LogRecord]:
    """The requests one log line holds (ShareGPT: one per user turn). Raises LogLineError."""
    if len(text) > MAX_LINE_CHARS:
        raise LogLineError(f"the line is {len(text):,} characters long; the limit is {MAX_LINE_CHARS:,}")
    try:
        item = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LogLineError(f"not valid JSON ({exc.msg} at character {exc.pos})") from None
    except RecursionError:
        raise LogLineError("not valid JSON (nested too deeply)") from None
    if not isinstance(item, dict):
        raise LogLineError(f"a line must be a JSON object, not {type(item).__name__}")
    common = dict(line=line, timestamp=_timestamp(item), session=_session(item))
    if "conversations" in item:
        return _sharegpt(item["conversations"], common)
    fmt = "messages"
    if "body" in item and "messages" not in item and "prompt" not in item:
        body = item["body"]
        if not isinstance(body, dict):
            raise LogLineError('"body" must be an object with "messages" (OpenAI Batch API line)')
        item, fmt = {**body, "max_new_tokens": body.get("max_completion_tokens", body.get("max_tokens"))}, "batch"
    has_messages, has_prompt = "messages" in item, "prompt" in item
    if has_messages and has_prompt:
        raise LogLineError('a line has both "messages" and "prompt"; give one')
    if not has_messages and not has_prompt:
        raise LogLineError('no request found: expected "messages", "prompt", "body" (Batch API) or '
                           '"conversations" (ShareGPT)')
    extra = dict(response=_response(item.get("response")), max_new_tokens=_max_new_tokens(item), **common)
    if has_messages:
        return [LogRecord(messages=_messages(item["messages"]), prompt=None, fmt=fmt, **extra)]
    prompt = item["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1:  # the completions API allows a list of one prompt
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise LogLineError('"prompt" must be text')
    if not prompt.strip():
        raise LogLineError("the prompt is empty")
    return [LogRecord(messages=None, prompt=prompt, fmt="prompt" if fmt == "messages" else fmt, **extra)]


def _messages(value: object) -> tuple[dict, ...]:
    try:
        return check_messages(value)
    except EngineError as exc:
        raise LogLineError(f'"messages": {str(exc)[0].lower()}{str(exc)[1:]}') from None


def _sharegpt(turns: object, common: dict) -> list[LogRecord]:
    if not isinstance(turns, list) or not turns:
        raise LogLineError('"conversations" must be a non-empty list of {"from", "value"} turns')
    history: list[dict] = []
    out: list[LogRecord] = []
    awaiting_reply = False  # the last request has no reply yet
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise LogLineError(f'"conversations" turn {i + 1} needs "from" and "value"')
        role = SHAREGPT_ROLES.get(str(turn["from"]).strip().lower())
        if role is None:
            raise LogLineError(f'"conversations" turn {i + 1}: unknown speaker {str(turn["from"])[:40]!r} '
                               f"(expected one of {', '.join(sorted(SHAREGPT_ROLES))})")
        try:
            content = flatten_content(turn["value"])
        except EngineError:
            raise LogLineError(f'"conversations" turn {i + 1}: the value must be text') from None
        if role == "assistant" and awaiting_reply:
            out[-1] = _with_response(out[-1], content)
        history.append({"role": role, "content": content})
        awaiting_reply = role == "user" and bool(content.strip())
        if awaiting_reply:
            out.append(LogRecord(messages=tuple(history), prompt=None, turn=len(out), fmt="sharegpt", **common))
    if not out:
        raise LogLineError('"conversations" has no user turn with text (speaker "human")')
    return out


def _with_response(r: LogRecord, response: str) -> LogRecord:
    return LogRecord(r.line, r.messages, r.prompt, response, r.timestamp, r.session, r.max_new_tokens, r.turn, r.fmt)


def _timestamp(item: dict) -> float | None:
    value = item.get("timestamp")
    if value is None:
        return None
    if isinstance(value, bool):
        raise LogLineError('"timestamp" must be ISO 8601 text or epoch seconds')
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise LogLineError('"timestamp" must be a finite number of seconds')
        return float(value)
    if isinstance(value, str):
        try:
            parsed = _fromisoformat(value.strip())
        except ValueError:
            try:
                return float(value)
            except ValueError:
                raise LogLineError(f'"timestamp" {value[:40]!r} is neither ISO 8601 nor epoch seconds') from None
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=timezone.utc)
        return parsed.timestamp()
    raise LogLineError('"timestamp" must be ISO 8601 text or epoch seconds')


# Python 3.10's fromisoformat (a ZeroGPU Space runs 3.10) reads only what isoformat() writes: no "Z"
# for UTC, and fractions of exactly 3 or 6 digits. 3.11 reads both; this lets 3.10 read them too.
_ISO_FRACTION = re.compile(r"(T\d{2}:\d{2}:\d{2})[.,](\d+)")


def _fromisoformat(text: str) -> datetime:
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        return datetime.fromisoformat(_iso_for_py310(text))


def _iso_for_py310(text: str) -> str:
    """`text` in the subset of ISO 8601 that 3.10's fromisoformat reads ("Z" as "+00:00", 6-digit fraction)."""
    if text.endswith("Z"):
        text = text[:-1] + "+00:00"
    return _ISO_FRACTION.sub(lambda m: f"{m.group(1)}.{(m.group(2) + '000000')[:6]}", text, count=1)


def _session(item: dict) -> str:
    value = item.get("session", "")
    if value is None:
        return ""
    if not isinstance(value, str | int):
        raise LogLineError('"session" must be text')
    return str(value)


def _max_new_tokens(item: dict) -> int | None:
    value = item.get("max_new_tokens")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LogLineError('"max_new_tokens" must be a whole number >= 0')
    return value


def _response(value: object) -> str | None:
    """The logged answer: text, or an OpenAI chat completion object (first choice)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        body = value.get("body", value)
        try:
            return flatten_content(body["choices"][0]["message"]["content"])
        except (KeyError, IndexError, TypeError, EngineError):
            return None
    return None


def read_log(lines: Iterable[str], on_skip: Callable[[SkippedLine], None] | None = None, strict: bool = False,
             order: LogOrder | None = None) -> Iterator[LogRecord]:
    """Requests of a log, in timestamp order where timestamps are given (see module docstring).

    ``lines`` is any iterable of text lines (an open file streams). Blank lines are
    ignored. Pass ``order`` to read its ``late`` count afterwards. ``strict``: the first malformed line raises LogLineError (``line N: why``).
    """
    ordering = order or LogOrder()
    for line_no, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            records = parse_line(text, line_no)
        except LogLineError as exc:
            if strict:
                raise LogLineError(f"line {line_no}: {exc}") from None
            if on_skip is not None:
                on_skip(SkippedLine(line_no, str(exc)))
            continue
        for record in records:
            yield from ordering.push(record)
    yield from ordering.drain()


class LogOrder:
    """A bounded reorder buffer by timestamp. Records without one keep their place
    (they take the last timestamp seen). ``late`` counts records that arrived after
    a later one had already been replayed (more than ``window`` records out of order)."""

    def __init__(self, window: int = REORDER_WINDOW) -> None:
        self.window = max(1, window)
        self._heap: list[tuple[float, int, LogRecord]] = []
        self._seq = itertools.count()
        self._last_seen = -math.inf
        self._last_out = -math.inf
        self.late = 0
        self.timed = False

    def push(self, record: LogRecord) -> Iterator[LogRecord]:
        if record.timestamp is not None:
            self.timed = True
            self._last_seen = record.timestamp
        heapq.heappush(self._heap, (self._last_seen, next(self._seq), record))
        while len(self._heap) > self.window:
            yield self._pop()

    def drain(self) -> Iterator[LogRecord]:
        while self._heap:
            yield self._pop()

    def _pop(self) -> LogRecord:
        key, _, record = heapq.heappop(self._heap)
        if key < self._last_out:
            self.late += 1
        self._last_out = max(self._last_out, key)
        return record


def parse_ttl(text: str) -> float:
    """``5m``, ``1h``, ``90s`` or plain seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text or "")
    if m is None or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a time-to-live: write 5m, 1h, 90s or seconds")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]
