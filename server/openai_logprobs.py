"""The ``logprobs`` objects of the OpenAI wire format, from the engine's ``TokenLogprob`` data.

Owns the two shapes, whole and in stream parts:

- chat (``/v1/chat/completions``, ``logprobs: true``, ``top_logprobs: k``)::

    choices[i].logprobs = {"content": [{"token", "logprob", "bytes",
                                        "top_logprobs": [{"token", "logprob", "bytes"}, ...k]}, ...],
                           "refusal": None}

- completions (``/v1/completions``, ``logprobs: k``, ``echo``)::

    choices[i].logprobs = {"tokens": [...], "token_logprobs": [...],
                           "top_logprobs": [{token: logprob, ...}, ...], "text_offset": [...]}

  ``top_logprobs[i]`` holds the k most likely tokens and the chosen one (vLLM's rule; with
  k = 0, the chosen one alone); two ids that show the same text keep the likelier's value. With
  ``echo`` the prompt's tokens come first, the first with ``None`` for its logprob and top list.

A token shows as its text decoded alone, and ``bytes`` as its exact UTF-8 bytes
(``EngineAPI.token_texts``). ``text_offset`` counts characters of the returned text: each
token's start, from the lengths of the display pieces (``EngineAPI.token_pieces``, which join
to the decoded text). A log-probability that is not a finite number (a token the loop guards
banned has -inf) shows as -9999.0, OpenAI's value for "very unlikely". Pure functions over
plain data: knows nothing about HTTP, the engine's threads or the model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from engine.types import TokenLogprob

UNLIKELY = -9999.0

TextsOf = Callable[[Sequence[int]], list[tuple[str, bytes]]]  # ``EngineAPI.token_texts``
PiecesOf = Callable[[Sequence[int]], list[str]]  # ``EngineAPI.token_pieces``


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else UNLIKELY


def _table(entries: Sequence[TokenLogprob | None], texts: TextsOf) -> dict[int, tuple[str, bytes]]:
    """Text and bytes of every id the entries name (chosen and alternatives), looked up once."""
    ids = list(dict.fromkeys(i for e in entries if e is not None for i in (e.token_id, *(t for t, _ in e.top))))
    return dict(zip(ids, texts(ids), strict=True))


# ------------------------------------------------------------------ chat
def chat_logprobs(entries: Sequence[TokenLogprob], texts: TextsOf) -> dict:
    """``choices[i].logprobs`` of a chat answer (or of one stream chunk's tokens)."""
    table = _table(entries, texts)

    def one(token_id: int, logprob: float) -> dict:
        text, raw = table[token_id]
        return {"token": text, "logprob": _value(logprob), "bytes": list(raw)}

    content = [one(e.token_id, e.logprob) | {"top_logprobs": [one(t, v) for t, v in e.top]} for e in entries]
    return {"content": content, "refusal": None}


# ------------------------------------------------------------------ completions
def offsets(pieces: Sequence[str], start: int) -> list[int]:
    """Each piece's first character in a text where the first piece begins at ``start``."""
    out, at = [], start
    for piece in pieces:
        out.append(at)
        at += len(piece)
    return out


def completion_logprobs(ids: Sequence[int], entries: Sequence[TokenLogprob | None], texts: TextsOf,
                        pieces: PiecesOf, start: int = 0) -> dict:
    """``choices[i].logprobs`` of completion tokens ``ids`` (``entries[i]`` scores ``ids[i]``;
    None for a prompt's first token), their text beginning at character ``start``."""
    if len(ids) != len(entries):
        raise ValueError(f"{len(entries)} logprob entries for {len(ids)} tokens")
    table = _table(entries, texts)
    shown = [text for text, _ in texts(ids)]
    tops: list[dict[str, float] | None] = []
    for e in entries:
        if e is None:
            tops.append(None)
            continue
        top: dict[str, float] = {}
        for token_id, logprob in (*e.top, (e.token_id, e.logprob)):
            top.setdefault(table[token_id][0], _value(logprob))
        tops.append(top)
    return {"tokens": shown, "token_logprobs": [None if e is None else _value(e.logprob) for e in entries],
            "top_logprobs": tops, "text_offset": offsets(pieces(ids), start)}


def joined(first: dict, second: dict) -> dict:
    """Two completion ``logprobs`` objects one after the other (an echoed prompt, then the answer)."""
    return {name: first[name] + second[name] for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


class LogprobTrail:
    """One answer's logprobs sent in parts (a stream): each ``part`` carries the entries not sent
    yet; in completions their text offsets go on from where the last part's text ended."""

    def __init__(self, chat: bool, texts: TextsOf, pieces: PiecesOf, start: int = 0) -> None:
        self.chat, self.texts, self.pieces = chat, texts, pieces
        self.sent = 0
        self.offset = start  # completions: where the next part's text begins

    def part(self, entries: Sequence[TokenLogprob]) -> dict:
        """The logprobs of ``entries[sent:]`` (``entries``: every one so far)."""
        new = list(entries[self.sent:])
        self.sent = len(entries)
        if self.chat:
            return chat_logprobs(new, self.texts)
        ids = [e.token_id for e in new]
        body = completion_logprobs(ids, new, self.texts, self.pieces, self.offset)
        self.offset += sum(len(p) for p in self.pieces(ids)) if ids else 0
        return body
