"""``tests/parallel.py``: three workers unless the run names its own count or wants none."""

from __future__ import annotations

import pytest

from tests.parallel import _names_workers


@pytest.mark.parametrize("args", [["-n", "4"], ["-n0"], ["-nauto"], ["--numprocesses=3"], ["--numprocesses", "1"],
                                  ["-p", "no:xdist"], ["-pno:xdist"], ["--pdb"], ["tests", "--trace"]])
def test_a_run_that_names_its_workers_is_left_alone(args):
    assert _names_workers(args)


@pytest.mark.parametrize("args", [[], ["tests/engine", "-q"], ["-m", "not slow"], ["-p", "no:cacheprovider"],
                                  ["-k", "n2"], ["-p"]])
def test_a_plain_run_gets_the_default_workers(args):
    assert not _names_workers(args)


def test_the_longest_files_exist_and_go_first():
    """A file renamed or removed must leave ``LONGEST_FIRST`` too (or it would silently go last)."""
    from pathlib import Path

    from tests.parallel import LONGEST_FIRST, pytest_collection_modifyitems

    root = Path(__file__).resolve().parents[1]
    assert all((root / path).is_file() for path in LONGEST_FIRST), LONGEST_FIRST
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)

    class Item:
        def __init__(self, nodeid: str) -> None:
            self.nodeid = nodeid

    ids = ["tests/a.py::x", "tests/a.py::y", f"{LONGEST_FIRST[1]}::z", f"{LONGEST_FIRST[0]}::w[1]",
           f"{LONGEST_FIRST[0]}::w[2]", "tests/b.py::v"]
    items = [Item(i) for i in ids]
    pytest_collection_modifyitems(None, None, items)
    assert [i.nodeid for i in items] == [ids[3], ids[4], ids[2], ids[0], ids[1], ids[5]]
