"""Who may read what the whole server holds: the one rule for every route that is not a request.

Owns: ``ServerReadRule``, asked by every route that answers with server-wide figures rather
than with the caller's own request (``GET /metrics``, ``GET /kv_event_sources``, which
advertises the KV-event stream). Counters over every visitor move by one visitor's prompt
length when that visitor's request ends, so on a public deployment they are an exact oracle
of what someone else asked. The rule:

- a private deployment (no ``--isolate``): open, as vLLM's and SGLang's are;
- a public one (``--isolate``, the default on Spaces): only for the operator, who sends
  ``Authorization: Bearer <operator key>`` (``--operator-key``, env ``RADIX_OPERATOR_KEY``);
  without a key, or with the wrong one, the route is not there (404, with a message for the
  operator), unless the operator chose to publish them anyway (``--public-metrics``).

What a page visitor sees of the server lives in the page's panels, which show other visitors'
work only coarsely (``engine.snapshot_view``); this rule is for the routes beside the page.
Knows nothing about the engine or Gradio.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

NOT_HERE = ("Not found: a public deployment keeps its server-wide figures for its operator (start it with "
            "--operator-key and send 'Authorization: Bearer <key>', or with --public-metrics).")


@dataclass(frozen=True)
class ServerReadRule:
    """Whether a request may read server-wide figures (see the module's docstring)."""

    isolation: bool
    operator_key: str | None = None
    public: bool = False  # the operator publishes them on a public deployment anyway

    def allows(self, headers) -> bool:
        """``headers``: the request's (a mapping with ``get``, names in lower case)."""
        if not self.isolation or self.public:
            return True
        if not self.operator_key:
            return False
        given = str(headers.get("authorization", "") or "").encode()
        return hmac.compare_digest(given, f"Bearer {self.operator_key}".encode())
