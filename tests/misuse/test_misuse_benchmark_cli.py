"""Misuses of the checkpoint benchmark's command line (`benchmarks/checkpoint_load.py`).

Each is refused by argument parsing, before a checkpoint is written: exit status 2 and a
message naming the flag. The parser runs in-process: `parse_args(argv)`.
"""

from __future__ import annotations

import pathlib

import pytest
from _misuse import assert_cli_refused
from _scripts import load_script

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "checkpoint_load.py"

#: (argv, what the message must name (the flag), a part of the message).
CASES = [
    (["--gib", "0"], "--gib", "expected above 0, got '0'"),
    (["--gib", "nan"], "--gib", "expected above 0, got 'nan'"),
    (["--gib", "two"], "--gib", "expected a number, got 'two'"),
    (["--per-file", "0"], "--per-file", "expected 1 or more, got '0'"),
    (["--per-file", "1.5"], "--per-file", "expected a number, got '1.5'"),
    (["--repeats", "0"], "--repeats", "expected 1 or more, got '0'"),
    (["--settle", "-1"], "--settle", "expected 0 or more, got '-1'"),
    (["--settle", "nan"], "--settle", "expected 0 or more, got 'nan'"),
    (["--folder", "{file}"], "--folder", "not a folder; give an existing folder"),
]


@pytest.fixture(scope="module")
def script():
    return load_script(SCRIPT)


@pytest.mark.every_case
@pytest.mark.parametrize(("argv", "flag", "message"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_refused(script, tmp_path, capsys, argv, flag, message):
    (tmp_path / "file").write_text("")
    argv = [a.replace("{file}", str(tmp_path / "file")) for a in argv]
    assert_cli_refused(script.parse_args, argv, flag, message, capsys)


def test_a_run_of_the_flags_parses(script, tmp_path):
    args = script.parse_args(["--gib", "0.5", "--per-file", "4", "--repeats", "3",
                              "--settle", "5", "--folder", str(tmp_path)])
    assert (args.gib, args.per_file, args.repeats, args.settle) == (0.5, 4, 3, 5.0)
    assert args.folder == str(tmp_path)


OPTIMIZER_STEP = SCRIPT.parent / "optimizer_step.py"


@pytest.mark.every_case
@pytest.mark.parametrize("flag", ["--n", "--d", "--hidden", "--rounds"])
@pytest.mark.parametrize("value", ["0", "-3", "2.5"])
def test_optimizer_step_sizes_are_positive_integers(tmp_path, capsys, flag, value):
    script = load_script(OPTIMIZER_STEP)  # (imports JAX and optax; the parser runs first)
    assert_cli_refused(script.parse_args, [flag, value], flag,
                       f"expected a positive integer, got {value!r}", capsys)
