"""docs/conversion.md's examples run as written (each framework's section, in one namespace)."""

import doctest
import pathlib

import pytest

pytestmark = pytest.mark.slow  # see `docs/contributing.md`, "Fast tests"

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "conversion.md"


def test_conversion_docs_examples_run():
    result = doctest.testfile(
        str(DOC),
        module_relative=False,
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
        verbose=False,
    )
    assert result.attempted > 40
    assert result.failed == 0, f"{result.failed} example(s) in {DOC.name} failed"
