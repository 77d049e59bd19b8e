"""The OpenAI wire format, both ways: request bodies in, response bodies and stream chunks out.

Owns: reading ``/v1/chat/completions`` and ``/v1/completions`` bodies into plain
``ParsedRequest``s (every field checked, errors as ``ApiError`` with the offending
``param``), the shapes of responses, stream chunks, usage and errors, and stop strings
(``StopMatcher``). Pure functions over dicts: knows nothing about HTTP frameworks, the
engine's threads or the model.
"""

from __future__ import annotations

import math
import operator
import time
import uuid
from dataclasses import dataclass
from typing import Any

from engine.types import RequestMetrics, SamplingParams

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 200
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI (the engine's own cap: validation.MAX_LOGPROBS)
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs, as OpenAI


class ApiError(Exception):
    """A request the API refuses; ``body()`` is OpenAI's error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


@dataclass(frozen=True)
class ParsedRequest:
    """One API request, checked. Exactly one of ``messages``, ``prompt``, ``prompt_ids``."""

    model: str | None
    messages: tuple[dict, ...] | None
    prompt: str | None
    prompt_ids: tuple[int, ...] | None
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    cache_salt: str | None
    return_token_ids: bool = False  # vLLM's extra: prompt and output token ids in the response
    # Alternatives per generated token whose log-probabilities the client asked for (chat's
    # ``logprobs: true`` with ``top_logprobs``, completions' ``logprobs``); None: no logprobs.
    logprobs: int | None = None
    echo: bool = False  # completions: the prompt comes first in the text (and in the logprobs, where asked)


# ------------------------------------------------------------------ reading bodies
def _plain(x: float) -> str:
    """A bound as a person reads it: 2147483648, not 2.14748e+09; 0.01 stays 0.01."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _number(body: dict, name: str, default: float | None, low: float, high: float,
            integer: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a number, not {str(value)[:40]!r}.", name)
    if integer and not float(value).is_integer():
        raise bad_request(f"'{name}' must be a whole number, not {value!r}.", name)
    if not low <= value <= high:
        raise bad_request(f"'{name}' must be from {_plain(low)} to {_plain(high)}; got {value!r}.", name)
    return int(value) if integer else float(value)


def _flag(body: dict, name: str, strict: bool = False) -> bool:
    """An optional true/false parameter (absent or null: false); ``strict``: 1 and 0 are not booleans."""
    value = body.get(name)
    if value not in (None, True, False) or (strict and value is not None and not isinstance(value, bool)):
        raise bad_request(f"'{name}' must be true or false.", name)
    return bool(value)


def _unsupported(body: dict, name: str, allowed: tuple = (None, False, 0, 0.0, 1)) -> None:
    if body.get(name) not in allowed:
        raise bad_request(f"'{name}' is not supported by this server.", name)


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("'stop' must be a string or a list of strings.", "stop")
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_request(f"'stop' takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                          "characters.", "stop")
    return tuple(s for s in stops if s)


def _common(body: Any, max_new_tokens_cap: int) -> dict:
    """The fields chat and completions share."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string.", "model")
    if body.get("n") not in (None, 1):
        raise bad_request("'n' must be 1: this server returns one choice per request.", "n")
    _unsupported(body, "best_of", (None, 1))
    for name in ("frequency_penalty", "presence_penalty"):
        _unsupported(body, name, (None, 0, 0.0))
    if body.get("suffix") not in (None, ""):
        raise bad_request("'suffix' is not supported by this server.", "suffix")
    limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    asked = body.get(limit_name)
    if isinstance(asked, int | float) and not isinstance(asked, bool) and math.isfinite(asked) \
            and asked > max_new_tokens_cap:
        raise bad_request(f"'{limit_name}' is {asked:,}; this server allows at most {max_new_tokens_cap:,} "
                          "new tokens per request.", limit_name)
    max_tokens = _number(body, limit_name, max_new_tokens_cap, 1, max_new_tokens_cap, integer=True)
    seed = _number(body, "seed", None, 0, 2**63 - 1, integer=True)
    sampling = SamplingParams(
        max_new_tokens=int(max_tokens), temperature=_number(body, "temperature", 1.0, 0, 2),
        top_p=_number(body, "top_p", 1.0, 0, 1), seed=None if seed is None else int(seed),
        no_repeat_ngram_size=int(_number(body, "no_repeat_ngram_size", 0, 0, 64, integer=True)),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.01, 10),
        ignore_eos=_flag(body, "ignore_eos"))
    if sampling.top_p <= 0:
        raise bad_request("'top_p' must be above 0.", "top_p")
    stream = body.get("stream", False)
    if not isinstance(stream, bool | None):
        raise bad_request("'stream' must be true or false.", "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise bad_request("'stream_options' must be an object, and only goes with 'stream': true.",
                          "stream_options")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > 256):
        raise bad_request("'cache_salt' must be a non-empty string of at most 256 characters.", "cache_salt")
    token_ids = _flag(body, "return_token_ids")
    return dict(model=model, sampling=sampling, stream=bool(stream),
                include_usage=bool((options or {}).get("include_usage")), stop=_stop(body), cache_salt=salt,
                return_token_ids=token_ids)


def _whole(body: dict, name: str, high: int, what: str) -> int | None:
    """An optional whole number from 0 to ``high`` (absent or null: None)."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not float(value).is_integer() \
            or not 0 <= value <= high:
        raise bad_request(f"'{name}' must be a whole number from 0 to {high} ({what}); got {str(value)[:40]!r}.",
                          name)
    return int(value)


def _chat_logprobs(body: dict) -> int | None:
    """Chat's ``logprobs`` (true or false) and ``top_logprobs`` (0 to 20, only with ``logprobs``)."""
    if body.get("echo") not in (None, False):
        raise bad_request("'echo' is not supported on /v1/chat/completions (it is a /v1/completions parameter).",
                          "echo")
    wanted = _flag(body, "logprobs", strict=True)
    top = _whole(body, "top_logprobs", MAX_TOP_LOGPROBS, "the most likely tokens shown at each position")
    if top is not None and not wanted:
        raise bad_request("'top_logprobs' needs 'logprobs': true.", "top_logprobs")
    return (top or 0) if wanted else None


def _completion_logprobs(body: dict) -> tuple[int | None, bool]:
    """Completions' ``logprobs`` (0 to 5: the most likely tokens shown besides the chosen one) and ``echo``."""
    if body.get("top_logprobs") is not None:
        raise bad_request("'top_logprobs' is a /v1/chat/completions parameter; on /v1/completions give "
                          f"'logprobs' a number from 0 to {MAX_COMPLETION_LOGPROBS}.", "top_logprobs")
    return (_whole(body, "logprobs", MAX_COMPLETION_LOGPROBS, "the most likely tokens shown at each position"),
            _flag(body, "echo", strict=True))


def parse_chat(body: Any, max_new_tokens_cap: int) -> ParsedRequest:
    common = _common(body, max_new_tokens_cap)
    common["logprobs"] = _chat_logprobs(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of {role, content} objects.", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a 'role' and a 'content'.", "messages")
        content = m.get("content")
        if isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str)
                   for p in content):
                raise bad_request(f"messages[{i}]: only text content parts are supported.", "messages")
            content = "".join(p["text"] for p in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts.", "messages")
        out.append({"role": m["role"], "content": content})
    return ParsedRequest(messages=tuple(out), prompt=None, prompt_ids=None, **common)


def parse_completion(body: Any, max_new_tokens_cap: int) -> ParsedRequest:
    common = _common(body, max_new_tokens_cap)
    common["logprobs"], common["echo"] = _completion_logprobs(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return ParsedRequest(messages=None, prompt=prompt, prompt_ids=None, **common)
    if isinstance(prompt, list) and prompt and not any(isinstance(i, bool) for i in prompt):
        try:
            ids = tuple(operator.index(i) for i in prompt)
        except TypeError:
            ids = None
        if ids is not None:
            return ParsedRequest(messages=None, prompt=None, prompt_ids=ids, **common)
    raise bad_request("'prompt' must be a string, or a list of token ids (one prompt per request).", "prompt")


# ------------------------------------------------------------------ stop strings
class StopMatcher:
    """Cuts the output at the first stop string. ``visible(text)`` is what may be sent so far:
    the text before a stop string once one appears, else the text minus any tail that could
    still grow into one (so a stream never shows a stop string's first characters)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.stopped = False

    def visible(self, text: str, final: bool = False) -> str:
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return text[:cut]
        if final or not self.stops:
            return text
        hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return text[: len(text) - hold]


# ------------------------------------------------------------------ writing bodies
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now_s() -> int:
    return int(time.time())


STARTED_S = now_s()


def usage(m: RequestMetrics, completion_tokens: int) -> dict:
    """Token counts as OpenAI and vLLM report them, with ``prompt_tokens_details.cached_tokens``.

    ``completion_tokens`` is what the client got (the tokens up to and including the one that
    completed a stop string), not ``m.output_tokens``: after a stop string the engine may
    generate a token or two more before it sees the cancel, and those were never returned."""
    return {"prompt_tokens": m.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": m.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": m.cached_tokens}}


def finish_reason(m: RequestMetrics, stopped: bool) -> str:
    return "stop" if stopped or m.finish_reason != "length" else "length"


def chat_response(rid: str, model: str, text: str, finish: str, use: dict, logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion", "created": now_s(), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                         "finish_reason": finish}], "usage": use}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None = None, use: dict | None = None,
               with_usage_field: bool = False) -> dict:
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": now_s(), "model": model,
             "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    if use is not None:
        chunk["choices"] = []
    if use is not None or with_usage_field:
        chunk["usage"] = use
    return chunk


def completion_response(rid: str, model: str, text: str, finish: str, use: dict,
                        logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": now_s(), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}], "usage": use}


def completion_chunk(rid: str, model: str, text: str, finish: str | None = None, use: dict | None = None,
                     with_usage_field: bool = False) -> dict:
    chunk = {"id": rid, "object": "text_completion", "created": now_s(), "model": model,
             "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    if use is not None:
        chunk["choices"] = []
    if use is not None or with_usage_field:
        chunk["usage"] = use
    return chunk


def models_list(model: str, owned_by: str = "radix-cache-playground") -> dict:
    # ``created``: when this process started serving, the same on every call (nothing moves with traffic)
    return {"object": "list", "data": [{"id": model, "object": "model", "created": STARTED_S, "owned_by": owned_by}]}
