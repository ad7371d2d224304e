"""Strict numerics for every test (as in equinox's conftest), and the fast tier.

``pytest -m "not slow"`` is the fast tier (README.md, "Fast tests"): every test function
once, with its first parameters, except those marked ``@pytest.mark.slow`` and those that
read the 8-device subprocess (the ``multi_device`` fixtures of ``tests/distributed``). A
parametrized test whose every case is cheap and matters on its own (the doctests of each
module) is marked ``@pytest.mark.every_case`` and runs whole in the fast tier.
"""

import jax
import pytest

# Implicit rank promotion hides shape bugs in layer code; make it an error.
jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seen: set[str] = set()
    for item in items:
        if "multi_device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
        elif hasattr(item, "callspec") and not item.get_closest_marker("every_case"):
            function = item.nodeid.split("[")[0]
            if function in seen:
                item.add_marker(pytest.mark.slow)
            seen.add(function)
