"""stackwise.bench.plot: the figure, drawn from the saved results (no measuring)."""

import pathlib

import pytest

from stackwise.bench import Result, read_csv, write_plot
from stackwise.bench.plot import _dodges, _styles, family

RESULTS = pathlib.Path(__file__).parents[2] / "benchmarks" / "results"
PNG = b"\x89PNG\r\n\x1a\n"


def test_families():
    def fam(framework, variant):
        return family(Result("b", 2, framework, variant, "off"))

    assert fam("jax", "loop (stacked slices)") == "Python loop"
    assert fam("jax", "lax.scan+checkpoint (hand)") == "hand-written lax.scan"
    assert fam("jax", "stackwise nested") == "stackwise.stack"
    assert {fam("haiku", "hk loop"), fam("haiku", "stackwise.haiku.Stack")} == {"Haiku"}
    assert fam("equinox", "filter_vmap+scan") == "Equinox"
    assert fam("mlx", "mlx.scan") == "mlx"  # a framework not named yet


def test_plot_of_several_depths_and_of_one(tmp_path):
    pytest.importorskip("matplotlib")
    rows = read_csv(str(RESULTS / "mlp.csv")) + read_csv(str(RESULTS / "adapters48.csv"))
    assert len({r.n for r in rows if r.block == "transformer"}) == 1  # a dot chart
    path = tmp_path / "bench.png"
    assert write_plot(rows, str(path)) is None
    assert path.read_bytes()[:8] == PNG


def test_nothing_to_plot_is_said(tmp_path):
    assert write_plot([], str(tmp_path / "x.png")) == "no results to plot."


def test_every_series_is_told_apart():
    # The MLP panels' 16 series (stackwise's and Equinox's among them): no two alike, and no
    # family shares stackwise's colour.
    rows = read_csv(str(RESULTS / "mlp.csv"))
    styles = _styles(rows)
    assert len(styles) == 16
    looks = {(s["color"], s["marker"], s["linestyle"]) for s in styles.values()}
    assert len(looks) == len(styles)
    base = {s["family"]: s["color"] for s in reversed(list(styles.values()))}  # darkest
    assert len(set(base.values())) == len(base) == 4  # loop, hand scan, stackwise, Equinox


def test_equal_series_are_drawn_side_by_side():
    same = [(6, 10.0), (26, 20.0)]
    series = {"a": same, "b": [(6, 10.0), (26, 20.04)], "c": same, "d": [(6, 5.0), (26, 20.0)]}
    dodges = _dodges(series)
    assert dodges["d"] == 1.0  # alone
    assert dodges["a"] < dodges["b"] < dodges["c"]  # spread around n, in order
    assert dodges["b"] == pytest.approx(1.0) and dodges["a"] * dodges["c"] == pytest.approx(1.0)
