"""Runs of several JAX processes on this machine, started by the multi-process example's
launcher (``examples/multiprocess.py``: ``Processes``, ``join``), for the tests that start
them."""

from __future__ import annotations

import functools
import os
import pathlib
from types import ModuleType

from _multidevice import DEFAULT_FUSIONS
from _scripts import load_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "multiprocess.py"


@functools.cache
def example() -> ModuleType:
    """``examples/multiprocess.py``, imported (it is not in a package)."""
    return load_script(EXAMPLE)


#: The compiler options of the runs, for a program in the tests' process that must compile as
#: theirs do: the init of test_multiprocess.py's reference is within 1e-7 of the runs' with
#: XLA:CPU's default code generator for fusions, 1.2e-7 with the older one that the suite uses
#: (tests/conftest.py).
AS_THE_RUNS = {"xla_backend_optimization_level": 0} | (
    {"xla_cpu_use_fusion_emitters": True} if DEFAULT_FUSIONS else {})


def env(**extra) -> dict:
    """The processes' environment: this checkout's stackwise and the tests' helpers, CPU only,
    the suite's strict numerics and XLA_FLAGS (tests/conftest.py: XLA's backend optimisations
    off; compile time dominates these tiny runs) but XLA:CPU's default code generator for
    fusions (``AS_THE_RUNS``)."""
    path = os.pathsep.join(
        filter(None, [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")])
    )
    environ = dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS="cpu", PYTHONWARNINGS="error")
    flags = f"{os.environ.get('XLA_FLAGS', '')} {DEFAULT_FUSIONS}"
    environ.update(JAX_NUMPY_RANK_PROMOTION="raise", XLA_FLAGS=flags.strip())
    return {**environ, **extra}
