"""Strict numerics for every test (as in equinox's conftest), and the fast tier.

``pytest -m "not slow"`` is the fast tier (README.md, "Fast tests"): every test function
once, with its first parameters, except those marked ``@pytest.mark.slow`` and those that
read the 8-device subprocess (the ``multi_device`` fixtures of ``tests/distributed``). A
parametrized test whose every case is cheap and matters on its own (the doctests of each
module) is marked ``@pytest.mark.every_case`` and runs whole in the fast tier. The fast tier's
hypothesis searches draw fewer examples than the whole suite's (tests/_tiers.py).
"""

import functools
import gc
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import threading

# XLA's LLVM optimisation of the tests' tiny programs costs more than running them (the suite is
# dominated by compiling), and no test reads the generated machine code: the tests compile at
# XLA's backend optimisation level 0 (the HLO passes, and so the programs the tests read, their
# collectives, loops and buffer sizes, are the same), and with XLA:CPU's older code generator for
# fusions: its newer one ("fusion emitters") takes about twice as long to compile these programs
# (tests/core/test_stack.py: 33-38 s in XLA's compiles with it, 21 s without). Without it, XLA
# leaves a lone elementwise op unwrapped instead of making it a one-op fusion; the collectives,
# loops and other fusions are the same, a few temp buffer sizes differ (7 of the 121 programs
# that the tests compile with `.compile()`, by up to 14%), and
# float32 results may differ in the last bits (the tests' tolerances are relative and derived
# from what is summed, tests/_tolerance.py: they hold with either). XLA:CPU splits each
# program's LLVM module into up to 32 parts to compile them on threads; the tests' programs are
# small and the suite's two workers already use both cores, so the split costs more than it
# saves: in one part, the same machine code (the optimized HLO, memory figures and results are
# bitwise the same) for about 15% less CPU time in lowering and compiling (24 stack programs:
# 3.3-3.7 s against 4.1-4.2 s, three runs each, 2026-12-06), and less wall time on 2 cores.
# Set before JAX starts its CPU backend, which reads XLA_FLAGS once; the subprocesses that the
# tests start (the 8-device workers, the example's, the bench's and the multi-process runs)
# inherit them.
FLAGS = ["--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
         "--xla_cpu_parallel_codegen_split_count=1"]
#: The flags that a newer XLA may drop (the older code generator's, the split's).
OPTIONAL = FLAGS[1:]


def _xla_knows(flags: list[str]) -> list[str]:
    """Those of ``flags`` that this jaxlib's XLA takes (it aborts the process on one it does
    not know): asked once per session, in a subprocess (one per flag only if not all are
    known); the answer goes to the xdist workers through the environment."""
    key = "STACKWISE_TESTS_XLA_KNOWS"
    if key not in os.environ:
        def takes(some: list[str]) -> bool:
            env = dict(os.environ, XLA_FLAGS=" ".join(some), JAX_PLATFORMS="cpu")
            probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"],
                                   env=env, capture_output=True)
            return probe.returncode == 0

        known = flags if takes(flags) else [flag for flag in flags if takes([flag])]
        os.environ[key] = " ".join(known)
    return os.environ[key].split()


def _accelerator_plugins() -> list[str]:
    """The accelerator plugins of JAX installed here (libtpu, JAX's CUDA and ROCm plugins)."""
    plugins = ("libtpu", "jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin")
    return [name for name in plugins if importlib.util.find_spec(name)]


def _workers_take_the_cpu(environ: dict, plugins: list[str]) -> bool:
    """Whether this process is one of several pytest-xdist workers (the README's ``pytest -n
    2``) on a host with an accelerator and no ``JAX_PLATFORMS``: one process holds a TPU, so a
    second worker's first array would fail on a chip already in use. Such workers run on the
    CPU, as CI does; the TPU tier (``.ci/tpu``) runs the chip's tests in one process."""
    workers = environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    return (workers.isdigit() and int(workers) > 1 and bool(plugins)
            and not environ.get("JAX_PLATFORMS", "").strip())


if _workers_take_the_cpu(os.environ, _accelerator_plugins()):
    os.environ["JAX_PLATFORMS"] = "cpu"  # (this worker's subprocesses inherit it)


def _runs_on_cpu() -> bool:
    """Whether JAX will run the tests on its CPU backend, known before JAX starts: the first
    platform that ``JAX_PLATFORMS`` names, or, unset, whether no accelerator's plugin (libtpu,
    JAX's CUDA and ROCm plugins) is installed. The flags above are XLA:CPU's, but XLA_FLAGS
    reach every backend's compiler: on a TPU, ``--xla_backend_optimization_level=0`` would
    compile the programs under test unoptimised (the TPU tier, .ci/tpu, sets JAX_PLATFORMS)."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not _accelerator_plugins()


if _runs_on_cpu():
    KNOWN = _xla_knows(OPTIONAL)
    FLAGS = [flag for flag in FLAGS if flag not in OPTIONAL or flag in KNOWN]
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), *FLAGS]))

import jax  # noqa: E402
import pytest  # noqa: E402

# Implicit rank promotion hides shape bugs in layer code; make it an error.
jax.config.update("jax_numpy_rank_promotion", "raise")
# The tests' tolerances are float32's (tests/_tolerance.py); a TPU's default multiplies float32
# matrices in bfloat16 passes. Off the CPU (where every precision is float32's), 'highest'
# unless JAX_DEFAULT_MATMUL_PRECISION says otherwise.
if not _runs_on_cpu() and not os.environ.get("JAX_DEFAULT_MATMUL_PRECISION"):
    jax.config.update("jax_default_matmul_precision", "highest")


def _one_mlir_context_per_thread(mlir: object) -> bool:
    """Makes JAX lower every program of this thread in one MLIR context, made on the first
    lowering, instead of a new context for each; returns whether it did.

    JAX 0.10 builds a new context for every lowering (``jax._src.interpreters.mlir.
    make_ir_context``: a private name, read on 2026-12-07, jax 0.10.2), loading its dialects each
    time, and each cached program keeps its own. The suite lowers thousands of small programs:
    with one context, `tests/finetune`'s fast tier in one process took 54-55 s against 67-68 s
    (two alternating pairs), `tests/adapters`' 58.7 s against 70.8 s with a third of the peak
    memory (1.1 against 3.0 GB), the fast tier (``-n 2``) 127 s against 147 s (2026-12-07).
    The lowered programs are the same text (compared for a Stack's forward, its gradient and an
    eager operation). Nothing is changed, and False returned, where ``mlir`` has no
    ``make_ir_context`` (a JAX that moved it: the suite would run as before, only slower, and
    ``tests/test_conftest.py`` fails to say so) or has it shared already."""
    make = getattr(mlir, "make_ir_context", None)
    if make is None or getattr(make, "shared_per_thread", False):
        return False
    contexts = threading.local()

    @functools.wraps(make)
    def shared():
        if not hasattr(contexts, "context"):
            contexts.context = make()
        return contexts.context

    shared.shared_per_thread = True
    mlir.make_ir_context = shared
    return True


_one_mlir_context_per_thread(sys.modules.get("jax._src.interpreters.mlir"))


def pytest_report_header(config: pytest.Config) -> str | None:
    """Says so when several xdist workers will run on the CPU of a host with an accelerator."""
    workers = getattr(config.option, "numprocesses", None)
    environ = dict(os.environ, PYTEST_XDIST_WORKER_COUNT=str(workers or 0))
    if isinstance(workers, int) and _workers_take_the_cpu(environ, _accelerator_plugins()):
        return (f"stackwise: {workers} xdist workers cannot share one accelerator: they run "
                "on the CPU (JAX_PLATFORMS=cpu); `.ci/tpu` runs the TPU tier on the chip")
    return None


#: The environment variables that make JAX keep every program it compiles in a persistent
#: cache, and read it from there when a later ``jit`` lowers the same program: the run's own
#: folder (:func:`_share_compiled_programs`), no floor on a program's compile time or size.
CACHE = "JAX_COMPILATION_CACHE_DIR"
CACHE_ALL = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": 0,
             "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": 0}
#: The folder this process made for the run's cache, removed when the run ends; None in the
#: xdist workers (theirs is the controller's) and where the user set their own.
_OWN_CACHE: str | None = None


def _share_compiled_programs(environ: dict, on_cpu: bool) -> str | None:
    """On the CPU, gives the run a persistent compilation cache of its own: a new folder,
    set in ``environ`` with :data:`CACHE_ALL` and returned, so that the xdist workers and the
    subprocesses that the tests start (the examples', the bench's, the 8-device workers) share
    it. None, and ``environ`` untouched, where ``JAX_COMPILATION_CACHE_DIR`` is already set (an
    xdist worker of a run that made one, or the user's own cache) or off the CPU.

    The suite compiles thousands of small programs and is dominated by compiling them; a
    program compiled before in the run (the same StableHLO and options: JAX's cache key),
    by another test, worker or subprocess, is read back instead of compiled again. Measured on
    the 2-core VM (2026-12-07, `-n 2`, without and with, back to back): the whole suite 13:56
    -> 11:35 (the tests' own seconds 1,633 -> 1,354), `tests/finetune` and `tests/adapters`
    5:29 -> 4:44; the fast tier, which runs each test function once, within the VM's noise
    (two alternating pairs: 2:44 and 2:32 without, 2:29 and 2:34 with). 185 MB of programs for
    the whole suite, deleted at its end."""
    if not on_cpu or environ.get(CACHE):
        return None
    folder = tempfile.mkdtemp(prefix="stackwise-tests-jax-cache-")
    environ.update({CACHE: folder, **{name: str(value) for name, value in CACHE_ALL.items()}})
    return folder


def pytest_configure(config: pytest.Config) -> None:
    """Tells the test modules, before they are imported, whether this run is the fast tier
    (tests/_tiers.py: its hypothesis searches draw fewer examples than the whole suite's),
    makes Python's cyclic garbage collector run less often (below), and shares the programs
    that the run compiles (:func:`_share_compiled_programs`; before any compile, and before
    xdist starts its workers, which inherit the environment)."""
    global _OWN_CACHE
    # (not under .ci/tpu's costs plugin: its dry run on the CPU counts the programs that the
    # chip, which has no such cache, would compile)
    if not config.pluginmanager.has_plugin("tpu_costs"):
        _OWN_CACHE = _share_compiled_programs(os.environ, _runs_on_cpu())
    if _OWN_CACHE:  # (JAX read the environment when imported: its options, the same names)
        for name, value in {CACHE: _OWN_CACHE, **CACHE_ALL}.items():
            jax.config.update(name.lower(), value)
    import _tiers

    _tiers.FAST = "not slow" in (config.option.markexpr or "")
    # Tracing and lowering allocate many short-lived objects: at Python's default (a young
    # collection every 700 allocations net), the collector took 1.5 s of 37 s of CPU in three
    # compile-heavy files, 0.3 s at 50,000 with the collected modules frozen (2026-12-06).
    gc.set_threshold(50_000, 50, 100)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Removes the run's compilation cache, in the process that made it."""
    if _OWN_CACHE:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def pytest_collection_finish(session: pytest.Session) -> None:
    """The modules, fixtures and test items collected live to the end: the collector need
    not look at them again (``gc.freeze``)."""
    gc.collect()
    gc.freeze()


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


# The most memory maps a worker may hold when a module ends before JAX's caches are dropped
# (see below): well under Linux's default limit of 65,530, with room for the largest module's
# own (one worker's module peaked at 12,806 maps with the caches dropped before it).
MAX_MAPS = 30_000


def _memory_maps() -> int | None:
    """How many memory maps this process holds (Linux), or None where it cannot be read."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's caches of compiled programs after a test module once the process holds
    many memory maps (after every module where their number cannot be read).

    XLA:CPU maps each compiled program's machine code into memory of its own (about six
    memory maps a program), and JAX's caches keep every program alive for the life of the
    process; op-by-op calls, one program per primitive and shape, fill them fastest. The test
    files of one xdist worker of the whole suite, run in one process, reached 64,719 maps; at
    Linux's default limit of 65,530 (``vm.max_map_count``) the next compile's ``mmap`` fails and
    XLA dies of a segmentation fault (seen in CI and here, in whichever test came next). Cleared
    after each module, the same files peaked at 12,806 maps. Cleared only past ``MAX_MAPS``, a
    program that later modules use again (above all the op-by-op ones) is kept, not compiled
    again in each: the whole suite asked for 17% fewer compiles, and its two workers peaked at
    30,432 and 37,024 maps (2026-12-06).
    """
    yield
    maps = _memory_maps()
    if maps is None or maps > MAX_MAPS:
        jax.clear_caches()
