""".ci/tpu, the TPU tier (run by hand on a TPU host, never in CI): its record of a run
(.ci/tpu_record.py) read from pytest's output, and the script's refusals, on the CPU."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import subprocess
import sys

import pytest
from _scripts import load_script

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECORD = load_script(ROOT / ".ci" / "tpu_record.py", "tpu_record")

FINISHED = """\
........F.s
=========================== short test summary info ============================
FAILED tests/core/test_state.py::test_x - AssertionError: assert 1 == 2
SKIPPED [1] tests/core/test_serving.py:9: needs torch
1 failed, 9 passed, 1 skipped, 3 deselected in 12.34s
"""
STOPPED = """\
.....E
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!! KeyboardInterrupt !!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
(to show a full traceback on KeyboardInterrupt use --full-trace)
=================== 5 passed, 1 error in 469.90s (0:07:49) ====================
"""


def test_the_counts_are_read_from_pytests_last_summary_line():
    assert RECORD.counts(FINISHED) == {"passed": 9, "failed": 1, "skipped": 1, "errors": 0,
                                       "xfailed": 0, "xpassed": 0, "deselected": 3}
    assert RECORD.counts(STOPPED)["passed"] == 5 and RECORD.counts(STOPPED)["errors"] == 1
    with pytest.raises(ValueError, match="no summary line"):
        RECORD.counts("Fatal Python error: Aborted\n")


def test_the_record_names_the_machine_the_counts_and_the_summary():
    env = {"TIER_STATUS": "124", "TIER_SECONDS": "450", "TIER_LIMIT": "450", "TIER_COUNT": "445",
           "TIER_ARGS": "", "JAX_DEFAULT_MATMUL_PRECISION": "highest", "JAX_PLATFORMS": "tpu"}
    now = datetime.datetime(2026, 12, 5, 23, 0, tzinfo=datetime.UTC)
    text = RECORD.record(env, STOPPED, now)
    assert text.startswith("## 2026-12-05 23:00 UTC\n")
    assert "jax 0.10" in text and "jaxlib " in text and "libtpu " in text
    assert "- result: 5 passed, 0 failed, 0 skipped, 1 errors; 450 s of a 450 s limit; " \
           "stopped at the limit" in text
    assert "(445 tests)" in text and "matmul precision: highest" in text
    text = RECORD.record({**env, "TIER_STATUS": "1", "TIER_ARGS": "tests/core"}, FINISHED, now)
    assert "stopped" not in text and "3 deselected" in text
    assert "`tests/core` (445 arguments)" in text
    assert "FAILED tests/core/test_state.py::test_x" in text and "SKIPPED [1]" in text
    text = RECORD.record({**env, "TIER_SHARD": "2/3", "TIER_SELECTION": "full"}, FINISHED, now)
    assert "(STACKWISE_TPU_TIER_SELECTION=full), share 2/3 of its test files (445 tests)" in text
    assert ("cd /tmp && STACKWISE_TPU_TIER_SHARD=2/3 STACKWISE_TPU_TIER_SELECTION=full "
            "\"$OLDPWD\"/.ci/tpu") in text
    text = RECORD.record({**env, "TIER_SELECTION": "chip"}, FINISHED, now)
    assert "- selection: the chip's selection, .ci/tpu_tier.txt (445 tests)" in text


def test_a_log_without_counts_is_a_failed_record(tmp_path):
    log = tmp_path / "pytest.log"
    log.write_text("Segmentation fault\n")
    env = dict(os.environ, TIER_LOG=str(log), TIER_STATUS="139", TIER_SECONDS="3",
               TIER_LIMIT="450", TIER_COUNT="1", TIER_ARGS="")
    out = subprocess.run([sys.executable, "-P", str(ROOT / ".ci" / "tpu_record.py")], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "no summary line" in out.stderr and not out.stdout


def test_the_script_refuses_to_run_from_the_checkout_or_without_a_directory():
    script = str(ROOT / ".ci" / "tpu")
    inside = subprocess.run([script, str(ROOT / "unused")], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert inside.returncode == 2 and "run it from outside the checkout" in inside.stderr
    assert not (ROOT / "unused").exists()  # refused before it made anything
    bare = subprocess.run([script], cwd="/", capture_output=True, text=True, timeout=60)
    assert bare.returncode != 0 and "usage: .ci/tpu OUT_DIR" in bare.stderr


@pytest.mark.parametrize("shard, args, says", [
    ("3/2", [], "is i/k with 1 <= i <= k (e.g. 1/2), got '3/2'"),
    ("0/2", [], "got '0/2'"),
    ("half", [], "got 'half'"),
    ("1/2", ["tests/core"], "PYTEST ARGS replace it: give one or the other"),
])
def test_the_script_refuses_a_share_it_cannot_take(tmp_path, shard, args, says):
    out = subprocess.run([str(ROOT / ".ci" / "tpu"), str(tmp_path / "out"), *args], cwd="/",
                         env=dict(os.environ, STACKWISE_TPU_TIER_SHARD=shard),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and says in out.stderr


def test_the_record_reports_what_the_tests_cost():
    rows = [{"test": "tests/a.py::fast", "seconds": 0.5, "compiles": 2, "compile_seconds": 0.25,
             "repeated_compiles": 0},
            {"test": "tests/a.py::slow", "seconds": 7.25, "compiles": 30,
             "compile_seconds": 6.0, "repeated_compiles": 4}]
    lines = RECORD.costs(rows, slowest=1)
    assert lines == ["- costs: 2 tests in 8 s; XLA compiled 32 programs in 6 s, 4 of them a "
                     "program compiled before in the run",
                     "- the 1 slowest (seconds, compiles):",
                     "  - `tests/a.py::slow`: 7.2 s, 30"]
    walls = [{**row, "compiles": None, "compile_seconds": None, "repeated_compiles": None}
             for row in rows]
    assert RECORD.costs(walls)[0] == "- costs: 2 tests in 8 s"
    assert RECORD.costs([]) == ["- costs: no test finished"]
    env = {"TIER_STATUS": "0", "TIER_SECONDS": "9", "TIER_LIMIT": "450", "TIER_COUNT": "2"}
    now = datetime.datetime(2026, 12, 6, tzinfo=datetime.UTC)
    assert "- costs: 2 tests" in RECORD.record(env, FINISHED, now, rows)
    assert "- costs:" not in RECORD.record(env, FINISHED, now)


def test_the_costs_plugin_counts_each_tests_compiles(tmp_path):
    (tmp_path / "test_two.py").write_text(
        "import jax, jax.numpy as jnp\n"
        "def test_compiles_one():\n"
        "    jax.jit(lambda x: x * 3.0)(jnp.ones(3)).block_until_ready()\n"
        "def test_compiles_the_same_again():\n"
        "    jax.jit(lambda x: x * 3.0)(jnp.ones(3)).block_until_ready()\n")
    out = tmp_path / "costs.json"
    # (without the suite's compilation cache, tests/conftest.py: the second test's program
    # would be read from it, not compiled)
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(PYTHONPATH=str(ROOT / ".ci"), TPU_COSTS_OUT=str(out), JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-P", "-m", "pytest", "-p", "tpu_costs", "-q",
                          "-p", "no:cacheprovider", "-p", "no:xdist", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    first, second = json.loads(out.read_text())
    assert first["test"].endswith("::test_compiles_one") and first["compiles"] >= 1
    # The second test's program is the first's: counted as compiled before in the run.
    assert second["repeated_compiles"] >= 1 and second["seconds"] > 0


def test_the_script_refuses_a_selection_it_does_not_have(tmp_path):
    out = subprocess.run([str(ROOT / ".ci" / "tpu"), str(tmp_path / "out")], cwd="/",
                         env=dict(os.environ, STACKWISE_TPU_TIER_SELECTION="fast"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "STACKWISE_TPU_TIER_SELECTION is chip (the default: .ci/tpu_tier.txt) or full, got " \
           "'fast'" in out.stderr


@pytest.mark.slow
def test_every_test_the_chips_selection_names_is_collected():
    """.ci/tpu_tier.txt names tests by node id: a renamed or removed test fails here, on the CPU,
    before a chip's run would find it missing."""
    lines = (ROOT / ".ci" / "tpu_tier.txt").read_text().splitlines()
    ids = [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]
    assert len(ids) == len(set(ids)) and all("::" in i for i in ids)
    run = subprocess.run([sys.executable, "-P", "-m", "pytest", "-c", str(ROOT / "pyproject.toml"),
                          "-n", "0", "-q", "--collect-only", "-p", "no:cacheprovider",
                          *(str(ROOT / i) for i in ids)],
                         cwd=ROOT.parent, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    collected = {line.strip() for line in run.stdout.splitlines() if "::" in line}
    assert collected == set(ids), sorted(set(ids) ^ collected)


MATCHES = load_script(ROOT / ".ci" / "installed_matches.py", "installed_matches")


def test_the_installed_package_is_the_checkouts_here():
    # (the suite runs on an editable install, as CI's is: it imports the checkout itself)
    assert MATCHES.differences(ROOT) == []
    assert MATCHES.installed_dir("stackwise.haiku") == ROOT / "adapters" / "haiku"
    assert MATCHES.installed_dir("no_such_package_here") is None
    assert MATCHES.installed_dir("no_such_package_here.sub") is None


def test_a_stale_or_partial_install_is_named_file_by_file(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "site" / "stackwise"
    stale.mkdir(parents=True)
    (stale / "__init__.py").write_bytes((ROOT / "stackwise" / "__init__.py").read_bytes())
    (stale / "stack.py").write_text("old = True\n")  # (not in the checkout: not a difference)
    real = MATCHES.installed_dir

    def installed_dir(package):
        if package == "stackwise":
            return stale
        return None if package == "stackwise.haiku" else real(package)

    monkeypatch.setattr(MATCHES, "installed_dir", installed_dir)
    found = MATCHES.differences(ROOT)
    assert "stackwise/__init__.py" not in " ".join(found)
    assert "stackwise/_core/stack.py: not installed" in found
    assert "stackwise.haiku: not importable" in found
    assert not any(f.startswith(("stackwise.flax", "stackwise.bench")) for f in found)
    (stale / "__init__.py").write_text('"""an older stackwise"""\n')
    assert "stackwise/__init__.py: differs from the checkout's" in MATCHES.differences(ROOT)
    assert MATCHES.main([str(ROOT)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("the installed stackwise is not the checkout's (")
    assert err.count(";") >= 8 and "; ..." in err and "run ../shared/tpu/prepare" in err


def test_the_installed_check_takes_one_checkout(tmp_path, capsys):
    assert MATCHES.main([str(ROOT)]) == 0
    for argv in ([], [str(tmp_path)], [str(ROOT), str(ROOT)]):
        assert MATCHES.main(argv) == 2
        assert "usage: python3 -P .ci/installed_matches.py CHECKOUT" in capsys.readouterr().err
