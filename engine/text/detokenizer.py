"""The one incremental detokenizer: token ids in one at a time, the text they add out.

Owns: turning a growing list of token ids into text in linear time, exactly as decoding
them all at once would: the streamed answer (``engine.scheduler.request``), one display piece per
prompt token (``token_pieces``: the token view, the replay report's examples). Knows
nothing about tokenizers beyond a ``decode(ids) -> str`` callable, nor about models or
requests.

Why a window: decoding the whole text again per token is quadratic, and decoding a token
alone is wrong twice over: a character of several UTF-8 bytes split over tokens decodes as
U+FFFD, and some decoders (SentencePiece's) drop the leading space of a text's first token.
So each new token is decoded in a short window after the tokens shown just before it (the
context), and what the window adds to the context's own text is the new text::

    ids:  [ ..... shown ..... | context |  pending  ]
                              ^ctx      ^read       ^end
    new text = decode(ids[ctx:end]) minus decode(ids[ctx:read])

A window whose text ends in U+FFFD may end inside a character: its tokens stay pending until
a later token completes it. A character is at most 4 bytes, so at most 4 tokens: once 4 are
pending and the text still ends in U+FFFD (junk bytes, say), the window is cut at the latest
of the last few token boundaries that splits no character (checked: the two sides decoded
apart give the window's text), so junk cannot make the window grow and the text stays
exact. ``finish`` shows what is still pending, an unfinished character as U+FFFD.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"  # what a decoder shows for bytes that are not (yet) a whole character
MAX_CHAR_TOKENS = 4  # a UTF-8 character is at most 4 bytes, and every token is at least one
_CUT_TRIES = MAX_CHAR_TOKENS - 1  # boundaries tried, newest first, when junk fills the window

Decode = Callable[[Sequence[int]], str]


class Detokenizer:
    """Feed token ids; get back the text each one adds.

    Contract: ``text`` is always the concatenation of what ``feed`` and ``finish`` returned,
    and after ``finish`` it equals ``decode(all ids fed)`` for any decoder whose output for
    a prefix that ends on a character boundary is a prefix of its output for the whole (the
    byte-level BPE and SentencePiece decoders are). Each ``feed`` decodes a few tokens, so a
    text of ``n`` tokens costs ``O(n)``. Not thread-safe: one per stream.
    """

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self._window: list[int] = []  # ids[ctx:end]: the context, then the pending tokens
        self._read = 0  # window[:_read] is the context (already shown), window[_read:] pending
        self._context_text = ""  # decode(window[:_read])
        self.text = ""

    def feed(self, token_id: int) -> str:
        """Add one token; return the text that is now final ("" while a character is open)."""
        self._window.append(token_id)
        text = self._decode(self._window)
        end = len(self._window)
        if text.endswith(REPLACEMENT):
            if end - self._read < MAX_CHAR_TOKENS:
                return ""  # may end inside a character: wait for the token that completes it
            cut = self._safe_cut(text)
            if cut is None:
                return ""
            end, text = cut
        return self._show(text, end)

    def finish(self) -> str:
        """Show the pending tokens as they decode now; ``text`` is then the whole text."""
        if self._read == len(self._window):
            return ""
        return self._show(self._decode(self._window), len(self._window))

    def _show(self, text: str, end: int) -> str:
        """``text`` is ``decode(window[:end])``: show what it adds to the context, and make
        ``window[read:end]`` the next context."""
        context = self._context_text
        new = text[len(context):] if text.startswith(context) else text[len(os.path.commonprefix([text, context])):]
        self._window = self._window[self._read:]
        self._read = end - self._read
        self._context_text = self._decode(self._window[:self._read])
        self.text += new
        return new

    def _safe_cut(self, text: str) -> tuple[int, str] | None:
        """The latest of the last few pending boundaries that splits no character, with the
        text up to it; None when each of them splits one (the tokens stay pending)."""
        end = len(self._window)
        for cut in range(end - 1, max(self._read, end - 1 - _CUT_TRIES), -1):
            left = self._decode(self._window[:cut])
            if left + self._decode(self._window[cut:]) == text:
                return cut, left
        return None


def token_pieces(decode: Decode, ids: Sequence[int]) -> list[str]:
    """One display string per token whose concatenation is ``decode(ids)``, in linear time.

    A token that ends inside a character gives "" and the token that completes it carries
    the character (so no piece shows a U+FFFD that the whole text has not)."""
    detokenizer = Detokenizer(decode)
    pieces = [detokenizer.feed(t) for t in ids]
    if pieces:
        pieces[-1] += detokenizer.finish()
    return pieces
