"""A pytest plugin for the TPU tier (.ci/tpu: ``-p tpu_costs``): what each test cost on the
chip, to choose the tier's selection by measurement. Per test: its wall time (setup, call and
teardown), the programs XLA compiled for it and the seconds those compiles took, and how many
of them were a program compiled before in the run (the same StableHLO text: what a persistent
compilation cache would have saved). Written to ``$TPU_COSTS_OUT`` (JSON, a list of rows, in
the order the tests ran) every 10 tests and at the end, so a run stopped by its time limit
keeps what it measured.

The compiles are counted at ``jax._src.compiler.backend_compile_and_load`` (JAX 0.10: the one
call that hands a lowered program to XLA); where a JAX lacks it, the rows hold the wall times
only and ``compiles`` is None.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import pytest

_now = {"compiles": 0, "seconds": 0.0, "repeats": 0}
_seen: set[str] = set()
_rows: list[dict] = []
_counting = False


def _text_hash(module) -> str:
    return hashlib.sha1(str(module).encode()).hexdigest()


def pytest_configure(config):
    global _counting
    try:
        from jax._src import compiler
        original = compiler.backend_compile_and_load
    except (ImportError, AttributeError):  # another JAX: wall times only
        return

    def counted(backend, module, *args, **kwargs):
        begin = time.perf_counter()
        try:
            return original(backend, module, *args, **kwargs)
        finally:
            _now["seconds"] += time.perf_counter() - begin
            _now["compiles"] += 1
            digest = _text_hash(module)
            _now["repeats"] += digest in _seen
            _seen.add(digest)

    compiler.backend_compile_and_load = counted
    _counting = True


def _write() -> None:
    out = os.environ.get("TPU_COSTS_OUT")
    if out:
        with open(out + ".part", "w") as f:
            json.dump(_rows, f, indent=0)
        os.replace(out + ".part", out)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _now.update(compiles=0, seconds=0.0, repeats=0)
    begin = time.perf_counter()
    yield
    _rows.append({"test": item.nodeid, "seconds": round(time.perf_counter() - begin, 3),
                  "compiles": _now["compiles"] if _counting else None,
                  "compile_seconds": round(_now["seconds"], 3) if _counting else None,
                  "repeated_compiles": _now["repeats"] if _counting else None})
    if len(_rows) % 10 == 0:
        _write()


def pytest_sessionfinish(session):
    _write()
