"""Namespace rules: the one home for what a cache namespace's name means.

Owns: who a namespace belongs to (a visitor's sub-namespaces such as ``v-abc/lab-1`` are
theirs). The radix tree charges fair shares by it and the scheduler takes turns by it, so
the two can never disagree. Knows nothing about trees, requests or who may see what.
"""

from __future__ import annotations


def owner_of(namespace: str) -> str:
    """Whose a namespace is: the visitor's namespace without the sub-namespace
    (``v-abc/variant`` -> ``v-abc``); fair shares and turns are counted per owner."""
    return namespace.split("/", 1)[0]
