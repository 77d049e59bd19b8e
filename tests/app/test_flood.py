"""An API flood on a public deployment (issue 28), through the real HTTP server on the tiny
random Llama in isolation mode: one client sends 48 long requests at once over ``/v1``
(unsalted, then each with a salt of its own) while another client asks three questions.

Asserted in scheduler steps, never in seconds (the test machine is shared and noisy): the
flooder's excess is refused at once with 429 (never a full inbox, 503, for anyone), the
visitor is answered, its first token comes within a few steps of its arrival whatever the
flooder sent, it is admitted ahead of the flooder's requests that queued before it, and
the flooder is one owner (one owner's rows, one share) however many salts it invents.
Each question arrives while the model is held, so that its arrival is an exact step: the
flooder's accepted requests and the question then wait together, the flooder's first.
The figures of the real scenario (embedded model, 3,000-token requests, seconds) come from
``tools/flood_bench.py`` on a quiet machine."""

from __future__ import annotations

import math
import random
import threading

import httpx
import pytest

from engine.engine import Engine
from engine.namespaces import owner_of
from engine.scheduler.policy import owner_row_cap
from server.client_limits import default_max_per_client
from tests.helpers_app import (
    assert_clean,
    first_chunk_step,
    first_token_step,
    last_step_id,
    launched_app,
    wait_for,
    wait_idle,
)

FLOOD = 48  # requests the flooder sends at once, as in the issue
FLOOD_TOKENS = 512  # the 3,000 tokens, scaled to the tiny model's 1,024-token context
QUESTION_TOKENS = 48
MAX_QUEUE = 32
KEYS = "flooder-key,visitor-key"


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 20_000) for _ in range(n)]


def _post(http: httpx.Client, key: str, ids: list[int], salt: str | None, seen: list[int]) -> httpx.Response:
    """Send one streamed request; its status goes to ``seen`` as soon as it is known: a 200 once
    the engine holds the request (the stream starts after ``submit``), or a refusal."""
    body: dict = {"prompt": ids, "max_tokens": 4, "temperature": 0, "stream": True}
    if salt is not None:
        body["cache_salt"] = salt
    with http.stream("POST", "v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        seen.append(r.status_code)
        r.read()
    return r


def first_token_bound(engine: Engine, prompt_tokens: int) -> int:
    """Steps from a question's arrival to its first token when it is never queued behind anyone:
    admitted at once, it gets at least the chunk budget less the oldest prompt's minimum share
    each step from the next one on (a newcomer of the flooder's would be held back)."""
    config = engine.scheduler.config
    return 1 + math.ceil(prompt_tokens / (config.chunk_tokens - config.oldest_prefill_tokens))


def _round(runner, engine: Engine, http: httpx.Client, cap: int, q: int, salted: bool):
    """One flood and one question, both in the engine (or refused) while the model is held;
    returns the flood's answers, the question's ids and the step it arrived at."""
    answers: list[httpx.Response] = []
    seen: list[int] = []
    asked: list[int] = []
    question = _ids(10_000 + q, QUESTION_TOKENS)

    def flood(i: int) -> None:
        salt = f"invented-{q}-{i}" if salted else None
        answers.append(_post(http, "flooder-key", _ids(100 * q + i, FLOOD_TOKENS), salt, seen))

    flooders = [threading.Thread(target=flood, args=(i,)) for i in range(FLOOD)]
    asker = threading.Thread(target=lambda: _post(http, "visitor-key", question, None, asked))
    with runner.lock:  # the model is busy: nothing finishes while the flood arrives
        for t in flooders:
            t.start()
        wait_for(lambda: len(seen) == FLOOD, what="the flood")  # each one refused, or held by the engine
        assert sorted(seen) == [200] * cap + [429] * (FLOOD - cap), seen
        asker.start()
        wait_for(lambda: len(asked) == 1, what="the question")
        assert asked == [200]
        arrived = last_step_id(engine)  # no step runs while the model is held
    for t in [*flooders, asker]:
        t.join(300)
    for r in answers:
        if r.status_code != 200:  # the excess: refused at once, per client, with a time to retry
            assert r.status_code == 429 and r.headers.get("retry-after"), r.text
            assert r.json()["error"]["code"] == "too_many_requests"
    return answers, question, arrived


@pytest.mark.parametrize("salted", [False, True], ids=["unsalted", "a-new-salt-each"])
def test_a_flooding_client_gets_429s_and_another_clients_questions_are_answered_first(
        tiny_runner, make_engine, salted):
    engine = make_engine(tiny_runner, isolation=True, max_new_tokens_cap=4, max_queue=MAX_QUEUE)
    cap = default_max_per_client(True, MAX_QUEUE)
    assert cap is not None and cap < FLOOD
    bound = first_token_bound(engine, QUESTION_TOKENS)
    with (launched_app(engine, MAX_QUEUE, api_key=KEYS) as url,
          httpx.Client(base_url=url, timeout=300, limits=httpx.Limits(max_connections=2 * FLOOD)) as http):
        statuses: list[int] = []
        for q in range(3):
            answers, question, arrived = _round(tiny_runner, engine, http, cap, q, salted)
            statuses += [r.status_code for r in answers]
            wait_idle(engine)

            records = engine.recent()
            mine = next(m for m in records if m.prompt_ids == question)
            flood_prompts = {tuple(_ids(100 * q + i, FLOOD_TOKENS)) for i in range(FLOOD)}  # ids are random:
            flooded = [m for m in records if tuple(m.prompt_ids) in flood_prompts]  # this round's, by prompt
            assert len(flooded) == cap  # the flood's accepted requests, all queued before the question
            token_at = first_token_step(engine, mine.request_id)
            assert token_at is not None and token_at - arrived <= bound, (token_at, arrived, bound)
            # Prefilled ahead of the flooder's queue: of its requests queued before the question,
            # only the oldest got a prefill chunk in a step before the question's first token (the
            # others may take what the question leaves of that step's budget: work-conserving).
            started = [first_chunk_step(engine, m.request_id) for m in flooded]
            assert sum(s is not None and s < token_at for s in started) <= 1, (started, token_at)
            # One owner for the flooder, whatever its salts: never more rows than one owner's cap.
            owners = {owner_of(m.namespace) for m in flooded}
            assert len(owners) == 1 and owner_of(mine.namespace) not in owners
            flooder = next(iter(owners))
            for rec in engine.step_log():
                assert sum(owner_of(ns) == flooder for ns in rec.namespaces) <= owner_row_cap(engine.scheduler.config), rec
            if salted:
                assert len({m.namespace for m in flooded}) == cap  # a namespace per salt, inside one owner
        # The flooder's excess was 429 every time; the inbox was never full (no 503 for anyone).
        assert statuses.count(200) == 3 * cap and statuses.count(429) == 3 * (FLOOD - cap)
        # What the flooder cached (salted requests are stored) is charged to its one owner.
        cached_by = {o for o, n in engine.cache.tree.owner_tokens().items() if n and o.startswith("api-")}
        assert cached_by <= {flooder}
    wait_idle(engine)
    assert_clean(engine)
