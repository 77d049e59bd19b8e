"""engine.text.detokenizer: the streamed text is always a prefix of decoding every token at
once and ends equal to it, over odd Unicode and junk bytes, at linear cost (tokens decoded
are counted, not timed)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from engine.text.codec import TextCodec
from engine.text.detokenizer import Detokenizer, token_pieces

ODD_TEXTS = [
    "Héllo wörld! 日本語のテキスト 🙂🚀 naïve café — ok\n\n  spaced   out ∑∫ end",
    "👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 🇯🇵🇫🇷 regions, 👍🏽 skin tone, 1️⃣ keycap",
    "e\u0301 a\u0300\u0316 Z̤͔ͧ̑̓ä͖̭̈̇lͮ̒ͫǧ̗͚̚o̙̔ͮ̇͐̇ combining marks, \u200b zero width, \u00ad soft hyphen",
    "漢字かなカナ 한국어 中文测试 𠜎𠜱𠝹 (outside the BMP) עברית العربية",
    "a literal \ufffd replacement, \x00 nul, \x1b[31m escape, tabs\t\tand\r\nCRLF",
    "🎉" * 40 + " 🎉🎉 end",
]


class Counting:
    """A decode that counts the tokens it is handed."""

    def __init__(self, decode) -> None:
        self.decode, self.tokens, self.calls = decode, 0, 0

    def __call__(self, ids: Sequence[int]) -> str:
        self.tokens += len(ids)
        self.calls += 1
        return self.decode(ids)


def stream(decode, ids: Sequence[int]) -> str:
    """Feed every token, checking that the text so far is a prefix of the whole at each step."""
    whole = decode(ids)
    detokenizer = Detokenizer(decode)
    for tok in ids:
        detokenizer.feed(tok)
        assert whole.startswith(detokenizer.text), (detokenizer.text, whole)
    detokenizer.finish()
    return detokenizer.text


@pytest.fixture(scope="module")
def text(tokenizer) -> TextCodec:
    return TextCodec(tokenizer)


@pytest.fixture(scope="module")
def byte_tokens(text) -> list[int]:
    """Token ids that decode alone to U+FFFD: pieces of multi-byte characters (lone bytes)."""
    return [i for i in range(text.vocab_size) if "\ufffd" in text.decode([i])]


@pytest.mark.parametrize("s", ODD_TEXTS)
def test_odd_unicode_streams_to_the_whole_decode(text, s):
    ids = text.encode(s)
    assert stream(text.decode, ids) == text.decode(ids) == s
    pieces = text.token_pieces(ids)
    assert len(pieces) == len(ids) and "".join(pieces) == s
    assert all("\ufffd" not in p for p in pieces if "\ufffd" not in s)  # a split character never shows as U+FFFD


def test_a_split_character_shows_on_the_token_that_completes_it(text):
    first, *rest = text.encode(" 🎉")
    assert rest, "the emoji is split over tokens in this vocabulary"
    detokenizer = Detokenizer(text.decode)
    assert [detokenizer.feed(t) for t in [first, *rest]] == [""] * len(rest) + [" 🎉"]


def test_lone_bytes_and_random_ids_end_exact(text, byte_tokens):
    """Random ids, mostly byte pieces: characters that never complete, junk that fills the
    window, pieces that complete late. The text is exact whatever the ids."""
    rng = random.Random(7)
    for _ in range(150):
        ids = [rng.choice(byte_tokens) if rng.random() < 0.7 else rng.randrange(text.vocab_size)
               for _ in range(rng.randrange(1, 60))]
        assert stream(text.decode, ids) == text.decode(ids)
        assert "".join(token_pieces(text.decode, ids)) == text.decode(ids)
    assert stream(text.decode, byte_tokens[:1]) == text.decode(byte_tokens[:1]) == "\ufffd"  # held, then shown


@pytest.mark.parametrize("kind", ["text", "junk"])
def test_cost_is_linear(text, byte_tokens, kind):
    """Decoding the growing text per token would hand the decoder n^2/2 tokens; the window
    hands it a few per token, whatever the length (junk bytes included)."""
    rng = random.Random(3)
    ids = text.encode("Hello, world! 漢字テスト 🎉🎉 naïve café\n  code: x = [1, 2]  " * 150) if kind == "text" \
        else [rng.choice(byte_tokens) for _ in range(3_000)]
    counting = Counting(text.decode)
    assert stream(counting, ids) == text.decode(ids)
    assert counting.tokens <= 14 * len(ids), f"{counting.tokens:,} tokens decoded for {len(ids):,}"
    assert counting.calls <= 4 * len(ids)


# Decoders of other shapes, from a made-up vocabulary (no tokenizer needed).
BYTE_VOCAB = [b"a", b" b", b"\xe4", b"\xb8", b"\xad", b"\xe4\xb8", b"\xad\xe4", b"\xb8\xad", b"\xf0\x9f", b"\x98\x80",
              b"\xff", b"\x80", b"\xc3", b"\xa9"]


def byte_decode(ids: Sequence[int]) -> str:
    """A byte-level BPE decoder: the tokens' bytes, invalid UTF-8 as U+FFFD."""
    return b"".join(BYTE_VOCAB[i] for i in ids).decode("utf-8", errors="replace")


def test_tokens_that_straddle_characters():
    """Every boundary inside 中中中...: no token ends on a character, so the window waits
    (it can cut nowhere) and the text still ends exact."""
    ids = [5] + [4, 5] * 10 + [4]  # e4 b8 | ad e4 | b8 ... : 中 split at every token
    assert byte_decode(ids) == "中" * 11
    assert stream(byte_decode, ids) == "中" * 11
    assert "".join(token_pieces(byte_decode, ids)) == "中" * 11


def test_random_byte_vocabulary_ends_exact():
    rng = random.Random(11)
    for _ in range(500):
        ids = [rng.randrange(len(BYTE_VOCAB)) for _ in range(rng.randrange(1, 40))]
        assert stream(byte_decode, ids) == byte_decode(ids)
        pieces = token_pieces(byte_decode, ids)
        assert len(pieces) == len(ids) and "".join(pieces) == byte_decode(ids)


def test_a_decoder_that_drops_the_first_leading_space():
    """SentencePiece drops the leading space of a text's first token: decoded alone, every
    word would lose its space. The context before each window keeps them."""
    words = ["▁Hello", "▁world", ",", "▁this", "▁is", "▁fine", "."]

    def sp_decode(ids: Sequence[int]) -> str:
        out = "".join(words[i] for i in ids).replace("▁", " ")
        return out[1:] if out.startswith(" ") else out

    ids = list(range(len(words)))
    assert stream(sp_decode, ids) == sp_decode(ids) == "Hello world, this is fine."
    assert token_pieces(sp_decode, ids) == ["Hello", " world", ",", " this", " is", " fine", "."]
