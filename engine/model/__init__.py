"""The model: the only code in the engine that calls transformers.

Owns: loading a model and its tokenizer (``loader``), the forwards on request buffers
and on the KV pool (``runner``), attention over pool slots with shared prefixes read
once (``paged_attention``) through a kernel chosen at start (``attention``), the one
thread every forward runs on (``compute_thread``), oneDNN-packed CPU linears
(``packed_linear``) and the next token from logits (``sampling``). Knows nothing about the radix tree's policy, the scheduler or text:
it is handed token ids and KV, and hands back logits.
"""
