"""The two install lines stay in step: ``requirements.txt`` resolves on Python 3.11 (CPU Space, CI)
and on Python 3.10 (a ZeroGPU Space runs 3.10.13) through environment markers, and
``requirements-py310.txt`` spells out what the markers give on 3.10, for CI's 3.10-line venv
(``.ci/run``). Only the packages whose newest release needs 3.11, or whose version ZeroGPU caps,
may differ. Parsed, nothing installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
# transformers >= 5.21 and networkx >= 3.5 need Python 3.11; ZeroGPU supports torch 2.1.0-2.8.0.
MAY_DIFFER = {"torch", "transformers", "networkx"}
PY310_LINE = {"torch": "2.8.0", "transformers": "5.20.2", "networkx": "3.4.2"}


def _requirements(name: str) -> list[Requirement]:
    out = []
    for line in (ROOT / name).read_text().splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith(("#", "-")):
            out.append(Requirement(line))
    return out


def _env(python: str) -> dict[str, str]:
    env = default_environment()
    env.update(python_version=python, python_full_version=f"{python}.13", sys_platform="linux",
               platform_system="Linux", platform_machine="x86_64", implementation_name="cpython",
               platform_python_implementation="CPython")
    return env


def _pins(reqs: list[Requirement], python: str) -> dict[str, str]:
    """{package: pinned version} of the lines whose marker holds on ``python``; one pin each."""
    out: dict[str, str] = {}
    for r in reqs:
        if r.marker is not None and not r.marker.evaluate(_env(python)):
            continue
        [spec] = r.specifier
        assert spec.operator == "==", f"{r}: pin with == (both lines must install the same thing every time)"
        name = r.name.lower().replace("_", "-")
        assert name not in out, f"{r.name} pinned twice for Python {python}"
        out[name] = spec.version
    return out


@pytest.mark.parametrize("python", ["3.10", "3.11", "3.12"])
def test_every_package_has_exactly_one_pin_on_each_python(python):
    main = _pins(_requirements("requirements.txt"), python)
    names = {r.name.lower().replace("_", "-") for r in _requirements("requirements.txt")}
    assert set(main) == names, f"Python {python} gets no pin for {sorted(names - set(main))}"


def test_the_markers_give_the_310_line_on_python_310():
    main = _pins(_requirements("requirements.txt"), "3.10")
    assert {k: main[k] for k in PY310_LINE} == PY310_LINE


def test_python_311_keeps_the_tested_pins():
    main = _pins(_requirements("requirements.txt"), "3.11")
    assert main["torch"] == "2.13.0" and main["transformers"] == "5.24.0" and main["networkx"] == "3.6.1"


def test_requirements_py310_spells_out_what_the_markers_give_on_310():
    py310 = _requirements("requirements-py310.txt")
    assert all(r.marker is None for r in py310), "requirements-py310.txt is for one Python: no markers"
    assert _pins(py310, "3.10") == _pins(_requirements("requirements.txt"), "3.10")


def test_the_lines_differ_only_where_they_must():
    on_310 = _pins(_requirements("requirements-py310.txt"), "3.10")
    on_311 = _pins(_requirements("requirements.txt"), "3.11")
    assert set(on_310) == set(on_311)
    differ = {k for k in on_311 if on_310[k] != on_311[k]}
    assert differ <= MAY_DIFFER, f"only {sorted(MAY_DIFFER)} may differ between the lines, not {sorted(differ - MAY_DIFFER)}"


def test_zerogpu_torch_range():
    from packaging.version import Version

    torch = Version(_pins(_requirements("requirements-py310.txt"), "3.10")["torch"])
    assert Version("2.1.0") <= torch <= Version("2.8.0"), "ZeroGPU supports torch 2.1.0-2.8.0"


def test_project_python_floor_is_310():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'requires-python = ">=3.10"' in text and 'target-version = "py310"' in text

