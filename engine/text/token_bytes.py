"""One token on its own: its text and its exact UTF-8 bytes, as logprobs show each token.

Owns: ``TokenBytes``, for one tokenizer, each id's text (the id decoded alone, as OpenAI's
``token`` field shows it) and its bytes (OpenAI's ``bytes``). The two differ where a token is
part of a character: decoded alone, such a token shows U+FFFD, so the bytes come from the
vocabulary entry itself instead:

- byte-level BPE (GPT-2, Llama 3, SmolLM2): each character of the entry stands for one byte
  (the printable bytes for themselves, the others shifted past 255); mapped back exactly;
- byte fallback (SentencePiece, ``<0xE6>``): that one byte;
- added and special tokens, and any other vocabulary: the UTF-8 of the text decoded alone
  (exact wherever that text has no U+FFFD).

So the bytes of an answer's tokens, joined, are the answer's UTF-8 wherever the vocabulary
is byte-level or falls back to bytes. Memoized per id. Knows nothing about models or HTTP.
"""

from __future__ import annotations

import functools
import re
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet, character -> byte: printable Latin-1 bytes stand for
    themselves; the other bytes, in order, for the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


class TokenBytes:
    """Each token id's own text and bytes for ``tokenizer`` (a transformers tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = "ByteLevel" in type(decoder).__name__ or "ByteLevel" in repr(decoder)
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.added = frozenset(int(i) for i in added) | frozenset(getattr(tokenizer, "all_special_ids", []) or [])

    @functools.lru_cache(maxsize=65536)  # noqa: B019  (one per tokenizer, kept as long as the engine)
    def text(self, token_id: int) -> str:
        """The token decoded alone (special tokens shown, not skipped)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    @functools.lru_cache(maxsize=65536)  # noqa: B019
    def bytes_of(self, token_id: int) -> bytes:
        """The token's exact bytes where the vocabulary says them (module docstring)."""
        if token_id not in self.added:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                if self.byte_level:
                    alphabet = byte_level_alphabet()
                    if all(ch in alphabet for ch in piece):
                        return bytes(alphabet[ch] for ch in piece)
                fallback = _BYTE_FALLBACK.fullmatch(piece)
                if fallback:
                    return bytes([int(fallback.group(1), 16)])
        return self.text(token_id).encode("utf-8")
