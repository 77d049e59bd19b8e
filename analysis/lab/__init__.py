"""The prompt-ordering lab's analysis, built on the engine's interface.

Runs orderings on the real engine, explains misses, lints templates, compares
request orders and block granularity, estimates hosted-API cost. Reads the
engine through ``engine.api``, ``engine.types`` and the pure radix tree (granularity
and the miss explainer); reaches into nothing else. The serving core (``engine/``)
never imports this package.
"""
