"""Analysis over the engine, apart from the serving core: the prompt-ordering lab (``lab/``), the
model-free replay of a prompt log (``replay/``) and the fair prefill timer (``prefill_timing.py``).

It works through the engine's public modules (``engine.api``, ``engine.types``, ``engine.validation``,
``engine.snapshot_view``, ``engine.text``) and the pure, torch-free parts of the cache (the radix
tree, the eviction policy, the tier's chunk size). What it still reaches into, and why, is named in
each module's docstring: the prefill timer drives the local engine's runner and cache; the replay
reads a model's KV geometry through ``engine.model.loader`` (inside a function). The serving core
imports none of it, not even inside a function (tests/test_layering.py): what the analysis keeps
per engine (``prefill_timing.timer_for``, the request-order demo) it keeps itself, in
``per_engine``."""
