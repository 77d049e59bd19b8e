"""tools.measure.run_clients: the closed loop's clock starts once every client is ready."""

from __future__ import annotations

import threading
import time

from tools.measure import run_clients


def test_what_clients_prepare_is_off_the_clock_and_each_gets_its_own():
    made, used = [], []
    lock = threading.Lock()

    def prepare() -> object:
        time.sleep(0.3)  # an HTTP client's TLS context, say
        thing = object()
        with lock:
            made.append(thing)
        return thing

    def client(thing: object) -> None:
        time.sleep(0.05)
        with lock:
            used.append(thing)

    wall = run_clients(client, 4, prepare=prepare)
    assert wall < 0.25 and sorted(map(id, made)) == sorted(map(id, used)) and len(set(map(id, used))) == 4


def test_without_prepare_clients_take_no_argument():
    calls = []
    wall = run_clients(lambda: calls.append(1), 3)
    assert calls == [1, 1, 1] and wall < 1
