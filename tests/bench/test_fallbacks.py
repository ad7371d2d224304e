"""stackwise-bench without its optional parts, each fallback reached: no matplotlib (no plot,
said so; any --plot suffix let through), no rich (tqdm's bar), neither (no bar), no
/proc/cpuinfo (the platform's name), a framework's adapter that cannot be imported (a note,
its rows skipped), the two errors of the block list (an unknown block; a module that the
list names and that is not there, a bug), and a variant that fails to compile (a note, no
row)."""

import argparse
import sys

import pytest

from stackwise.bench import BenchConfig, measure, plot, report, workloads
from stackwise.bench import cli as bench_cli
from stackwise.bench.workloads import common


def test_without_matplotlib_no_plot_is_written_and_the_suffix_is_not_checked(monkeypatch,
                                                                               tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "matplotlib.backend_bases", None)
    said = plot.write_plot([], str(tmp_path / "p.png"))
    assert said == "matplotlib not installed: no plot written (pip install matplotlib)."
    assert not (tmp_path / "p.png").exists()
    bench_cli._check_plot_format(argparse.ArgumentParser(), str(tmp_path / "p.notaformat"))


@pytest.mark.parametrize("missing, bar", [(("rich.progress",), "tqdm"),
                                          (("rich.progress", "tqdm"), None)])
def test_the_progress_bar_falls_back_to_tqdm_then_to_none(monkeypatch, missing, bar):
    pytest.importorskip("tqdm")
    for module in missing:
        monkeypatch.setitem(sys.modules, module, None)
    progress = measure._Progress(total=3, enabled=True)
    try:
        assert progress._rich is None
        assert (progress._tqdm is not None) == (bar == "tqdm")
        progress.describe("a row")
        progress.advance()
    finally:
        progress.close()


def test_the_machine_without_proc_cpuinfo_is_the_platforms(monkeypatch):
    def unreadable(*args, **kwargs):
        raise PermissionError("no /proc here")

    monkeypatch.setattr(report, "open", unreadable, raising=False)
    monkeypatch.setattr(report.platform, "processor", lambda: "some-cpu")
    assert report.machine().startswith("some-cpu, ")


def test_an_adapter_that_cannot_be_imported_leaves_a_note(monkeypatch):
    monkeypatch.setitem(sys.modules, "stackwise.nosuch", None)
    notes = []
    assert common.adapter_or_note("stackwise.nosuch", "decode", notes) is None
    assert notes and notes[0].startswith("stackwise.nosuch: not importable (")
    assert "the decode rows of its framework" in notes[0] and "skipped" in notes[0]


def test_an_unknown_block_and_a_missing_block_module_are_errors(monkeypatch):
    with pytest.raises(ValueError, match=r"unknown block 'nope'; the blocks are mlp, "):
        workloads.cases("nope", BenchConfig(), [])
    # (a module the list names and the package lacks: a bug, raised, not a note)
    monkeypatch.setitem(workloads.BLOCKS, "mlp",
                        workloads.BLOCKS["mlp"]._replace(modules=("no_such_module",)))
    with pytest.raises(ImportError, match="no_such_module"):
        workloads.cases("mlp", BenchConfig(), [])


@pytest.mark.parametrize("phase", ["warm-up", "compile"])
def test_a_variant_that_fails_to_compile_is_noted_and_left_out(monkeypatch, phase):
    """A variant whose compile raises, at the warm-up or at a measured depth, is a note
    (``failed, skipped``, its error's first line) and no row; the others are measured."""
    real = measure._compile
    broken = "lax.scan (hand)"
    names = {}

    def build(case, n):  # (which variant each built tuple is)
        made = measure.jax.block_until_ready(case.build(n))
        names[id(made)] = case.name
        return made

    calls = {"n": 0}

    def compile_or_fail(built, *args, **kwargs):
        calls["n"] += 1
        warm = calls["n"] <= 2  # (the warm-up compiles each of the two variants once)
        if names.get(id(built)) == broken and warm == (phase == "warm-up"):
            raise RuntimeError("boom: an XLA error\nits second line")
        return real(built, *args, **kwargs)

    monkeypatch.setattr(measure, "_build", build)
    monkeypatch.setattr(measure, "_compile", compile_or_fail)
    cfg = BenchConfig.quick(blocks=("decode",), variants=("loop (separate", broken),
                            warmup=True)
    results, notes = measure.run_benchmark(cfg, progress=False, log=lambda _: None)
    assert [r.variant for r in results] == ["loop (separate params)"]
    where = broken if phase == "warm-up" else f"{broken} n="
    assert len(notes) == 1 and notes[0].startswith(f"decode/{where}"), notes
    assert notes[0].endswith(f"{measure.FAILED} (RuntimeError: boom: an XLA error)")
