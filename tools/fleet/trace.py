"""The built-in trace a fleet is measured on, and replaying it through a URL (the router's).

Owns: ``built_in_trace`` (a few system prompts, several users, each user one system prompt and a
conversation of several turns; within a round of turns the users come in a shuffled but seeded
order, so a round-robin router does not land each user on the same replica by accident),
``replay`` (each turn streamed through ``/v1/chat/completions`` with the conversation so far,
the answer appended to it; rounds one after another, users of a round ``concurrency`` at a
time; every request bounded by a timeout and the whole replay by a deadline) and ``summarize``
(the fleet-wide cached-token share from each response's ``usage.prompt_tokens_details``, time
to first token percentiles, output tokens per second). Knows nothing about processes or ports.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from tools.measure import percentile

_RULES = (
    "You are the help desk of a harbour office. Ferries leave from pier two at seven, eleven and four; "
    "the ticket desk opens an hour before the first ferry; bicycles travel free on weekdays; dogs need a "
    "lead and a ticket of their own; parking is behind the fish market and costs two coins an hour; the "
    "office closes on public holidays. Answer in one short sentence and never invent a timetable. ",
    "You are a librarian at a small town library. Members may borrow eight books for three weeks and renew "
    "them twice unless someone reserved them; the reading room is quiet after six; the printer takes coins "
    "only; children's story hour is on Saturday at ten; lost cards cost one coin to replace; returns go in "
    "the slot by the side door at night. Answer in one short sentence. ",
    "You are the front desk of a mountain hostel. Beds are in rooms of six; breakfast runs from seven to nine; "
    "lockers need your own padlock; the last bus to the valley leaves at half past five; the drying room is "
    "in the basement next to the boot racks; quiet hours start at ten; towels can be rented at the desk. "
    "Answer politely in one short sentence. ",
)
# Real system prompts run to hundreds of tokens: each house's rules three times, 230-250 tokens.
SYSTEM_PROMPTS = tuple(rules * 3 for rules in _RULES)
QUESTIONS = ("When does it open?", "Can I bring my dog?", "Where do I leave my bag?", "How much does it cost?",
             "Is there anything on Saturday?", "What happens if I am late?", "Can I pay with a card?",
             "Where is the nearest bus stop?", "Thank you, and one more thing: is it busy today?")


@dataclass(frozen=True)
class Turn:
    user: int
    turn: int
    system: int  # index into SYSTEM_PROMPTS
    question: str


@dataclass
class Result:
    turn: Turn
    status: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float = float("nan")
    total_s: float = float("nan")
    text: str = ""
    error: str = ""


def built_in_trace(users: int = 8, turns: int = 3, seed: int = 0) -> list[list[Turn]]:
    """Rounds of turns: round ``t`` holds every user's turn ``t``, in a seeded shuffled order.
    User ``u`` talks to system prompt ``u % len(SYSTEM_PROMPTS)``."""
    rng = random.Random(seed)
    rounds = []
    for t in range(turns):
        order = list(range(users))
        rng.shuffle(order)
        rounds.append([Turn(u, t, u % len(SYSTEM_PROMPTS), QUESTIONS[(u * 3 + t) % len(QUESTIONS)]) for u in order])
    return rounds


def _send(http: httpx.Client, model: str, messages: list[dict], turn: Turn, max_tokens: int) -> Result:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    out = Result(turn, 0)
    try:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.error = r.read().decode(errors="replace")[:300]
                return out
            for line in r.iter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if not out.text:
                            out.ttft_s = time.perf_counter() - t0
                        out.text += piece
                usage = chunk.get("usage")
                if usage:
                    out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    out.completion_tokens = int(usage.get("completion_tokens") or 0)
                    out.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:300]
    out.total_s = time.perf_counter() - t0
    if out.ttft_s != out.ttft_s:  # no text at all (an empty answer): the first token came with the end
        out.ttft_s = out.total_s
    return out


def replay(url: str, model: str, rounds: list[list[Turn]], max_tokens: int = 8, concurrency: int = 1,
           tag: str = "", request_timeout_s: float = 120.0, deadline_s: float = 600.0) -> list[Result]:
    """Send every turn through ``url``; returns one ``Result`` per turn, in the order sent.
    ``tag`` opens every system prompt, so that two replays share no prefix (a fresh cache, as far
    as this trace can tell). Turns left when ``deadline_s`` has passed are not sent (status 0)."""
    history: dict[int, list[dict]] = {}
    results: list[Result] = []
    end = time.monotonic() + deadline_s
    with httpx.Client(base_url=url, timeout=httpx.Timeout(request_timeout_s, connect=10.0)) as http:

        def one(turn: Turn) -> Result:
            if time.monotonic() > end:
                return Result(turn, 0, error="not sent: past the replay's deadline")
            messages = history.setdefault(turn.user, [{"role": "system", "content": tag + SYSTEM_PROMPTS[turn.system]}])
            sent = [*messages, {"role": "user", "content": turn.question}]
            result = _send(http, model, sent, turn, max_tokens)
            messages += [{"role": "user", "content": turn.question}, {"role": "assistant", "content": result.text}]
            return result

        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            for round_ in rounds:  # a user's next turn needs the answer to the last one
                results += list(pool.map(one, round_))
    return results


def summarize(results: list[Result], wall_s: float) -> dict[str, float]:
    """Fleet-wide figures of one replay (answered requests only, but ``answered`` counts them)."""
    ok = [r for r in results if r.status == 200 and not r.error]
    prompt = sum(r.prompt_tokens for r in ok)
    ttfts = [r.ttft_s for r in ok]
    return {"requests": len(results), "answered": len(ok), "prompt_tokens": prompt,
            "cached_tokens": sum(r.cached_tokens for r in ok),
            "hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
            "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p95_s": percentile(ttfts, 0.95),
            "output_tokens_per_s": sum(r.completion_tokens for r in ok) / wall_s if wall_s > 0 else 0.0,
            "wall_s": wall_s}
