"""Runs of several JAX processes on this machine, started by the multi-process example's
launcher (``examples/multiprocess.py``: ``Processes``, ``join``), for the tests that start
them."""

from __future__ import annotations

import functools
import os
import pathlib
from types import ModuleType

from _scripts import load_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "multiprocess.py"


@functools.cache
def example() -> ModuleType:
    """``examples/multiprocess.py``, imported (it is not in a package)."""
    return load_script(EXAMPLE)


def env(**extra) -> dict:
    """The processes' environment: this checkout's stackwise and the tests' helpers, CPU only,
    the suite's strict numerics and XLA_FLAGS (tests/conftest.py: XLA's backend optimisations
    off; compile time dominates these tiny runs)."""
    path = os.pathsep.join(
        filter(None, [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")])
    )
    environ = dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS="cpu", PYTHONWARNINGS="error")
    environ.update(JAX_NUMPY_RANK_PROMOTION="raise", XLA_FLAGS=os.environ.get("XLA_FLAGS", ""))
    return {**environ, **extra}
