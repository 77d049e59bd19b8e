"""Text: token ids to and from text, with no model.

Owns: the chat template, encoding, decoding, the end-of-sequence and special token
ids (``codec.TextCodec``, built from a tokenizer alone, so the remote engine has it
too) and the one incremental detokenizer (``detokenizer``). Knows nothing about
forwards, the cache or the scheduler.
"""
