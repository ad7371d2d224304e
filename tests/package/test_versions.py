"""The declared lower bounds are the versions that are tested.

pyproject.toml is the one place that declares them: every requirement is `name>=version`, no
cap, so a plain install takes the newest releases. `.ci/oldest.txt` pins exactly those versions
(`==`); `.ci/oldest` installs the project under it in a fresh virtual environment and runs the
fast tier there. These tests keep the two files equal and, in that environment (which sets
STACKWISE_TESTS_OLDEST), check that it holds the oldest versions and that `requires-python` is
what they need. Elsewhere (the newest versions) that check is skipped; so are they all in an
unpacked sdist, which has no `.ci/`.
"""

import importlib.metadata
import os
import pathlib
import re
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"
OLDEST = ROOT / ".ci" / "oldest.txt"
#: A requirement that declares a lower bound and nothing else.
LOWER_BOUND = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)>=([0-9]+(?:\.[0-9]+)*)")
#: A pin of `.ci/oldest.txt`.
PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9]+(?:\.[0-9]+)*)")

if not OLDEST.parent.is_dir():
    pytest.skip(
        "no .ci/ here (an unpacked sdist): CI's files are the checkout's", allow_module_level=True
    )


def normalized(name: str) -> str:
    """The name as pip compares it (PEP 503): `Orbax_Checkpoint` is `orbax-checkpoint`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def project() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["project"]


def declared_lower_bounds() -> dict[str, str]:
    """Every requirement of `dependencies` and the extras (bar the project's own extras): its
    lower bound, by normalized name."""
    requirements = list(project()["dependencies"])
    for extra in project()["optional-dependencies"].values():
        requirements += [r for r in extra if not r.startswith("stackwise[")]
    bounds: dict[str, str] = {}
    for requirement in requirements:
        match = LOWER_BOUND.fullmatch(requirement)
        assert match, (
            f"pyproject.toml requires {requirement!r}: write it as 'name>=version' (a tested "
            "lower bound, no cap and no marker), and pin that version in .ci/oldest.txt"
        )
        name, version = normalized(match[1]), match[2]
        assert bounds.setdefault(name, version) == version, (
            f"pyproject.toml declares {name} twice, >={bounds[name]} and >={version}"
        )
    return bounds


def oldest_pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in OLDEST.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            match = PIN.fullmatch(line)
            assert match, f".ci/oldest.txt: {line!r} is not a pin 'name==version'"
            assert normalized(match[1]) not in pins, f".ci/oldest.txt pins {match[1]} twice"
            pins[normalized(match[1])] = match[2]
    return pins


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def test_every_lower_bound_is_pinned_in_oldest_txt():
    bounds, pins = declared_lower_bounds(), oldest_pins()
    expected = "".join(f"{name}=={version}\n" for name, version in sorted(bounds.items()))
    assert pins == bounds, (
        "the pins of .ci/oldest.txt are not the lower bounds of pyproject.toml; they would "
        f"be:\n{expected}"
    )


def test_requires_python_is_a_lower_bound_this_python_meets():
    match = re.fullmatch(r">=3\.([0-9]+)", project()["requires-python"])
    assert match, f"requires-python is {project()['requires-python']!r}, not '>=3.N'"
    assert sys.version_info >= (3, int(match[1]))


@pytest.fixture
def oldest_environment() -> dict[str, str]:
    """The pins, where every pinned package is installed at its pin (under `.ci/oldest`)."""
    pins = oldest_pins()
    installed = {}
    for name in pins:
        try:
            installed[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed[name] = None
    if installed != pins:
        found = ", ".join(
            f"{name} {installed[name]}" for name in pins if installed[name] != pins[name]
        )
        if os.environ.get("STACKWISE_TESTS_OLDEST"):
            pytest.fail(
                f"STACKWISE_TESTS_OLDEST is set, but these are not .ci/oldest.txt's pins: {found}"
            )
        pytest.skip(f"not the oldest versions ({found}): .ci/oldest runs this")
    return pins


def test_requires_python_is_what_the_oldest_versions_need(oldest_environment):
    """`requires-python` is the highest of the oldest versions' own `Requires-Python` (jax's):
    no lower, since they do not install there, and no higher, since they run here."""
    floors = {}
    for name in oldest_environment:
        needs = importlib.metadata.metadata(name).get("Requires-Python") or ""
        floor = re.search(r">=\s*([0-9]+\.[0-9]+)", needs)
        floors[name] = floor[1] if floor else "3.0"
    highest = max(floors.values(), key=version_tuple)
    assert project()["requires-python"] == f">={highest}", floors
