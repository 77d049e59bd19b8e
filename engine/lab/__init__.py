"""The prompt-ordering lab's analysis, built on the serving core.

Runs orderings on the real engine, explains misses, lints templates, compares
request orders and block granularity, estimates hosted-API cost. The serving
core (``engine/*.py``) never imports this package.
"""
