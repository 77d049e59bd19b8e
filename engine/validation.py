"""Request validation: what a request may hold before it reaches the tokenizer, the model or the cache.

Owns: the checks that turn bad input into an ``EngineError`` whose message is meant
for a person: wrong types, blank prompts, texts too long to be worth tokenizing,
token ids outside the vocabulary, and sampling values that are not finite numbers.
A public page gets all of these (a visitor's browser, or anyone calling the API),
so nothing here trusts its input. Knows nothing about trees, pools or the UI.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import replace
from numbers import Real

from engine.types import EngineError, GenerationRequest, SamplingParams

EMPTY_PROMPT = "The prompt is empty: type something first."
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # most likely alternatives a request may ask for per position (OpenAI's top_logprobs cap)
PREFIX_CHARS_PER_TOKEN = 8  # characters tokenized per allowed token before an over-long text is refused


def flatten_content(content: object) -> str:
    """A message's content as one string. Gradio hands content as a list of parts
    (``[{"type": "text", "text": ...}]``); anything that is not text counts as empty."""
    if isinstance(content, str):
        return content
    if isinstance(content, list | tuple):
        return "".join(flatten_content(p) for p in content)
    if isinstance(content, dict):
        return flatten_content(content.get("text", "")) if content.get("type", "text") == "text" else ""
    if content is None or isinstance(content, bool):
        return ""
    if isinstance(content, int | float):
        return str(content)
    raise EngineError("A message's content must be text.")


def check_messages(messages: object) -> tuple[dict, ...]:
    """Chat messages as ``({"role": str, "content": str}, ...)``; raise EngineError if malformed
    or if the last message (what the model answers) is blank."""
    if isinstance(messages, dict | str | bytes) or not isinstance(messages, Sequence):
        raise EngineError("The chat must be a list of messages.")
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise EngineError("Each chat message must have a role and a content.")
        role = m.get("role", "user")
        if not isinstance(role, str) or not role.strip() or len(role) > 32:
            raise EngineError("Each chat message needs a role such as 'system', 'user' or 'assistant'.")
        out.append({"role": role, "content": flatten_content(m.get("content"))})
    if not out or not out[-1]["content"].strip():
        raise EngineError(EMPTY_PROMPT)
    return tuple(out)


def check_text_size(num_chars: int, max_prompt_tokens: int, max_token_chars: int) -> None:
    """Reject texts that must be over the token limit without tokenizing them.

    No vocabulary entry is longer than ``max_token_chars`` characters, so a text of
    ``n`` characters has at least ``n / max_token_chars`` tokens: the bound never
    rejects a prompt that fits, and it rejects a 1 MB string in microseconds.
    """
    if num_chars > max_prompt_tokens * max_token_chars:
        raise EngineError(f"The prompt is {num_chars:,} characters long, far over the limit of "
                          f"{max_prompt_tokens:,} tokens. Shorten it and try again.")


def check_text_tokens(texts: Sequence[str], max_prompt_tokens: int, max_token_chars: int,
                      encode: Callable[[str], Sequence[int]]) -> None:
    """Refuse texts over the token limit while tokenizing only a bounded part of them.

    First the free bound of ``check_text_size``. Then, for texts longer than
    ``PREFIX_CHARS_PER_TOKEN`` characters per allowed token (ordinary text has 3 to 5),
    only that many characters are tokenized, cut at whitespace: a prefix of a text has
    no more tokens than the whole text (up to a token or two where the cut falls, and
    where a text starts: hence the slack), so if the prefixes alone are over the limit,
    so is the prompt. Texts with more characters per token (long runs of spaces) are
    left to the caller, who tokenizes them in full and checks the count exactly: this
    never refuses a prompt that fits.
    """
    total_chars = sum(len(t) for t in texts)
    check_text_size(total_chars, max_prompt_tokens, max_token_chars)
    slack = 16 + 2 * len(texts)
    budget = (max_prompt_tokens + slack) * PREFIX_CHARS_PER_TOKEN
    if total_chars <= budget:
        return  # the caller tokenizes it all anyway: nothing to save
    counted = 0
    for text in texts:
        if budget <= 0:
            break
        part = text[:budget]
        if len(part) < len(text):
            cut = max(part.rfind(" "), part.rfind("\n"))
            part = part[:cut] if cut > len(part) // 2 else part
        counted += len(encode(part))
        budget -= len(part)
    if counted > max_prompt_tokens + slack:
        raise EngineError(f"The prompt is over the limit of {max_prompt_tokens:,} tokens: its first part alone "
                          f"holds {counted - slack:,}. Shorten it and try again.")


def check_prompt_ids(ids: object, vocab_size: int) -> list[int]:
    """Token ids as a list of ints inside the vocabulary."""
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
        raise EngineError("Token ids must be a list of integers.")
    try:
        out = [operator.index(i) for i in ids]
    except TypeError:
        raise EngineError("Token ids must be a list of integers.") from None
    bad = next((i for i in out if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise EngineError(f"Token id {bad} is outside the vocabulary (0 to {vocab_size - 1}).")
    return out


def _finite(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
        raise EngineError(f"{name} must be a finite number, not {str(value)[:40]!r}.")
    return float(value)


def check_sampling(params: object) -> SamplingParams:
    """Sampling values as finite numbers with the types the engine uses.

    Out-of-range but meaningful values keep their documented effect (fewer than one new
    token means none, a temperature at or below 0 means greedy, top-p at or above 1
    means no nucleus cut), so only values that are not numbers at all are refused.
    """
    if not isinstance(params, SamplingParams):
        raise EngineError("Sampling settings are missing or malformed.")
    max_new = _finite(params.max_new_tokens, "Max new tokens")
    temperature = _finite(params.temperature, "Temperature")
    top_p = _finite(params.top_p, "Top-p")
    seed = params.seed
    if seed is not None:
        if not isinstance(seed, int):  # a float from a number box: only whole values
            s = _finite(seed, "Seed")
            seed = int(s) if s.is_integer() else -1
        if isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
            raise EngineError(f"Seed must be a whole number from 0 to {MAX_SEED}.")
    ngram = _finite(params.no_repeat_ngram_size, "No-repeat n-gram size")
    penalty = _finite(params.repetition_penalty, "Repetition penalty")
    if not 0 <= ngram <= 64:
        raise EngineError("No-repeat n-gram size must be from 0 (off) to 64.")
    if not 0 < penalty <= 10:
        raise EngineError("Repetition penalty must be above 0 and at most 10 (1 is off).")
    if not isinstance(params.ignore_eos, bool):
        raise EngineError("Ignore EOS must be true or false.")
    return replace(params, max_new_tokens=int(max(-1.0, min(max_new, 2.0**31))), temperature=temperature,
                   top_p=top_p, seed=seed, no_repeat_ngram_size=int(ngram), repetition_penalty=penalty)


def check_logprobs(request: GenerationRequest) -> None:
    """``logprobs`` and ``prompt_logprobs``: None (off) or a whole number of alternatives, 0 to 20."""
    for name, value in (("logprobs", request.logprobs), ("prompt_logprobs", request.prompt_logprobs)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
            raise EngineError(f"{name} must be a whole number from 0 to {MAX_LOGPROBS} (alternatives per "
                              f"token), or None for none; got {str(value)[:40]!r}.")


def valid_text(text: str) -> str:
    """``text`` with lone UTF-16 surrogates replaced by U+FFFD (the tokenizer rejects them)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def new_token_limit(requested: int, cap: int, *room: int) -> int:
    """The one clamp of a request's new tokens: what it asked for, at most the server's ``cap``
    and every ``room`` given (context left after the prompt, pool slots left), never below 0.
    Input checks (``check_sampling``, the API's 400s, the page's slider) only reject or parse."""
    return max(0, min(int(requested), int(cap), *(int(r) for r in room)))
