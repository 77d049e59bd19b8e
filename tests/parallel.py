"""The suite on three worker processes (pytest-xdist), whole files to a worker.

Loaded by ``-p tests.parallel`` (pyproject's ``addopts``). Adds ``-n 3 --dist loadfile`` to a run
when pytest-xdist is installed, the run names no worker count of its own (``-n``, or ``-p
no:xdist``) and it is not itself inside a worker (a test that starts pytest again, such as the
ZeroGPU fork tests or the GPU check's rehearsal, runs it serially). ``RADIX_TEST_WORKERS`` sets
the count: 0 runs serially (a debugger, ``--pdb``); the default is 3 on any machine. A run
on workers sets ``OMP_WAIT_POLICY=PASSIVE`` unless it is set (below).

Longest first: the files in ``LONGEST_FIRST`` are handed out before the rest (without it xdist
orders files by their number of tests, and a long file with few tests could start last).

Why whole files: a module's fixtures (a launched app, a first run the restart matrix copies, a
vLLM server) are made once per worker that runs any of its tests, so splitting a file would make
them twice. Why three on two cores: much of a test's time is a subprocess starting, a server polled
or a browser waiting, and the tiny model's steps are Python-bound on one core. Measured on the 2-core
EPYC (December 2026), the whole suite: 16:43 on two workers, 15:01 on three, both cores busy (idle
1%); four only adds switching.
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


HANG_TIMEOUT_S = 1200  # a test still running after this fails (pytest-timeout), instead of holding CI for its 90 minutes


def pytest_load_initial_conftests(early_config, parser, args):
    # A hang fails its test with every thread's stack in the log, where pytest-timeout is installed
    # (requirements-dev.txt; the GPU check's venvs run without it) and the run names no timeout itself.
    if importlib.util.find_spec("pytest_timeout") is not None and not any(a.startswith("--timeout") for a in args):
        args[:0] = [f"--timeout={HANG_TIMEOUT_S}"]
    workers = os.environ.get("RADIX_TEST_WORKERS", "3").strip() or "3"
    if (workers == "0" or os.environ.get("PYTEST_XDIST_WORKER") or importlib.util.find_spec("xdist") is None
            or _names_workers(args)):
        return
    args[:0] = ["-n", workers, "--dist", "loadfile", "--no-loadscope-reorder"]
    # Several workers on two cores, each with PyTorch's OpenMP threads: by default an idle OpenMP
    # thread spins for a while before it sleeps, burning a core another worker needs. Passive waiting
    # changes no result (only how idle threads wait) and took a tenth off the CPU-bound files here.
    # Set before any worker (or app process a test starts) loads libgomp.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# The files that take longest, longest first (worker-seconds in a two-worker run on the 2-core
# machine, December 2026: 300, 175, 138, 118, 104, 92, 88, 60). Handed out first, so that no long
# file starts when the other worker is nearly done; every other file follows in collection order.
LONGEST_FIRST = (
    "tests/app/test_restart_matrix.py",
    "tests/tools/test_gpu_check.py",
    "tests/ui/test_demo_browser.py",
    "tests/server/remote/test_fleet.py",
    "tests/app/test_fuzz.py",
    "tests/server/remote/test_vllm_events.py",
    "tests/server/remote/test_fleet_vllm.py",
    "tests/ui/test_ui_browser.py",
)


def pytest_collection_modifyitems(session, config, items):
    """Items of the ``LONGEST_FIRST`` files moved to the front in that order (a stable sort: a
    file's items stay together and in their order). Every worker sorts the same collection the
    same way, and with ``--no-loadscope-reorder`` xdist hands files out in this order."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
