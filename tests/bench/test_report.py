"""stackwise.bench.report: tables that fit a 100-column terminal, CSV written and read back
(including the CSVs in benchmarks/results/, written by earlier versions), Markdown."""

import csv
import dataclasses
import io
import math
import pathlib
import sys

import pytest

from stackwise.bench import BenchConfig, Result, print_report, read_csv, write_csv, write_markdown

RESULTS = pathlib.Path(__file__).parents[2] / "benchmarks" / "results"
SAVED = sorted(RESULTS.glob("*.csv"))
TERMINAL = 100


def _rows():
    """Every row of every saved run in ``benchmarks/results``."""
    return [r for path in SAVED for r in read_csv(str(path))]


def _values(r: Result) -> list:
    """The result's fields, NaN made comparable."""
    return ["nan" if isinstance(v, float) and math.isnan(v) else v
            for v in dataclasses.astuple(r)]


def test_saved_results_are_readable():
    assert SAVED, f"no CSV in {RESULTS}"
    rows = _rows()
    assert {r.block for r in rows} == {"mlp", "transformer", "decode", "prefill", "pattern"}
    assert all(r.compile_s > 0 and r.step_samples for r in rows)


def test_csv_round_trip(tmp_path):
    rows = _rows()
    write_csv(rows, str(tmp_path / "again.csv"))
    again = read_csv(str(tmp_path / "again.csv"))
    assert [_values(r) for r in again] == [_values(r) for r in rows]  # exactly


@pytest.mark.parametrize("rich", [True, False], ids=["rich", "plain"])
def test_tables_fit_a_terminal(rich, monkeypatch):
    if rich:
        pytest.importorskip("rich")
    else:
        monkeypatch.setitem(sys.modules, "rich", None)
    out = io.StringIO()
    notes = ["haiku: not installed (pip install 'stackwise[haiku]'); the haiku rows of the "
             "transformer block are skipped."]
    print_report(_rows(), notes, BenchConfig(), out)
    lines = out.getvalue().splitlines()
    assert max(len(line.rstrip()) for line in lines) <= TERMINAL
    text = out.getvalue()
    for variant in ("stackwise nested", "hk.layer_stack+hk.remat(dots)",
                    "stackwise.nnx.Stack default"):
        assert variant in text  # whole, not wrapped
    assert "note: haiku: not installed" in text


def test_a_decoding_table_fits_a_terminal_and_shows_the_cache():
    names = ["loop (separate params)", "lax.scan (hand)", "lax.scan (cache in carry)",
             "stackwise"]
    rows = [Result("decode", 48, "jax", name, "off", compile_s=12.34, step_s=0.1234,
                   temp_bytes=2**20, state_bytes=384 * 2**20, program_chars=10**5,
                   barrier_param_bytes=0, barrier_const_bytes=0, compile_vs_scan=1.234,
                   compile_vs_loop=1.234, step_vs_scan=1.234, step_vs_loop=12.34)
            for name in names]
    out = io.StringIO()
    print_report(rows, [], BenchConfig(), out)
    text = out.getvalue()
    assert max(len(line.rstrip()) for line in text.splitlines()) <= TERMINAL
    assert all(name in text for name in names)  # whole, not wrapped
    assert "state" in text and "384.0" in text
    assert "barrier" not in text  # no grad, no remat: nothing passes barriers


def test_wide_tables_have_every_column():
    out = io.StringIO()
    print_report(_rows(), [], BenchConfig(), out, wide=True)
    assert "Kchars" in out.getvalue() and "trace" in out.getvalue()


def test_markdown_has_every_column(tmp_path):
    path = tmp_path / "out.md"
    write_markdown(_rows(), BenchConfig(), str(path))
    text = path.read_text()
    header = next(line for line in text.splitlines() if line.startswith("| n |"))
    assert header.count("|") == 18  # 17 columns
    assert "| 48 | stackwise.haiku.Stack remat | layer |" in text


def test_every_table_names_the_backend_and_the_versions(tmp_path):
    import importlib.metadata

    import jax
    from jaxlib import version

    from stackwise.bench.report import backend

    where = backend()
    assert where.startswith(f"{jax.default_backend()}: {jax.device_count()} x ")
    assert f"jax {jax.__version__}, jaxlib {version.__version__}" in where
    try:
        assert f"libtpu {importlib.metadata.version('libtpu')}" in where
    except importlib.metadata.PackageNotFoundError:
        assert "libtpu" not in where  # named where it is installed
    rows = _rows()
    blocks = list(dict.fromkeys(r.block for r in rows))
    out = io.StringIO()
    print_report(rows, [], BenchConfig(), out)
    assert out.getvalue().replace("\n  ", " ").count(f"[on {where}]") == len(blocks)
    write_markdown(rows, BenchConfig(), str(tmp_path / "out.md"))
    titles = [ln for ln in (tmp_path / "out.md").read_text().splitlines() if ln.startswith("**")]
    assert len(titles) == len(blocks) and all(t.endswith(f"** (on {where})") for t in titles)
    write_markdown(rows, BenchConfig(), str(tmp_path / "tpu.md"), where="tpu: 1 x TPU v5 lite")
    assert "** (on tpu: 1 x TPU v5 lite)" in (tmp_path / "tpu.md").read_text()
    write_csv(rows[:1], str(tmp_path / "one.csv"))
    with open(tmp_path / "one.csv", newline="") as f:
        (row,) = csv.DictReader(f)
    assert row["backend"] == where
