"""Strict numerics for every test (as in equinox's conftest), and the fast tier.

``pytest -m "not slow"`` is the fast tier (README.md, "Fast tests"): every test function
once, with its first parameters, except those marked ``@pytest.mark.slow`` and those that
read the 8-device subprocess (the ``multi_device`` fixtures of ``tests/distributed``). A
parametrized test whose every case is cheap and matters on its own (the doctests of each
module) is marked ``@pytest.mark.every_case`` and runs whole in the fast tier.
"""

import os

# XLA's LLVM optimisation of the tests' tiny programs costs more than running them (the suite is
# dominated by compiling), and no test reads the generated machine code: the tests compile at
# XLA's backend optimisation level 0, as the 8-device workers and the example's runs do. The HLO
# passes, and so the programs the tests read (their collectives, loops, buffer sizes), are the
# same. Set before JAX starts its CPU backend, which reads XLA_FLAGS once.
os.environ["XLA_FLAGS"] = " ".join(
    filter(None, [os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0"])
)

import jax  # noqa: E402
import pytest  # noqa: E402

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
