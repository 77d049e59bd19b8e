"""Traces for the fleet simulator: a generated chat workload at scale, token-id sequences, or a replay log.

``chat_workload(ChatWorkload(...))``: GENERATED traffic, not real, in the shape of the real routing
lab's trace (``tools/fleet/trace.py``: a few system prompts, many users, multi-turn chats whose turns
resend the conversation so far), parametrised and at scale: ``system_prompts`` prompts of
``system_tokens`` random token ids, chosen by users with a Zipf popularity (``zipf_s``); ``users``
users, each on one system prompt for good; conversations start as a Poisson process and run a
geometric number of turns (mean ``mean_turns``) a random think time apart (mean ``think_s``); each
turn's prompt is the previous turn's prompt and answer plus a new user message. Token ids are drawn
at random (no tokenizer: the simulator is model-free); only their sharing matters.

``requests_from_ids``: any (prompt ids, answer ids, key, arrival) sequences, hashed into blocks.
``requests_from_log``: a replay log (``analysis.replay.log_formats``) through a tokenizer and its
chat template (``analysis.replay.simulate.PromptEncoder``), so a pasted log can be routed.

Knows nothing about routing or caches beyond the block names (``fleet_cache``).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from analysis.replay.fleet_cache import BlockChain, chain_hashes
from analysis.replay.fleet_sim import SimRequest


@dataclass(frozen=True)
class ChatWorkload:
    requests: int = 100_000
    system_prompts: int = 32
    zipf_s: float = 1.1
    system_tokens: tuple[int, int] = (300, 3000)
    users: int = 20_000
    mean_turns: float = 4.0
    user_tokens: tuple[int, int] = (20, 200)
    answer_tokens: tuple[int, int] = (50, 300)
    requests_per_s: float = 100.0
    think_s: float = 30.0
    vocab: int = 49_152
    seed: int = 0


def chat_workload(w: ChatWorkload, block_tokens: int = 16) -> list[SimRequest]:
    """``w.requests`` requests in arrival order (see the module docstring)."""
    rng = random.Random(w.seed)
    vocab = range(w.vocab)
    systems = [BlockChain(block_tokens).extend(rng.choices(vocab, k=rng.randint(*w.system_tokens)))
               for _ in range(w.system_prompts)]
    weights = [1 / (i + 1) ** w.zipf_s for i in range(w.system_prompts)]
    system_of = rng.choices(range(w.system_prompts), weights=weights, k=w.users)
    # When each turn happens: (time, conversation, user). Conversations start at requests_per_s /
    # mean_turns a second, so that turns arrive at about requests_per_s.
    events: list[tuple[float, int, int]] = []
    clock, conv = 0.0, 0
    start_rate, p_more = w.requests_per_s / w.mean_turns, 1 - 1 / w.mean_turns
    while len(events) < w.requests * 1.05 + 16:
        clock += rng.expovariate(start_rate)
        user, t = rng.randrange(w.users), clock
        while True:
            events.append((t, conv, user))
            if rng.random() >= p_more:
                break
            t += rng.expovariate(1 / w.think_s)
        conv += 1
    events.sort()
    chats: dict[int, BlockChain] = {}
    out = []
    for t, c, user in events[:w.requests]:
        chat = chats.get(c) or systems[system_of[user]]
        prompt = chat.extend(rng.choices(vocab, k=rng.randint(*w.user_tokens)))
        answer = rng.choices(vocab, k=rng.randint(*w.answer_tokens))
        after = prompt.extend(answer)
        chats[c] = after
        out.append(SimRequest(after.hashes, prompt.num_tokens, len(answer), f"user-{user}", t))
    return out


def requests_from_ids(items: Iterable[tuple[Sequence[int], Sequence[int], str, float]],
                      block_tokens: int = 16) -> list[SimRequest]:
    """``(prompt ids, answer ids, key, arrival_s)`` each; the answer's ids stay cached after the
    prompt (the engine caches what it generated), and its length is the request's output."""
    return [SimRequest(chain_hashes([*prompt, *answer], block_tokens), len(prompt), len(answer), key, arrival)
            for prompt, answer, key, arrival in items]


def requests_from_log(lines: Iterable[str], tokenizer: Any, block_tokens: int = 16, max_context: int = 1 << 30,
                      output_tokens: int = 128, requests_per_s: float = 10.0) -> list[SimRequest]:
    """A replay log's requests, rendered and tokenized as the replay does. A logged response is
    the answer (cached after the prompt); without one the request still takes ``max_new_tokens``
    (else ``output_tokens``) of decode time but leaves only its prompt. The key is the log's
    session, else the prompt's first 64 tokens (a router without a session hashes the text).
    Arrival: the log's timestamps from its first, else ``requests_per_s``."""
    from analysis.replay.log_formats import SkippedLine, read_log
    from analysis.replay.simulate import PromptEncoder

    encoder = PromptEncoder(tokenizer, max_context)
    records = list(read_log(lines))
    out: list[SimRequest] = []
    first = next((r.timestamp for r in records if r.timestamp is not None), None)
    for i, item in enumerate(encoder.encode(records)):
        if isinstance(item, SkippedLine):
            continue
        rec = item.record
        answer = len(item.inserted) - len(item.ids)
        decode = answer or (rec.max_new_tokens if rec.max_new_tokens is not None else output_tokens)
        key = rec.session or f"text-{hash(item.ids[:64])}"
        arrival = rec.timestamp - first if rec.timestamp is not None and first is not None else i / requests_per_s
        out.append(SimRequest(chain_hashes(item.inserted, block_tokens), len(item.ids), decode, key, arrival))
    return out
