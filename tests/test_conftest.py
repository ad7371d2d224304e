"""tests/conftest.py's settings by backend, decided before JAX starts: XLA:CPU's compile flags
on the CPU only (XLA_FLAGS reach every backend's compiler), float32 matmuls at 'highest' off it.
Checked in subprocesses that load the conftest and start no backend (no TPU needed). Then the
run's compilation cache, and the one MLIR context per thread that JAX's lowerings share."""

import json
import os
import pathlib
import subprocess
import sys
import threading
import tomllib
import types

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


# Two tests that compile the same program (a new function object each: JAX's in-memory caches
# miss), a third that records the cache's folder; each test's cache hits, from JAX's events.
SHARED = '''
import json, os, pathlib
import jax, jax.numpy as jnp

HITS = []
jax.monitoring.register_event_listener(
    lambda event, **kw: HITS.append(event) if event.endswith("/cache_hits") else None)

def hits():
    return sum(1 for _ in HITS)

def test_compiles():
    jax.jit(lambda x: x * 3.0 + 1.0)(jnp.arange(5.0)).block_until_ready()
    pathlib.Path(os.environ["RECORD"], "first").write_text(str(hits()))

def test_compiles_the_same_program_again():
    jax.jit(lambda x: x * 3.0 + 1.0)(jnp.arange(5.0)).block_until_ready()
    pathlib.Path(os.environ["RECORD"], "second").write_text(str(hits()))

def test_a_torn_entry_is_compiled_again():
    if os.environ.get("TEAR"):  # (every entry cut short, as one being written by another worker)
        for entry in pathlib.Path(jax.config.jax_compilation_cache_dir).iterdir():
            entry.write_bytes(entry.read_bytes()[:20])
    before = hits()
    assert jax.jit(lambda x: x * 3.0 + 1.0)(jnp.arange(5.0)).tolist() == [1.0, 4.0, 7.0, 10.0, 13.0]
    pathlib.Path(os.environ["RECORD"], "torn").write_text(str(hits() - before))

def test_where():
    pathlib.Path(os.environ["RECORD"], "where").write_text(json.dumps(
        [jax.config.jax_compilation_cache_dir, os.environ.get("JAX_COMPILATION_CACHE_DIR"),
         os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")]))
'''


def _run_shared(tmp_path, *options, **environ):
    """Runs SHARED under a copy of the suite's conftest, in one process; returns the number
    of cache hits after each of its two compiling tests and what its third test saw."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "conftest.py").write_text(CONFTEST.read_text())
    (folder / "test_shared.py").write_text(SHARED)
    record = tmp_path / "record"
    record.mkdir()
    # (a run of its own; but the XLA flags this jaxlib takes, asked once per session, are
    # passed on: the child's conftest does not ask again, 1.3 s of each run)
    env = {k: v for k, v in os.environ.items() if not k.startswith(
        ("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "PYTEST_XDIST", "STACKWISE_TESTS"))
        or k == "STACKWISE_TESTS_XLA_KNOWS"}
    env.update(JAX_PLATFORMS="cpu", RECORD=str(record), TPU_COSTS_OUT=str(tmp_path / "c.json"),
               **environ, PYTHONPATH=os.pathsep.join(
                   [str(CONFTEST.parent), str(CONFTEST.parents[1] / ".ci"),
                    env.get("PYTHONPATH", "")]))
    # (the suite's warning filters, pyproject.toml's: every warning an error but those named)
    filters = tomllib.loads((CONFTEST.parents[1] / "pyproject.toml").read_text())[
        "tool"]["pytest"]["ini_options"]["filterwarnings"]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-p", "no:xdist", *(f"-W{f}" for f in filters), *options,
                          str(folder)],
                         cwd=folder, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    return (int((record / "first").read_text()), int((record / "second").read_text()),
            json.loads((record / "where").read_text()))


def test_the_run_shares_its_compiled_programs_in_a_cache_of_its_own(tmp_path):
    first, second, (folder, exported, floor) = _run_shared(tmp_path)
    # The second test's program is read from the cache that the first test's compile filled.
    assert first == 0 and second >= 1
    # The run's own folder, exported to the tests' subprocesses, with no compile-time floor;
    # removed when the run ended.
    assert folder == exported and "stackwise-tests-jax-cache-" in folder and floor == "0"
    assert not pathlib.Path(folder).exists()


def test_an_entry_read_while_another_worker_writes_it_is_compiled_again(tmp_path):
    # JAX writes an entry without a lock; read torn, it warns and compiles the program: the
    # suite's filters let that warning pass (pyproject.toml), the test gets its result.
    run = _run_shared(tmp_path, TEAR="1")
    assert int((tmp_path / "record" / "torn").read_text()) == 0
    assert run[1] >= 1  # (the cache was read before it was torn)


def test_no_cache_under_the_tpu_tiers_costs_plugin(tmp_path):
    # (.ci/tpu's dry run on the CPU counts the programs that the chip would compile)
    first, second, (folder, exported, floor) = _run_shared(tmp_path, "-p", "tpu_costs")
    assert first == second == 0 and folder is exported is None


def test_a_cache_set_by_the_user_is_theirs(tmp_path):
    mine = tmp_path / "my-cache"
    *_, (folder, exported, floor) = _run_shared(tmp_path, JAX_COMPILATION_CACHE_DIR=str(mine))
    assert folder == exported == str(mine) and floor is None  # (their own floor)
    assert mine.is_dir()  # kept after the run


def test_no_cache_is_made_off_the_cpu():
    import conftest

    environ = {"HOME": "/h"}
    assert conftest._share_compiled_programs(environ, on_cpu=False) is None
    assert environ == {"HOME": "/h"}


def test_a_threads_lowerings_share_one_mlir_context():
    import jax
    import jax.numpy as jnp

    def context(f, *args):  # (each f a new function: no lowering is read from JAX's caches)
        return jax.jit(f).lower(*args).compiler_ir().context

    first = context(lambda x: jnp.sin(x) + 1, jnp.ones(3))
    assert context(lambda x, y: x @ y + 1, jnp.ones((2, 2)), jnp.ones((2, 2))) is first
    other = []
    thread = threading.Thread(
        target=lambda: other.append(context(lambda x: jnp.cos(x) + 1, jnp.ones(3))))
    thread.start()
    thread.join()
    assert other[0] is not first and context(lambda x: jnp.cos(x) + 1, jnp.ones(4)) is first


def test_no_context_is_shared_where_jax_has_no_make_ir_context_or_shares_it_already():
    import conftest

    assert conftest._one_mlir_context_per_thread(None) is False
    assert conftest._one_mlir_context_per_thread(types.SimpleNamespace()) is False
    made = []
    mlir = types.SimpleNamespace(make_ir_context=lambda: made.append(object()) or made[-1])
    assert conftest._one_mlir_context_per_thread(mlir) is True
    assert mlir.make_ir_context() is mlir.make_ir_context() and len(made) == 1
    assert conftest._one_mlir_context_per_thread(mlir) is False  # (shared already)
