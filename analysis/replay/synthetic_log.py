"""A generated chat log with the usual prefix-caching mistakes, for benchmarks, examples and tests.

    python -m analysis.replay.synthetic_log OUT.jsonl [--requests N] [--seed S]

Three made-up applications share one endpoint, each request about 1,000 tokens
with the embedded model's tokenizer:

- a support bot (60%): a long static system prompt, then the question; one in
  three of its requests was built by a "v2" prompt builder that puts the current
  time at the top of the system prompt (a per-request value before static text);
- a retrieval bot (25%): three of eight documents, in a per-request order (reordered);
- a chat (15%): conversations that grow turn by turn (history kept verbatim).

Lines carry ISO timestamps a few seconds apart. Not real traffic: a fixture with
known mistakes, labelled as generated wherever it is used. Knows nothing about
tokenizers or caches.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

_WORDS = ("router firmware reset password network cable light signal wireless channel band guest portal update "
          "device admin login factory default setting backup restore port forward address gateway mesh node "
          "speed test latency packet loss modem provider account billing invoice plan upgrade warranty repair "
          "replacement shipping order status support ticket escalation engineer schedule visit").split()


def _text(rng: random.Random, words: int) -> str:
    out = []
    for i in range(words):
        w = rng.choice(_WORDS)
        out.append(w.capitalize() if i % 14 == 0 else w)
        if i % 14 == 13:
            out[-1] += "."
    return " ".join(out) + "."


def generate(requests: int, seed: int = 0, start: datetime | None = None) -> Iterator[dict]:
    rng = random.Random(seed)
    docs_rng = random.Random(seed + 1)
    support_system = "You are the support assistant of ACME Networks. " + _text(docs_rng, 760)
    rag_system = "Answer from the documents below only. Cite the document number."
    docs = [f"Document {i + 1}: " + _text(docs_rng, 260) for i in range(8)]
    chats: list[list[dict]] = []
    clock = start or datetime(2026, 11, 2, 9, 0, tzinfo=timezone.utc)
    for _ in range(requests):
        clock += timedelta(seconds=rng.uniform(0.2, 4.0))
        stamp = clock.isoformat().replace("+00:00", "Z")
        kind = rng.random()
        if kind < 0.60:
            system = support_system
            if rng.random() < 1 / 3:
                system = f"Current time: {clock:%Y-%m-%d %H:%M:%S}. " + support_system
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": _text(rng, rng.randint(60, 260))}]
        elif kind < 0.85:
            picked = rng.sample(docs, 3)
            messages = [{"role": "system", "content": rag_system + "\n\n" + "\n\n".join(picked)},
                        {"role": "user", "content": _text(rng, rng.randint(20, 120))}]
        else:
            if not chats or len(chats[-1]) > 12 or rng.random() < 0.2:
                chats.append([{"role": "system", "content": "You are a friendly assistant. " + _text(rng, 560)}])
                chats[:] = chats[-20:]
            chat = rng.choice(chats)
            chat.append({"role": "user", "content": _text(rng, rng.randint(15, 60))})
            messages = list(chat)
            chat.append({"role": "assistant", "content": _text(rng, rng.randint(20, 60))})
            yield {"timestamp": stamp, "messages": messages, "response": chat[-1]["content"]}
            continue
        yield {"timestamp": stamp, "messages": messages}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.replay.synthetic_log", description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    with args.out.open("w", encoding="utf-8") as fh:
        for item in generate(args.requests, args.seed):
            fh.write(json.dumps(item) + "\n")
    print(f"wrote {args.requests:,} generated requests to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
