"""tests/conftest.py's settings by backend, decided before JAX starts: XLA:CPU's compile flags
on the CPU only (XLA_FLAGS reach every backend's compiler), float32 matmuls at 'highest' off it.
Checked in subprocesses that load the conftest and start no backend (no TPU needed)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

CONFTEST = pathlib.Path(__file__).with_name("conftest.py")
READ = (
    "import importlib.util, json, os, sys\n"
    f"spec = importlib.util.spec_from_file_location('tests_conftest', {str(CONFTEST)!r})\n"
    "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
    "import jax\n"
    "print(json.dumps([os.environ.get('XLA_FLAGS', ''),"
    " jax.config.jax_default_matmul_precision]))\n"
)


def _settings(platforms, precision=None):
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_DEFAULT_MATMUL_PRECISION")}
    env["JAX_PLATFORMS"] = platforms
    if precision:
        env["JAX_DEFAULT_MATMUL_PRECISION"] = precision
    out = subprocess.run([sys.executable, "-c", READ], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize("platforms", ["tpu", "tpu,cpu", "cuda"])
def test_off_the_cpu_no_cpu_flags_and_highest_precision(platforms):
    assert _settings(platforms) == ["", "highest"]
    assert _settings(platforms, precision="bfloat16") == ["", "bfloat16"]  # as asked


@pytest.mark.parametrize("platforms", ["cpu", "cpu,tpu"])
def test_on_the_cpu_its_flags_and_the_default_precision(platforms):
    flags, precision = _settings(platforms)
    assert "--xla_backend_optimization_level=0" in flags and precision is None


WORKERS = (
    "import importlib.util, os\n"
    f"spec = importlib.util.spec_from_file_location('tests_conftest', {str(CONFTEST)!r})\n"
    "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
    "print(os.environ.get('JAX_PLATFORMS', '<unset>'))\n"
)


@pytest.mark.parametrize(("workers", "platforms", "plugin", "expected"), [
    ("2", None, True, "cpu"),        # the README's `pytest -n 2` on a TPU host: both on the CPU
    ("1", None, True, "<unset>"),    # one process holds the chip
    ("2", "tpu", True, "tpu"),       # as asked
    ("2", None, False, "<unset>"),   # no accelerator
], ids=["two workers", "one worker", "platforms given", "no plugin"])
def test_several_xdist_workers_on_an_accelerator_host_run_on_the_cpu(
        tmp_path, workers, platforms, plugin, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["PYTEST_XDIST_WORKER_COUNT"] = workers
    if platforms:
        env["JAX_PLATFORMS"] = platforms
    if plugin:  # (a module that find_spec finds as the TPU's plugin; nothing imports it)
        (tmp_path / "libtpu.py").write_text("")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path),
                                                          env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", WORKERS], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.strip() == expected
