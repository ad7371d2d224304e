"""The stackwise-bench command: packaging, the command line, and a smoke run.

No timing assertions: the smoke run checks that every variant runs and that the outputs
(CSV, PNG, table) are written with sane, internally consistent values.
"""

import csv
import importlib.metadata
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import stackwise.bench
from stackwise.bench import BenchConfig, workloads

BENCHMARKS = pathlib.Path(__file__).parents[2] / "benchmarks"
TERMINAL = 100


def paired(row, ref, what):
    """The median over repeats of row / ref, from a CSV row's samples."""
    a, b = (np.array(r[f"{what}_samples"].split(), float) for r in (row, ref))
    return float(np.median(a / b))


def test_console_script_is_declared():
    scripts = importlib.metadata.entry_points(group="console_scripts", name="stackwise-bench")
    assert [s.value for s in scripts] == ["stackwise.bench:main"]


# That importing stackwise.bench imports no framework or UI library: tests/package/test_import.py.


def test_bad_command_line_is_refused():
    with pytest.raises(SystemExit):
        stackwise.bench.main(["--blocks", "cnn"])
    with pytest.raises(SystemExit):
        stackwise.bench.main(["--n", "0,8"])


def test_a_selection_of_nothing_is_refused_with_the_variants_there_are(capsys):
    with pytest.raises(SystemExit) as exit_:
        stackwise.bench.main(["--blocks", "mlp", "--variants", "haiku.Stack", "--csv", "",
                              "--plot", "", "--no-progress"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "no variant of the blocks mlp matches haiku.Stack" in err
    assert "stackwise nested" in err  # the variants there are


def test_help_says_where_the_outputs_go(capsys):
    with pytest.raises(SystemExit):
        stackwise.bench.main(["--help"])
    out = capsys.readouterr().out
    assert "stackwise-bench.csv" in out and "stackwise-bench.png" in out
    assert "current directory" in out and "benchmarks/targets.py" in out


@pytest.mark.parametrize(("argv", "sizes"), [
    ([], (256, 512, 8, 4, "float32")),
    (["--decode-shape", "1024:2048:16", "--decode-heads", "8"], (1024, 2048, 16, 8, "float32")),
    (["--decode-heads", "2"], (256, 512, 8, 2, "float32")),
    (["--quick", "--blocks", "prefill", "--decode-shape", "32:8:2"], (32, 8, 2, 2, "float32")),
    (["--decode-dtype", "bfloat16"], (256, 512, 8, 4, "bfloat16")),
])
def test_decode_shape_and_heads_size_the_decode_blocks(monkeypatch, argv, sizes):
    """The sizes and dtype reach the run's config (and so the blocks' caches and table
    titles)."""
    seen = []
    monkeypatch.setattr("stackwise.bench.measure.run_benchmark",
                        lambda cfg, **_: seen.append(cfg) or ([], []))
    argv = ["--blocks", "decode", *argv] if "--blocks" not in argv else argv
    assert stackwise.bench.main([*argv, "--csv", "", "--plot", "", "--no-progress"]) == 1
    (cfg,) = seen
    assert (cfg.dec_d, cfg.dec_cache, cfg.dec_batch, cfg.dec_heads, cfg.dec_dtype) == sizes
    assert (f"D={sizes[0]}, heads={sizes[3]}, batch={sizes[2]}, {sizes[4]}"
            in workloads.title("decode", cfg))


@pytest.mark.slow
def test_quick_run_writes_csv_plot_and_table(tmp_path):
    csv_path, png_path = tmp_path / "bench.csv", tmp_path / "bench.png"
    # (--quick compiles its programs at XLA's backend optimisation level 0; the suite's
    # XLA_FLAGS, which the run inherits (tests/conftest.py), do the same for the eager ops that
    # build the models, e.g. Equinox's vmapped inits)
    out = subprocess.run(
        [sys.executable, "-m", "stackwise.bench", "--quick", "--blocks", "mlp",
         "--csv", str(csv_path), "--plot", str(png_path), "--no-progress"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "stackwise nested" in out.stdout
    assert max(len(line.rstrip()) for line in out.stdout.splitlines()) <= TERMINAL
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with csv_path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    expected = {c.name for c in workloads.cases("mlp", BenchConfig.quick(), [])}
    assert {(r["variant"], int(r["n"])) for r in rows} == {(v, n) for v in expected for n in (2, 4)}
    by = {(r["variant"], int(r["n"])): r for r in rows}
    for r in rows:
        assert float(r["compile_s"]) > 0 and float(r["step_s"]) > 0
        assert int(r["temp_bytes"]) >= 0 and int(r["program_chars"]) > 0
        assert r["jax"] == jax.__version__
        # the ratios are medians of this row's samples over the references' (same depth),
        # paired by repeat / round
        scan, loop = by["lax.scan (hand)", int(r["n"])], by["loop (separate params)", int(r["n"])]
        assert float(r["compile_vs_scan"]) == pytest.approx(paired(r, scan, "compile"), rel=1e-4)
        assert float(r["step_vs_loop"]) == pytest.approx(paired(r, loop, "step"), rel=1e-4)
        assert len(r["step_samples"].split()) == 2  # --quick: 2 rounds
        assert float(r["compile_s"]) == pytest.approx(
            min(float(v) for v in r["compile_samples"].split()), rel=1e-4)
    for n in (2, 4):
        assert int(by["stackwise remat", n]["barrier_param_bytes"]) == 0
        assert int(by["stackwise", n]["barrier_ops"]) == 0
    # the project's targets, from the CSV
    targets = subprocess.run(
        [sys.executable, str(BENCHMARKS / "targets.py"), str(csv_path), "--n", "4"],
        capture_output=True, text=True, check=True,
    )
    assert "Targets" in targets.stdout and "stackwise compile / hand scan" in targets.stdout


@pytest.mark.parametrize("stop_at", [4, 2], ids=["second depth", "first depth"])
def test_an_interrupt_reports_the_depths_measured_before_it(tmp_path, capsys, monkeypatch,
                                                           stop_at):
    """SIGINT (Ctrl-C, `timeout -s INT` on a chip's time limit) ends the run with what was
    measured: the depths done before it are printed and written, exit status 130."""
    from stackwise.bench import cli, measure

    timed = measure._BlockRun.time_steps

    def time_steps(self, rows, compiled, n):
        if n == stop_at:
            raise KeyboardInterrupt
        return timed(self, rows, compiled, n)

    monkeypatch.setattr(measure._BlockRun, "time_steps", time_steps)
    csv_path = tmp_path / "bench.csv"
    status = cli.main(["--quick", "--blocks", "mlp", "--variants", "stackwise,lax.scan",
                       "--csv", str(csv_path), "--plot", "", "--no-progress"])
    out, err = capsys.readouterr()
    assert status == 130 and measure.INTERRUPTED in out + err
    if stop_at == 2:  # nothing measured: nothing written
        assert not csv_path.exists() and "before a depth was measured" in err
        return
    with csv_path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert {int(r["n"]) for r in rows} == {2}
    # each row says its block's sizes (and the decode blocks' dtype), as the tables' titles do
    assert {r["block_title"] for r in rows} == {workloads.title("mlp", BenchConfig.quick())}
    assert "exit status 130" in err


@pytest.mark.parametrize("stop_after", [1, 0], ids=["second variant", "first variant"])
def test_one_at_a_time_an_interrupt_keeps_the_variants_measured_at_its_depth(
        tmp_path, capsys, monkeypatch, stop_after):
    """Measured one at a time, a variant's rows are whole once its rounds end: an interrupt
    during the next variant keeps them (a chip's time limit at a size that needs every
    variant alone), where measured together a depth is all or nothing (the test above)."""
    from stackwise.bench import cli, measure

    timed, done = measure._BlockRun.time_steps, []

    def time_steps(self, rows, compiled, n):
        if len(done) == stop_after:
            raise KeyboardInterrupt
        done.extend(compiled)
        return timed(self, rows, compiled, n)

    monkeypatch.setattr(measure._BlockRun, "time_steps", time_steps)
    csv_path = tmp_path / "bench.csv"
    status = cli.main(["--quick", "--blocks", "mlp", "--variants", "stackwise,lax.scan",
                       "--one-at-a-time", "--csv", str(csv_path), "--plot", "",
                       "--no-progress"])
    out, err = capsys.readouterr()
    assert status == 130 and measure.INTERRUPTED in out + err
    if stop_after == 0:
        assert not csv_path.exists() and "before a variant was measured" in err
        return
    with csv_path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["variant"], int(r["n"])) for r in rows] == [(done[0], 2)]
    assert float(rows[0]["step_s"]) > 0 and len(rows[0]["step_samples"].split()) == 2
    assert re.search(r"mlp n=2: 1 of \d+ variants measured \(one at a time\) before the "
                     "interrupt: reported", out + err)


@pytest.mark.parametrize("one_at_a_time", [True, False], ids=["one at a time", "together"])
def test_one_at_a_time_holds_one_variant_and_still_gives_every_ratio(monkeypatch, one_at_a_time):
    """--one-at-a-time: each variant is built, compiled and timed before the next is built
    (the device holds one variant's params and state); by default every variant of a depth
    is built before any is timed (their rounds interleave). Both give every row its ratios."""
    from stackwise.bench import measure

    events, names = [], {}
    built, timed = measure._build, measure._time_call

    def build(case, n):
        made = built(case, n)
        names[id(made[0])] = case.name
        events.append(("build", case.name))
        return made

    def time_call(c):
        events.append(("time", names[id(c.params)]))
        return timed(c)

    monkeypatch.setattr(measure, "_build", build)
    monkeypatch.setattr(measure, "_time_call", time_call)
    variants = ("loop (separate", "lax.scan (hand)", "serving")
    results, notes = measure.run_benchmark(BenchConfig.quick(
        blocks=("decode",), variants=variants, one_at_a_time=one_at_a_time), progress=False,
        log=lambda _: None)
    assert not notes and len(results) == 3
    cfg = BenchConfig.quick(blocks=("decode",), one_at_a_time=one_at_a_time)
    assert ("one variant at a time" in workloads.title("decode", cfg)) == one_at_a_time
    assert all(r.step_vs_loop > 0 and r.compile_vs_loop > 0 for r in results)
    order = [name for _, name in events]
    runs = [name for i, name in enumerate(order) if i == 0 or name != order[i - 1]]
    if one_at_a_time:  # each variant's build and calls together, never interleaved
        assert len(runs) == 3 and set(runs) == {r.variant for r in results}, runs
    else:  # all built, then the calls of every variant in turns
        assert [kind for kind, _ in events[:3]] == ["build"] * 3 and len(runs) > 3


@pytest.mark.parametrize("one_at_a_time", [True, False], ids=["one at a time", "together"])
def test_without_a_terminal_the_log_says_where_each_phase_went(monkeypatch, one_at_a_time):
    """Where no progress bar shows (stderr not a terminal: a log, a chip's run), the log says
    how long the warm-up took and, per variant (one at a time) or per depth (together), how
    long building, compiling and timing took; on a terminal it says none of it."""
    from stackwise.bench import measure

    variants = ("loop (separate", "lax.scan (hand)")
    cfg = BenchConfig.quick(blocks=("decode",), variants=variants, warmup=True,
                            one_at_a_time=one_at_a_time)
    for terminal in (False, True):
        monkeypatch.setattr(measure.sys.stderr, "isatty", lambda terminal=terminal: terminal)
        lines: list[str] = []
        results, _ = measure.run_benchmark(cfg, progress=False, log=lines.append)
        assert len(results) == 2
        if terminal:
            assert not lines
            continue
        assert re.fullmatch(r"decode: warm-up at n=2 in \d+\.\d s", lines[0])
        phases = [line for line in lines if " built in " in line]
        whats = (["loop (separate params)", "lax.scan (hand)"] if one_at_a_time
                 else ["2 variants"])
        assert [re.fullmatch(r"decode n=2: (.+): built in \d+\.\d s, compiled in \d+\.\d s, "
                             r"timed in \d+\.\d s", line)[1] for line in phases] == whats
        assert lines[-1] == "decode n=2: measured 2 variants"
