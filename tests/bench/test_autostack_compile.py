"""benchmarks/autostack_compile.py (``benchmarks/on_tpu.sh``'s ``autostack`` part) at toy
sizes on the CPU: its tables (rows, columns, the command and backend in their headers, one
per block, each written as it ends), the loop compiled in a child process and stopped past
its time."""

import pathlib
import shlex
import subprocess
import sys

import jax
import pytest
from _scripts import load_script

BENCHMARKS = pathlib.Path(__file__).parents[2] / "benchmarks"
SCRIPT = BENCHMARKS / "autostack_compile.py"
COLUMNS = ["variant", "remat", "compile s", "compiles s", "/ stackwise", "build s",
           "HLO Kchars"]


@pytest.fixture(scope="module")
def bench():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCHMARKS))  # (it imports tpu_decode_hlo and _devices)
        yield load_script(SCRIPT)


@pytest.mark.slow  # (6 compiles; the fast tier runs the loop's child stopped, and failing)
def test_the_scans_interleaved_and_their_ratio(bench, tmp_path, monkeypatch, capsys):
    argv = ["--blocks", "mlp", "--n", "2", "--pairs", "2", "--loop-compiles", "0",
            "--markdown", str(tmp_path / "a.md")]
    monkeypatch.setattr("sys.argv", ["benchmarks/autostack_compile.py", *argv])
    rows = bench.main(argv)["mlp"]
    assert [r["variant"] for r in rows] == ["stackwise", "stackwise.autostack"]
    assert all(list(r) == COLUMNS for r in rows) and rows[0]["/ stackwise"] == "1.00"
    for r in rows:  # a warm-up, then one compile a pair; the median of those
        seconds = sorted(float(s) for s in r["compiles s"].split())
        assert len(seconds) == 2 and seconds[0] <= float(r["compile s"]) + 0.005
    # the same program: the autostacked loop's is the stack's size
    assert abs(int(rows[1]["HLO Kchars"]) - int(rows[0]["HLO Kchars"])) <= 1
    text = (tmp_path / "a.md").read_text()
    header, _, head, rule, *lines = text.strip().splitlines()
    assert header.startswith("autostack: compile time at n=2 (mlp block) (on ")
    assert f"(on {jax.default_backend()}: " in header
    assert header.endswith(f"`{shlex.join(['python', 'benchmarks/autostack_compile.py', *argv])}`")
    assert head == "| " + " | ".join(COLUMNS) + " |"
    assert lines[-1].startswith("autostack / stackwise, 2 interleaved pairs: median ")
    assert text.strip() in capsys.readouterr().out


def test_a_loop_slower_than_its_seconds_is_stopped_and_said_so(bench):
    args = bench.parse_args(["--blocks", "transformer", "--loop-seconds", "1"])
    loop = bench.loop_row(args, "transformer")  # (the child is stopped while it starts)
    assert loop["stopped"] and loop["compiles"] == []
    scans = {name: {"compiles": [1.0, 1.2], "build": 0.1, "chars": 2000}
             for name in (bench.STACK, bench.AUTO)}
    row = bench.table_rows(loop, scans, args)[0]
    assert (row["variant"], row["compile s"], row["/ stackwise"]) == (
        bench.LOOP, "> 1 (stopped)", "-")


def test_a_loop_child_that_fails_says_why(bench):
    args = bench.parse_args(["--blocks", "mlp"])
    with pytest.raises(RuntimeError, match=r"(?s)the loop's child process failed:.*--blocks"):
        bench.loop_row(args, "no-such-block")


@pytest.mark.slow  # (two processes, each starting JAX; 9 compiles of both blocks)
def test_the_whole_run_with_the_loop_in_its_child(tmp_path):
    out = tmp_path / "a.md"
    subprocess.run([sys.executable, str(SCRIPT), "--n", "2", "--pairs", "1",
                    "--loop-seconds", "300", "--markdown", str(out)], check=True,
                   cwd=BENCHMARKS.parent, capture_output=True, text=True)
    text = out.read_text()
    assert text.count("autostack: compile time at n=2") == 2, text
    assert text.index("(transformer block)") < text.index("(mlp block)")
    loops = [line for line in text.splitlines() if line.startswith("| loop (separate params)")]
    assert len(loops) == 2 and all("stopped" not in line for line in loops), loops
    for line in loops:  # one compile, its median, its ratio, the loop's program
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[2] == cells[3] and float(cells[4]) > 0 and int(cells[6]) > 0, cells
