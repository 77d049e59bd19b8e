"""What a serving engine reports about one request, read from its response body or stream chunks.

Owns: finding the cached-token count wherever an engine puts it, and saying plainly when it
is not there (``cached_tokens is None``):

- OpenAI and vLLM: ``usage.prompt_tokens_details.cached_tokens`` (vLLM needs
  ``--enable-prompt-tokens-details``; without it ``prompt_tokens_details`` is null);
- SGLang's OpenAI routes: the same field, with ``--enable-cache-report``;
- SGLang's native ``/generate``: ``meta_info.cached_tokens`` (with ``prompt_tokens``, ``completion_tokens``);
- llama.cpp's server: ``timings.cache_n`` (prompt tokens taken from the slot's cache).

Also reads a chunk's text, finish reason and token ids. Pure functions over parsed JSON;
knows nothing about HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BackendUsage:
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None  # None: the engine did not report it


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def parse_usage(body: object) -> BackendUsage | None:
    """The usage a response body or stream chunk carries; ``None`` when it carries none."""
    if not isinstance(body, dict):
        return None
    usage, meta, timings = body.get("usage"), body.get("meta_info"), body.get("timings")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
        if cached is None and isinstance(timings, dict):
            cached = _int(timings.get("cache_n"))
        return BackendUsage(_int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens")), cached)
    if isinstance(meta, dict):
        return BackendUsage(_int(meta.get("prompt_tokens")), _int(meta.get("completion_tokens")),
                            _int(meta.get("cached_tokens")))
    if isinstance(timings, dict) and _int(timings.get("cache_n")) is not None:
        return BackendUsage(_int(timings.get("prompt_n")), _int(timings.get("predicted_n")),
                            _int(timings.get("cache_n")))
    return None


@dataclass(frozen=True)
class ChunkDelta:
    text: str
    finish_reason: str | None
    token_ids: tuple[int, ...]
    # The chosen tokens' log-probabilities, where the request asked (OpenAI completions' shape:
    # ``logprobs.token_logprobs``; chat's ``logprobs.content[].logprob``); None where absent.
    logprobs: tuple[float, ...] | None = None


def parse_choice(body: object) -> ChunkDelta | None:
    """The first choice of a completion (or chat) body or chunk; ``None`` when it has none."""
    if not isinstance(body, dict):
        return None
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        if isinstance(body.get("text"), str) and isinstance(body.get("meta_info"), dict):  # SGLang /generate
            finish = body["meta_info"].get("finish_reason")
            reason = finish.get("type") if isinstance(finish, dict) else finish
            ids = body.get("output_ids") or ()
            return ChunkDelta(body["text"], reason if isinstance(reason, str) else None,
                              tuple(i for i in ids if _int(i) is not None))
        return None
    choice = choices[0]
    text = choice.get("text")
    if text is None:
        holder = choice.get("delta") or choice.get("message") or {}
        text = holder.get("content") if isinstance(holder, dict) else None
    ids = choice.get("token_ids")
    token_ids = tuple(i for i in ids if _int(i) is not None) if isinstance(ids, list) else ()
    finish = choice.get("finish_reason")
    return ChunkDelta(text if isinstance(text, str) else "", finish if isinstance(finish, str) else None, token_ids,
                      _chosen_logprobs(choice.get("logprobs")))


def _chosen_logprobs(block: object) -> tuple[float, ...] | None:
    """The chosen tokens' logprobs of one choice's ``logprobs`` (completions or chat shape); None
    when there are none or one is not a number (a server's ``null`` for a prompt's first token)."""
    if not isinstance(block, dict):
        return None
    values = block.get("token_logprobs")
    if values is None and isinstance(block.get("content"), list):
        values = [c.get("logprob") if isinstance(c, dict) else None for c in block["content"]]
    if not isinstance(values, list):
        return None
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return None
    return tuple(float(v) for v in values)


def error_message(body: object) -> str | None:
    """The message of an error body (OpenAI's ``{"error": {...}}``, vLLM's older flat
    ``{"message": ..., "object": "error"}``, FastAPI's ``{"detail": ...}``)."""
    if not isinstance(body, dict):
        return None
    err = body.get("error")
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return err["message"]
    if isinstance(err, str):
        return err
    if body.get("object") == "error" and isinstance(body.get("message"), str):
        return body["message"]
    if isinstance(body.get("detail"), str):
        return body["detail"]
    return None
