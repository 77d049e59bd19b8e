"""Commit subjects stay under 72 characters, the detail in the body (issue 47, point 8). Checked
from the commit that set the rule on; skipped where the history is not at hand (a shallow clone,
an unpacked archive)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RULE_FROM = "75e684a"  # the last commit before the rule was checked
MAX_SUBJECT = 72


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout


def test_commit_subjects_since_the_rule_are_under_72_characters():
    try:
        _git("cat-file", "-e", f"{RULE_FROM}^{{commit}}")
        subjects = _git("log", "--format=%h %s", f"{RULE_FROM}..HEAD").splitlines()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no git history here")
    long = [line for line in subjects if len(line.split(" ", 1)[1]) >= MAX_SUBJECT]
    assert not long, "commit subjects of 72 characters or more:\n" + "\n".join(long)
