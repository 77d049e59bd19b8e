"""Text for one tokenizer: chat template, encode, decode, special and end-of-sequence tokens.

Owns: rendering messages with the model's chat template (or a plain "role: content"
transcript for a model without one), text to token ids and back, one display piece per
token (through the one detokenizer, ``engine.text.detokenizer``), each token's own text and
bytes for logprobs (``engine.text.token_bytes``), the vocabulary's bounds
the request checks use, and which token ids end an answer. Built from a tokenizer alone:
the local engine's runner holds one, and the remote engine has one with no model at all.
Knows nothing about forwards, the cache or the scheduler.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from engine.text.detokenizer import token_pieces
from engine.text.token_bytes import TokenBytes
from engine.validation import flatten_content, valid_text

# Tokens that end a turn in the chat templates of common families, where the vocabulary has them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<end_of_turn>")


class TextCodec:
    """Token ids to and from text for one Hugging Face tokenizer.

    ``vocab_size`` bounds valid token ids (``range(vocab_size)``): a model's embedding rows
    where there is a model (it may have more rows than the tokenizer has entries), else the
    tokenizer's length. ``model_eos`` adds the model's own end-of-sequence ids (its
    generation config's ``eos_token_id``: an int or a list) to the tokenizer's.
    """

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, model_eos: object = None) -> None:
        self.tokenizer = tokenizer  # a transformers tokenizer (PreTrainedTokenizerBase)
        self.vocab_size = int(vocab_size) if vocab_size is not None else len(tokenizer)
        self._model_eos = model_eos

    # ------------------------------------------------------------- rendering
    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        msgs = [{"role": str(m.get("role", "user")), "content": flatten_content(m.get("content"))}
                for m in messages]
        if self.has_chat_template:
            return self.tokenizer.apply_chat_template(msgs, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs)
        return text + ("assistant:" if add_generation_prompt else "")

    # -------------------------------------------------------------- encoding
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as is (special-token markup in it is parsed, no BOS added).

        Lone surrogates (``"\\ud800"``, which JSON can carry but UTF-8 cannot) become U+FFFD
        instead of failing inside the tokenizer.
        """
        return list(self.tokenizer(valid_text(text), add_special_tokens=False)["input_ids"])

    def encode_chat(self, messages: Sequence[dict]) -> list[int]:
        return self.encode(self.render_chat(messages))

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters in the longest vocabulary entry: a text of ``n`` characters has at
        least ``n / max_token_chars`` tokens, a bound that rejects huge prompts before
        tokenizing them (tokenizing 1 MB takes seconds)."""
        vocab = self.tokenizer.get_vocab()
        longest = max((len(self.tokenizer.convert_tokens_to_string([t])) for t in vocab), default=1)
        return max(1, longest)

    # -------------------------------------------------------------- decoding
    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def token_pieces(self, ids: Sequence[int]) -> list[str]:
        """One display string per token whose concatenation is ``decode(ids)``, in linear time
        (``engine.text.detokenizer.token_pieces``)."""
        return token_pieces(self.decode, ids)

    @functools.cached_property
    def _token_bytes(self) -> TokenBytes:
        return TokenBytes(self.tokenizer)

    def token_texts(self, ids: Sequence[int]) -> list[tuple[str, bytes]]:
        """Each token on its own, as logprobs show it: (its text decoded alone, its exact UTF-8
        bytes where the vocabulary says them; ``engine.text.token_bytes``)."""
        tb = self._token_bytes
        return [(tb.text(int(i)), tb.bytes_of(int(i))) for i in ids]

    # ------------------------------------------------------- special tokens
    @property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(getattr(self.tokenizer, "all_special_ids", []) or [])

    @functools.cached_property
    def eos_ids(self) -> set[int]:
        """Token ids that end an answer: the tokenizer's and the model's end-of-sequence ids,
        and the end-of-turn markers of common chat templates that this vocabulary has."""
        ids: set[int] = set()
        for src in (self.tokenizer.eos_token_id, self._model_eos):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, list | tuple):
                ids.update(i for i in src if isinstance(i, int))
        for tok in END_OF_TURN_TOKENS:
            tid = self.tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id and tid >= 0:
                if tok in self.tokenizer.get_vocab():
                    ids.add(tid)
        return ids
