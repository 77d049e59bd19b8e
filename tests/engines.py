"""Engines for tests: the one factory that builds them and closes every one it built, the
random prompts they run, and the runner state machines build on.

Owns nothing of the engine: it knows ``Engine``'s constructor and ``close()`` and nothing else.
The fixtures in ``tests/conftest.py`` hand a factory to a test (``make_engine``) or to a module's
fixture (``make_module_engine``); each closes its engines at the end of its scope, passed or failed.
A test about construction or ``close()`` itself still builds its engine by hand, on a line that
says ``# by hand: <reason>`` (``tests/test_engine_factory.py`` reads every test for it).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.runner import ModelRunner


@cache
def machine_runner() -> ModelRunner:
    """The tiny random Llama for hypothesis state machines, one per process (a machine has no
    fixtures: it builds its engines and caches itself)."""
    from engine.model.loader import load_tokenizer
    from tests.conftest import make_tiny_runner

    return make_tiny_runner(load_tokenizer())


def rand_ids(seed: int | torch.Generator, n: int, vocab: int = 1000) -> list[int]:
    """``n`` token ids drawn uniformly from ``[10, vocab)`` (above the special tokens), from ``seed``
    or from a generator the caller keeps drawing from."""
    gen = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n,), generator=gen).tolist()


class EngineFactory:
    """``factory(runner=None, config=None, **settings)`` builds an ``Engine`` (on the default runner
    when none is given) and remembers it; ``close_all()`` closes them, newest first, passing over
    one its test closed itself."""

    def __init__(self, default_runner: Callable[[], ModelRunner]) -> None:
        self._default_runner = default_runner
        self._made: list[Engine] = []

    def __call__(self, runner: ModelRunner | None = None, config: EngineConfig | None = None,
                 **settings: Any) -> Engine:
        engine = Engine(self._default_runner() if runner is None else runner, config, **settings)
        self._made.append(engine)
        return engine

    def close_all(self) -> None:
        """Every engine closed even when one close raises; the first error is raised after."""
        errors: list[BaseException] = []
        while self._made:
            engine = self._made.pop()
            if not engine._closed:  # a test about what happens after close() has closed it
                try:
                    engine.close()
                except Exception as e:  # noqa: BLE001 - the rest must still close
                    errors.append(e)
        if errors:
            raise errors[0]
