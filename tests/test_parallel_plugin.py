"""``tests/parallel.py``: two workers unless the run names its own count or wants none."""

from __future__ import annotations

import pytest

from tests.parallel import _names_workers


@pytest.mark.parametrize("args", [["-n", "4"], ["-n0"], ["-nauto"], ["--numprocesses=3"], ["--numprocesses", "1"],
                                  ["-p", "no:xdist"], ["-pno:xdist"], ["--pdb"], ["tests", "--trace"]])
def test_a_run_that_names_its_workers_is_left_alone(args):
    assert _names_workers(args)


@pytest.mark.parametrize("args", [[], ["tests/engine", "-q"], ["-m", "not slow"], ["-p", "no:cacheprovider"],
                                  ["-k", "n2"], ["-p"]])
def test_a_plain_run_gets_two_workers(args):
    assert not _names_workers(args)
