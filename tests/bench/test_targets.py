"""benchmarks/targets.py: the project's pass/fail targets, read from a stackwise-bench CSV."""

import csv
import pathlib
import subprocess
import sys

import pytest
from _scripts import load_script

from stackwise.bench import Result, read_csv, write_csv
from stackwise.bench.report import backend

BENCHMARKS = pathlib.Path(__file__).parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def targets():
    return load_script(BENCHMARKS / "targets.py")


def test_verdicts(targets):
    def verdict(limit):
        return targets.cells(targets.Target("x", 2.5, limit, 1.0, 4.0))[-1]

    assert [verdict(3.0), verdict(2.0), verdict(0.9)] == ["yes", "within noise", "NO"]
    assert targets.cells(targets.Target("noise", 1.01, None, 0.9, 1.1))[2:] == ["reference", "-"]


def test_targets_of_the_saved_runs(targets):
    mlp = {t.what: t for t in targets.targets(read_csv(str(BENCHMARKS / "results/mlp.csv")))}
    step = mlp["mlp n=48: stackwise step / hand scan"]
    assert step.low <= step.measured <= step.high and step.limit == 1.03
    assert "mlp n=96: temp nested / per-layer remat" in mlp
    tf = targets.targets(read_csv(str(BENCHMARKS / "results/adapters48.csv")))
    same = [t for t in tf if "(same program)" in t.what]
    assert len(same) == 2 * 3  # compile and step, for each framework's adapter without remat


def test_pattern_compile_time_against_depth(targets):
    rows = [Result("pattern", n, "jax", variant, "off", compile_s=seconds)
            for n, seconds in ((6, 1.0), (26, 1.1), (60, 1.5))
            for variant in ("stackwise", "stackwise default", "loop (separate params)")]
    found = {t.what: t for t in targets.targets(rows)}
    assert set(found) == {"pattern: stackwise compile n=60 / n=6",
                          "pattern: stackwise default compile n=60 / n=6"}
    t = found["pattern: stackwise compile n=60 / n=6"]
    assert (t.measured, t.limit, targets.verdict(t)) == (1.5, 1.3, "NO")


def test_script(tmp_path, targets):
    """The script prints and writes, row for row, the targets computed from the CSV it reads
    (whatever that saved run measured)."""
    csv, md = BENCHMARKS / "results/mlp.csv", tmp_path / "t.md"
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "targets.py"), str(csv), "--markdown", str(md)],
        capture_output=True, text=True, check=True,
    )
    found = targets.targets(read_csv(str(csv)))
    assert found and out.stdout.startswith("Targets")
    lines = md.read_text().splitlines()
    for t in found:
        cells = targets.cells(t, no="**no**")
        assert "| " + " | ".join(cells) + " |" in lines, t.what
        assert t.what in out.stdout


def test_the_table_names_where_the_csv_was_measured(tmp_path, targets):
    saved = BENCHMARKS / "results/mlp.csv"  # written before the CSVs had a backend column
    with open(saved, newline="") as f:
        machine = next(csv.DictReader(f))["machine"]
    assert targets.measured_on(str(saved)) == machine
    rows = read_csv(str(saved))
    write_csv(rows, str(tmp_path / "now.csv"))  # names this process's backend
    md = tmp_path / "t.md"
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "targets.py"), str(tmp_path / "now.csv"),
         "--markdown", str(md)], capture_output=True, text=True, check=True,
    )
    where = backend()
    assert targets.measured_on(str(tmp_path / "now.csv")) == where
    assert f"on {where};" in " ".join(out.stdout.split())  # (a terminal table wraps it)
    assert md.read_text().startswith(f"Targets, on {where}:\n")
    (tmp_path / "empty.csv").write_text("block,n\n")
    assert targets.measured_on(str(tmp_path / "empty.csv")) == "a machine the CSV does not name"
