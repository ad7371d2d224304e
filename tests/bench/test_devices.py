"""benchmarks/_devices.py: the mesh benchmarks simulate their devices on the CPU, a TPU host's
``JAX_PLATFORMS=tpu`` and XLA_FLAGS already set notwithstanding, and name the backend."""

import os
import pathlib
import subprocess
import sys

import pytest
from _scripts import load_script

BENCHMARKS = pathlib.Path(__file__).parents[2] / "benchmarks"


def test_the_devices_are_simulated_on_the_cpu_whatever_the_host_set():
    code = ("import _devices; _devices.simulate_cpu_devices(4); import jax; "
            "print(jax.default_backend(), jax.device_count()); "
            "print(_devices.header('**table**'))")
    env = dict(os.environ, JAX_PLATFORMS="tpu", XLA_FLAGS="--xla_backend_optimization_level=0",
               PYTHONPATH=str(BENCHMARKS))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    first, second = out.stdout.splitlines()
    assert first == "cpu 4"
    assert second.startswith("**table** (on cpu: 4 x cpu; jax ")


def test_after_jax_started_it_is_refused():
    import jax  # noqa: F401  (started, as in this process)

    devices = load_script(BENCHMARKS / "_devices.py")
    with pytest.raises(RuntimeError, match="before importing jax"):
        devices.simulate_cpu_devices(8)
