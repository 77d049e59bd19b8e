"""The two install lines of ``requirements.txt`` stay in step, through environment markers: the local
CPU line on Python 3.11 (torch 2.13.0, tested everywhere) and the Space line on Python 3.12 (a ZeroGPU
Space runs 3.12.12: a torch on ZeroGPU's list and a pinned ``spaces``), which CI installs on a real
3.12 (``.ci/run``, "Space line"). The README's Space card names that Python. Parsed, nothing installed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
# docs/hub/spaces-zerogpu.md (hub-docs 242f4a1): the PyTorch versions and Pythons ZeroGPU runs.
ZEROGPU_TORCH = {"2.8.0", "2.9.1", "2.10.0", "2.11.0"}
ZEROGPU_PYTHONS = {"3.12", "3.10"}
SPACE_LINE = {"torch": "2.11.0", "spaces": "0.51.3"}
MAY_DIFFER = {"torch", "spaces"}


def _requirements(name: str = "requirements.txt") -> list[Requirement]:
    out = []
    for line in (ROOT / name).read_text().splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith(("#", "-")):
            out.append(Requirement(line))
    return out


def _env(python: str) -> dict[str, str]:
    env = default_environment()
    env.update(python_version=python, python_full_version=f"{python}.1", sys_platform="linux",
               platform_system="Linux", platform_machine="x86_64", implementation_name="cpython",
               platform_python_implementation="CPython")
    return env


def _pins(python: str) -> dict[str, str]:
    """{package: pinned version} of the lines whose marker holds on ``python``; one pin each."""
    out: dict[str, str] = {}
    for r in _requirements():
        if r.marker is not None and not r.marker.evaluate(_env(python)):
            continue
        [spec] = r.specifier
        assert spec.operator == "==", f"{r}: pin with == (both lines must install the same thing every time)"
        name = r.name.lower().replace("_", "-")
        assert name not in out, f"{r.name} pinned twice for Python {python}"
        out[name] = spec.version
    return out


@pytest.mark.parametrize("python", ["3.11", "3.12"])
def test_every_package_has_one_pin_on_each_line(python):
    pins = _pins(python)
    names = {r.name.lower().replace("_", "-") for r in _requirements()} - ({"spaces"} if python == "3.11" else set())
    assert set(pins) == names, f"Python {python} gets no pin for {sorted(names - set(pins))}"


def test_python_311_keeps_the_tested_cpu_line():
    pins = _pins("3.11")
    assert pins["torch"] == "2.13.0" and pins["transformers"] == "5.24.0" and pins["networkx"] == "3.6.1"
    assert "spaces" not in pins


def test_the_space_line_is_what_zerogpu_runs():
    pins = _pins("3.12")
    assert {k: pins[k] for k in SPACE_LINE} == SPACE_LINE
    assert pins["torch"] in ZEROGPU_TORCH, f"torch {pins['torch']}: ZeroGPU runs {sorted(ZEROGPU_TORCH)}"


def test_the_lines_differ_only_where_they_must():
    on_311, on_312 = _pins("3.11"), _pins("3.12")
    differ = {k for k in on_312 if on_311.get(k) != on_312[k]}
    assert differ <= MAY_DIFFER, f"only {sorted(MAY_DIFFER)} may differ between the lines, not {sorted(differ - MAY_DIFFER)}"


def test_the_space_card_names_the_space_lines_python():
    card = (ROOT / "README.md").read_text().split("\n---\n", 1)[0]
    found = re.search(r'^python_version: "?([0-9.]+)"?$', card, re.M)
    assert found and found[1] in ZEROGPU_PYTHONS and found[1] == "3.12", card
    assert re.search(r"^suggested_hardware: zero-a10g$", card, re.M), "the card suggests ZeroGPU hardware"


def test_ci_installs_the_space_line_on_a_real_312():
    ci = (ROOT / ".ci" / "run").read_text()
    block = ci.split("# BEGIN space-line\n", 1)[1].split("# END space-line", 1)[0]
    assert "pyenv prefix 3.12.1" in block and "-r requirements.txt" in block and "RADIX_REQUIRE_SPACES=1" in block
    assert "tests/app/test_zerogpu_page.py" in block
    assert not (ROOT / "requirements-py310.txt").exists()
