"""stackwise-bench: the barrier analysis on programs with a known answer, and smoke runs.

No timing assertions: the smoke runs check that every variant runs and that the outputs
(CSV, PNG, table) are written with sane, internally consistent values.
"""

import csv
import importlib.metadata
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stackwise
from stackwise import bench
from stackwise.bench import BenchConfig, optimization_barrier_bytes, run_benchmark

N, D, H = 3, 4, 8
F32 = 4
PARAM_BYTES = N * 2 * D * H * F32  # w1 [D, H] and w2 [H, D] per layer
X = jnp.ones((2, D))


def _layer(p, h):
    return h + jnp.tanh(h @ p["w1"]) @ p["w2"]


def _stacked(n=N):
    return {"w1": jnp.full((n, D, H), 0.1), "w2": jnp.full((n, H, D), 0.1)}


def _barriers(loss, params, x=X):
    text = jax.jit(jax.grad(loss)).lower(params, x).as_text()
    return optimization_barrier_bytes(text, n_params=len(jax.tree.leaves(params)))


def paired(row, ref, what):
    """The median over repeats of row / ref, from a CSV row's samples."""
    a, b = (np.array(r[f"{what}_samples"].split(), float) for r in (row, ref))
    return float(np.median(a / b))


def test_paired_ratio_interval_and_verdicts():
    def result(samples):
        return bench.Result("mlp", 4, "jax", "v", "off", compile_s=min(samples),
                            compile_samples=tuple(samples))

    ref = result([2.0] * 9)
    # ratios 0.5, 1.0, ..., 4.5: the median and a ~95% interval from order statistics 2 and 8
    assert bench._paired_interval(result(range(1, 10)), ref, "compile") == (2.5, 1.0, 4.0)
    median, low, high = bench._paired_interval(result(range(1, 6)), result([2.0] * 5), "compile")
    assert median == 1.5 and np.isnan(low) and np.isnan(high)  # too few samples for one
    verdict = lambda limit: bench._target_cells(bench._Target("x", 2.5, limit, 1.0, 4.0))[-1]  # noqa: E731
    assert [verdict(3.0), verdict(2.0), verdict(0.9)] == ["yes", "within noise", "NO"]


# --------------------------------------------------------------------------
# optimization_barrier_bytes


def test_direct_barrier_on_params_and_on_an_activation():
    def f(w, x):
        w2, y = jax.lax.optimization_barrier((w, x @ w))
        return w2.sum() + y.sum()

    w = jnp.ones((D, H))
    text = jax.jit(f).lower(w, X).as_text()
    got = optimization_barrier_bytes(text, n_params=1)
    assert got.params == D * H * F32  # w itself
    assert got.total == D * H * F32 + 2 * H * F32  # w and the activation x @ w
    assert got.consts == 0 and got.count == 1 and got.exact


def test_python_loop_with_checkpoint_puts_every_layer_params_through_a_barrier():
    def loss(layers, h):
        for p in layers:
            h = jax.checkpoint(_layer)(p, h)  # default prevent_cse=True
        return jnp.mean(h**2)

    got = _barriers(loss, stackwise.unstack_layers(_stacked()))
    assert got.params == PARAM_BYTES
    assert got.count == N and got.exact


def test_scan_with_checkpoint_counts_each_iteration():
    # Forward and backward are two whiles in one function that both bind `%iterArg...`:
    # the names must be resolved per region.
    def loss(params, h):
        body = jax.checkpoint(lambda h, p: (_layer(p, h), None))
        return jnp.mean(jax.lax.scan(body, h, params)[0] ** 2)

    got = _barriers(loss, _stacked())
    assert got.count == 1  # one barrier in the program text ...
    assert got.params == PARAM_BYTES  # ... that runs once per layer
    assert got.exact


def test_nested_scans_multiply_trip_counts():
    n, groups = 6, 2

    def loss(params, h):
        inner = jax.checkpoint(lambda h, p: (_layer(p, h), None))
        grouped = jax.tree.map(lambda a: a.reshape(groups, n // groups, *a.shape[1:]), params)
        outer = lambda h, g: (jax.lax.scan(inner, h, g)[0], None)  # noqa: E731
        return jnp.mean(jax.lax.scan(outer, h, grouped)[0] ** 2)

    assert _barriers(loss, _stacked(n)).params == PARAM_BYTES // N * n


def test_closed_over_constant_counts_as_constant():
    mask = jnp.arange(2 * D, dtype=jnp.float32).reshape(2, D)

    def loss(layers, h):
        for p in layers:
            h = jax.checkpoint(lambda p, h: _layer(p, h) * mask)(p, h)
        return jnp.mean(h**2)

    got = _barriers(loss, stackwise.unstack_layers(_stacked()))
    assert got.consts == N * mask.size * F32
    assert got.params == PARAM_BYTES


@pytest.mark.parametrize("unroll", [1, True])
def test_stackwise_remat_passes_no_params_or_constants(unroll):
    layers = stackwise.stack(lambda k: None, _layer, N, remat=True, unroll=unroll)
    got = _barriers(lambda p, h: jnp.mean(layers.apply(p, h) ** 2), _stacked())
    assert got.params == 0 and got.consts == 0
    if unroll is True:  # straight-line code: the carry is protected, so barriers exist
        assert got.count == N and got.total > 0


def test_missing_entry_function_is_named():
    with pytest.raises(ValueError, match="no function @main"):
        optimization_barrier_bytes("module {\n}\n", n_params=1)


# --------------------------------------------------------------------------
# Packaging and optional frameworks


def test_console_script_is_declared():
    scripts = importlib.metadata.entry_points(group="console_scripts", name="stackwise-bench")
    assert [s.value for s in scripts] == ["stackwise.bench:main"]


def test_importing_bench_imports_no_framework_or_ui_library():
    heavy = ("haiku", "flax", "rich", "tqdm", "matplotlib")
    code = f"import sys, stackwise.bench; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_missing_framework_or_adapter_is_skipped_with_a_note(monkeypatch):
    cfg = BenchConfig.quick()
    monkeypatch.setitem(sys.modules, "haiku", None)  # `import haiku` now raises ImportError
    monkeypatch.setitem(sys.modules, "stackwise.nnx", None)
    notes = []
    names = [c.name for c in bench._transformer_cases(cfg, notes)]
    assert not any(name.startswith(("hk", "stackwise.haiku")) for name in names)
    assert "nnx.scan" in names and "stackwise.nnx.Stack" not in names
    assert any(note.startswith("haiku: not installed") for note in notes)
    assert any(note.startswith("stackwise.nnx: not importable") for note in notes)


def test_bad_command_line_is_refused():
    with pytest.raises(SystemExit):
        bench.main(["--blocks", "cnn"])
    with pytest.raises(SystemExit):
        bench.main(["--n", "0,8"])


# --------------------------------------------------------------------------
# Smoke runs


def test_quick_run_writes_csv_plot_and_table(tmp_path):
    csv_path, png_path = tmp_path / "bench.csv", tmp_path / "bench.png"
    out = subprocess.run(
        [sys.executable, "-m", "stackwise.bench", "--quick", "--blocks", "mlp",
         "--csv", str(csv_path), "--plot", str(png_path), "--no-progress"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Targets" in out.stdout and "stackwise nested" in out.stdout
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with csv_path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    expected = {c.name for c in bench._mlp_cases(BenchConfig.quick())}
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


def test_haiku_rows_barriers_and_same_program():
    pytest.importorskip("haiku")
    pytest.importorskip("stackwise.haiku")
    cfg = BenchConfig.quick(
        blocks=("transformer",), rounds=1, variants=("hk.layer_stack", "stackwise.haiku.Stack"),
    )
    notes = []
    results, notes = run_benchmark(cfg, progress=False, log=notes.append)
    by = {r.variant: r for r in results}
    assert set(by) == {
        "hk.layer_stack", "hk.layer_stack (control)", "hk.layer_stack+hk.remat(dots)",
        "hk.layer_stack+hk.remat", "stackwise.haiku.Stack", "stackwise.haiku.Stack default",
        "stackwise.haiku.Stack remat",
    }, notes
    # hk.remat keeps prevent_cse=True inside the scan: every layer's params pass a barrier
    for tool in ("hk.layer_stack+hk.remat", "hk.layer_stack+hk.remat(dots)"):
        assert by[tool].barrier_param_bytes > 0
    for adapter in ("stackwise.haiku.Stack default", "stackwise.haiku.Stack remat"):
        assert by[adapter].barrier_param_bytes == 0
        assert by[adapter].ops_unlike_tool > 0  # the barriers differ
    # without remat the adapter compiles to hk.layer_stack's program, names aside
    assert by["stackwise.haiku.Stack"].ops_unlike_tool == 0
    assert by["hk.layer_stack (control)"].ops_unlike_tool == 0
    adapter = by["stackwise.haiku.Stack remat"]
    assert adapter.tool == "hk.layer_stack+hk.remat"
    assert adapter.compile_vs_tool == pytest.approx(
        adapter.compile_s / by["hk.layer_stack+hk.remat"].compile_s)
