"""Namespace rules: the one home for what a cache namespace's name means.

Owns: who a namespace belongs to (a visitor's sub-namespaces such as ``v-abc/lab-1`` are
theirs; the radix tree charges fair shares by it and the scheduler takes turns by it, so
the two can never disagree), and how a name that must not reveal what it came from is
made (``secret_name``: a visitor's session, an API ``cache_salt``, a namespace sent to a
remote server as its salt). Knows nothing about trees, requests or who may see what.
"""

from __future__ import annotations

import hashlib
import hmac


def owner_of(namespace: str) -> str:
    """Whose a namespace is: the visitor's namespace without the sub-namespace
    (``v-abc/variant`` -> ``v-abc``); fair shares and turns are counted per owner."""
    return namespace.split("/", 1)[0]


def secret_name(prefix: str, secret: bytes, text: str, hex_chars: int) -> str:
    """``prefix`` + the first ``hex_chars`` hex digits of HMAC-SHA256(``secret``, ``text``):
    the same text gives the same name for the life of the secret, and nobody without the
    secret can tell which text it came from or name it. Lone surrogates are kept, not refused."""
    digest = hmac.new(secret, text.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()
    return prefix + digest[:hex_chars]
