"""Which tier runs: the fast tier (``pytest -m "not slow"``) or the whole suite, as the test
modules see it when they are imported (tests/conftest.py sets ``FAST`` before collecting)."""

#: Whether this run selects the fast tier (set by tests/conftest.py's ``pytest_configure``).
FAST = False


def examples(whole: int, fast: int) -> int:
    """Hypothesis's ``max_examples`` for a search that stands in the fast tier: ``whole`` in
    the whole suite, ``fast`` (fewer) in the fast tier."""
    return fast if FAST else whole
