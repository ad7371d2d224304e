"""Running test cases on 8 simulated CPU devices, in a subprocess.

A test module defines ``_CASES = {name: function}`` (each returns a JSON-able
dict), runs ``run_cases(_CASES)`` under ``if __name__ == "__main__"``, and its
tests read the results of ``run_module(__file__)`` (once, in a module-scoped
fixture) through ``result(results, name)``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable

import pytest


def run_cases(cases: dict[str, Callable[[], dict]]) -> None:
    """Runs every case in this (8-device) process and prints the results as JSON."""
    import warnings

    import jax

    jax.config.update("jax_numpy_rank_promotion", "raise")  # as tests/conftest.py does
    # A tie to JAX internals found broken on first use (stackwise/_upstream) fails the case,
    # as the suite's warnings-as-errors would: the worker's programs would differ.
    warnings.filterwarnings("error", message="JAX changed under stackwise")
    results = {}
    for name, case in cases.items():
        try:
            start = time.process_time()
            results[name] = case()
            results[name]["cpu_s"] = time.process_time() - start
        except Exception:  # noqa: BLE001 -- reported to the test that owns the case
            results[name] = {"error": traceback.format_exc()}
    print(json.dumps(results))


def run_module(path: str, timeout: int = 900, xla_flags: str = "") -> dict:
    """Runs the test module at ``path`` as a script on 8 simulated CPU devices, with the
    session's XLA_FLAGS (tests/conftest.py) and then ``xla_flags`` (the last of a flag wins)."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    flags = f"{flags} {xla_flags}"
    env = dict(os.environ, XLA_FLAGS=flags.strip())
    env["JAX_PLATFORMS"] = "cpu"
    # The worker is this test module run as a script: give it the tests' shared helpers.
    helpers = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [helpers, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, path], env=env, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode:
        pytest.fail(f"the 8-device worker failed:\n{proc.stderr[-5000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def result(results: dict, name: str) -> dict:
    """One case's result; fails the calling test if the case raised."""
    r = results[name]
    if "error" in r:
        pytest.fail(f"case {name} raised:\n{r['error']}")
    return r
