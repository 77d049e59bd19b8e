"""The suite on two worker processes (pytest-xdist), whole files to a worker.

Loaded by ``-p tests.parallel`` (pyproject's ``addopts``). Adds ``-n 2 --dist loadfile`` to a run
when pytest-xdist is installed, the run names no worker count of its own (``-n``, or ``-p
no:xdist``) and it is not itself inside a worker (a test that starts pytest again, such as the
ZeroGPU fork tests or the GPU check's rehearsal, runs it serially). ``RADIX_TEST_WORKERS`` sets
the count: 0 runs serially (a debugger, ``--pdb``), the default 2 suits a 2-core machine.

Why whole files: a module's fixtures (a launched app, a first run the restart matrix copies, a
vLLM server) are made once per worker that runs any of its tests, so splitting a file would make
them twice. Why two: much of a test's time is a subprocess starting, a server polled or a browser
waiting, and the tiny model's steps are Python-bound on one core; the other worker fills it.
"""

from __future__ import annotations

import importlib.util
import os


def _names_workers(args: list[str]) -> bool:
    """The run says itself how many workers, or that it wants none (``--pdb`` cannot cross one)."""
    for i, a in enumerate(args):
        if a in ("-n", "--numprocesses", "--pdb", "--trace", "-pno:xdist") or a.startswith("--numprocesses="):
            return True
        if a.startswith("-n") and (a[2:].isdigit() or a[2:] in ("auto", "logical")):
            return True
        if a == "-p" and args[i + 1:i + 2] == ["no:xdist"]:
            return True
    return False


def pytest_load_initial_conftests(early_config, parser, args):
    workers = os.environ.get("RADIX_TEST_WORKERS", "2").strip() or "2"
    if (workers == "0" or os.environ.get("PYTEST_XDIST_WORKER") or importlib.util.find_spec("xdist") is None
            or _names_workers(args)):
        return
    args[:0] = ["-n", workers, "--dist", "loadfile"]
