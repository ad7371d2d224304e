"""Misuses of the multi-process example's command line (`examples/multiprocess.py`).

Each is refused by argument parsing, before JAX is configured or any process starts: exit
status 2 and a message naming the flag. The parser runs in-process: `parse_args(argv)`.
"""

from __future__ import annotations

import pathlib

import pytest
from _misuse import assert_cli_refused
from _scripts import load_script

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "multiprocess.py"
ONE = ["--process-id", "0", "--num-processes", "2", "--coordinator", "127.0.0.1:8476"]

#: (argv, what the message must name (the flag), a part of the message).
CASES = [
    ([], "--processes", "--process-id, --num-processes, --coordinator is missing"),
    (["--process-id", "0"], "--num-processes", "--num-processes, --coordinator is missing"),
    (["--processes", "3"], "--processes", "invalid choice: 3"),
    (["--processes", "two"], "--processes", "invalid int value: 'two'"),
    (["--processes", "2", *ONE[:2]], "--process-id", "for running one process of a run"),
    (["--processes", "2", "--timeout", "0"], "--timeout", "expected a positive number"),
    (["--processes", "2", "--timeout", "nan"], "--timeout", "expected a positive number"),
    (["--processes", "2", "--out", "{file}"], "--out", "is a file; give a folder"),
    (["--processes", "2", "--out", "{file}/results"], "--out", "is not a writable folder"),
    ([*ONE, "--out", "{file}/results"], "--out", "is not a writable folder"),
    ([*ONE[:2], "--num-processes", "3", *ONE[4:]], "--num-processes", "invalid choice: 3"),
    (["--process-id", "2", *ONE[2:]], "--process-id", "is not one of 0 to 1"),
    (["--process-id", "-1", *ONE[2:]], "--process-id", "is not one of 0 to 1"),
    ([*ONE[:4], "--coordinator", "8476"], "--coordinator", "is not HOST:PORT"),
    ([*ONE[:4], "--coordinator", "localhost:"], "--coordinator", "is not HOST:PORT"),
    ([*ONE[:4], "--coordinator", "localhost:http"], "--coordinator", "is not HOST:PORT"),
]


@pytest.fixture(scope="module")
def example():
    return load_script(EXAMPLE)


@pytest.mark.every_case
@pytest.mark.parametrize(("argv", "flag", "message"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_refused(example, tmp_path, capsys, argv, flag, message):
    (tmp_path / "file").write_text("")
    argv = [a.replace("{file}", str(tmp_path / "file")) for a in argv]
    assert_cli_refused(example.parse_args, argv, flag, message, capsys)


def test_a_run_of_the_flags_parses(example, tmp_path):
    args = example.parse_args([*ONE, "--out", str(tmp_path)])
    assert (args.process_id, args.num_processes, args.coordinator) == (0, 2, "127.0.0.1:8476")
    assert example.parse_args(["--processes", "4"]).processes == 4


def test_processes_out_of_time_are_an_error_not_a_traceback(example, tmp_path, capsys):
    # --timeout 1 (a few milliseconds here): the processes are killed before they can finish.
    code = example.main(["--processes", "2", "--timeout", "0.001", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err.startswith("error: 2 processes") and "a longer --timeout gives them" in err, err
