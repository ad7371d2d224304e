"""benchmarks/tpu_decode_hlo.py and offload_memory.py: the tables they read from compiled
programs, checked on the CPU (what they report for a TPU needs libtpu: their docstrings say how
to run them without a chip)."""

import pathlib

import jax
import pytest
from _scripts import load_script

BENCHMARKS = pathlib.Path(__file__).parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def decode_hlo():
    return load_script(BENCHMARKS / "tpu_decode_hlo.py")


def test_every_decode_variant_compiles_and_is_read(decode_hlo):
    rows = decode_hlo.measure(2, 16, 8, 1, 2, "float32", jax.devices()[0])
    assert [r["variant"] for r in rows] == list(decode_hlo.variants(2, 16, 2))
    for row in rows:
        assert row["cache MiB"] == 2 * 2 * 8 * 16 * 4 / 2**20
        assert row["per-layer cache buffers in the loop"] == len(row["made"].split(", ")) or (
            row["made"] == "-" and row["per-layer cache buffers in the loop"] == 0)
    table = decode_hlo.table(rows, "header")
    assert table.splitlines()[0] == "header" and len(table.splitlines()) == 4 + len(rows)


def test_timed_rows_run_each_program_and_compare_it_with_the_loop(decode_hlo):
    only = ("loop", "to_serving", "AUTO")  # (the loop, and a cache in the compiler's layout)
    rows = decode_hlo.measure(2, 16, 8, 2, 2, "float32", jax.devices()[0], rounds=1, only=only)
    assert [r["variant"] for r in rows] == [
        "loop (= serving layout)", "stackwise, to_serving", "the same, Layout.AUTO cache"]
    for row in rows:
        assert row["ms/step"] > 0 and row["tokens/s"] == pytest.approx(2e3 / row["ms/step"])
        touched = 2 * (4 * 16 * 16 + 4 * 16) * 4 + 2 * 2 * (2 * 8 * 16 * 4)
        assert row["HBM share"] == pytest.approx(touched / 819e9 / (row["ms/step"] / 1e3))
        assert row["/loop"] == pytest.approx(row["ms/step"] / rows[0]["ms/step"])
    assert decode_hlo.measure(2, 16, 8, 2, 2, "float32", jax.devices()[0], only=("nothing",)) == []


def test_a_layer_sized_copy_or_slice_is_found_and_another_size_is_not(decode_hlo):
    hlo = "\n".join([
        "  %copy.1 = f32[1,8,1024,8,64]{4,3,1,2,0:T(8,128)S(1)} copy(%x)",
        "  %constant_dynamic-slice_fusion.2 = f32[1,8,1024,8,64]{2,4,3,1,0:T(8,128)} fusion(%y)",
        "  %fusion.3 = f32[1,8,1024,8,64]{2,4,3,1,0} fusion(%z)",  # no slice in its name
        "  %copy.4 = f32[8,1,512]{2,1,0} copy(%w)",  # another size
    ])
    assert decode_hlo.per_layer_buffers(hlo, "8,1024,8,64") == [
        "copy {4,3,1,2,0} VMEM", "fusion {2,4,3,1,0} HBM"]


class FailingJit:
    """Stands for ``jax.jit``: every program's compile raises ``error``."""

    error = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for "
             "HLO temporaries (18.14G) exceeds available HBM (15.75G).")

    def __init__(self, fn, **kw):
        pass

    def trace(self, *args):
        return self

    def lower(self):
        return self

    def compile(self):
        raise jax.errors.JaxRuntimeError(self.error)


def test_a_program_over_the_chips_memory_is_a_row_that_says_so(decode_hlo, monkeypatch):
    monkeypatch.setattr(jax, "jit", FailingJit)
    rows = decode_hlo.measure(2, 16, 8, 1, 2, "float32", jax.devices()[0])
    assert all(r["made"].startswith("does not fit: Ran out of memory on HBM") for r in rows)
    assert "| does not fit" in decode_hlo.table(rows, "header")


def test_another_compile_error_is_raised(decode_hlo, monkeypatch):
    class Broken:
        def __init__(self, fn, **kw):
            pass

        def trace(self, *args):
            raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    monkeypatch.setattr(jax, "jit", Broken)
    with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
        decode_hlo.measure(2, 16, 8, 1, 2, "float32", jax.devices()[0])


def test_offload_memory_rows(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # (it imports tpu_decode_hlo, its sibling)
    offload = load_script(BENCHMARKS / "offload_memory.py")
    rows = offload.measure(3, 8, 4, jax.devices()[0])
    assert [(r["matmuls"], r["remat"]) for r in rows] == [
        (precision, remat) for precision in ("default", "highest")
        for remat in ("no remat", "remat=True", "save the carries", "offload the carries")]
    assert {r["carries MiB"] for r in rows} == {3 * 4 * 8 * 4 / 2**20}
    assert {r["host temp MiB"] for r in rows} == {0.0}  # one memory on the CPU


def test_report_prints_and_writes_the_table_with_the_command(decode_hlo, tmp_path, capsys,
                                                              monkeypatch):
    monkeypatch.setattr("sys.argv", ["benchmarks/offload_memory.py", "--shapes", "2:8:4"])
    out = tmp_path / "t.md"
    decode_hlo.report([{"a": 1.25}], "machine", str(out))
    text = out.read_text()
    assert text.startswith("machine; `python benchmarks/offload_memory.py --shapes 2:8:4`\n")
    assert "| 1.25 |" in text and capsys.readouterr().out.strip() == text.strip()
    decode_hlo.report([{"a": 1234.56}], "machine", "")  # printed only
    assert "| 1234.6 |" in capsys.readouterr().out


@pytest.fixture(scope="module")
def generate():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCHMARKS))  # (it imports tpu_decode_hlo, its sibling)
        yield load_script(BENCHMARKS / "tpu_generate.py")


def test_the_generate_programs_decode_the_same_tokens_in_every_layout(generate):
    import jax.numpy as jnp
    import numpy as np

    n, d, t, b, heads, tokens = 3, 16, 12, 2, 2, 5
    rng = np.random.default_rng(0)
    stacked = {name: {"w": jnp.asarray(rng.standard_normal((n, d, k * d)) / 4, jnp.float32),
                      "b": jnp.asarray(rng.standard_normal((n, k * d)) / 4, jnp.float32)}
               for name, k in (("qkv", 3), ("out", 1))}
    cache = {c: jnp.zeros((n, b, t, heads, d // heads)) for c in "kv"}
    h = jnp.asarray(rng.standard_normal((b, 1, d)), jnp.float32)
    pos = jnp.int32(2)
    runs = generate.programs(n, d, heads, tokens)
    assert list(runs) == list(generate.VARIANTS)
    layers = lambda tree: [jax.tree.map(lambda a, i=i: a[i], tree) for i in range(n)]  # noqa: E731
    want_h, want_cache = jax.jit(runs["loop"][0])(layers(stacked), layers(cache), h, pos)
    want_cache = jax.tree.map(lambda *a: jnp.stack(a), *want_cache)
    assert float(jnp.abs(want_cache["k"][:, :, pos + tokens - 1]).max()) > 0  # (all written)
    assert float(jnp.abs(want_cache["k"][:, :, pos + tokens]).max()) == 0
    for name in generate.VARIANTS[1:]:
        got_h, got_cache = jax.jit(runs[name][0])(stacked, cache, h, pos)
        np.testing.assert_allclose(got_h, want_h, rtol=1e-5, atol=1e-5, err_msg=name)
        for c in "kv":
            np.testing.assert_allclose(got_cache[c], want_cache[c], rtol=1e-5, atol=1e-5,
                                       err_msg=name)


def test_generate_rows_are_timed_against_the_loop(generate):
    rows = generate.measure(2, 16, 12, 2, 2, "float32", 3, jax.devices()[0], rounds=1,
                            only=("loop", "to_serving"))
    assert [r["variant"] for r in rows] == ["loop", "to_serving in the jit"]
    for row in rows:
        assert row["compile s"] > 0 and row["temp MiB"] >= 0 and row["slice-start"] == 0
        assert row["tokens/s"] == pytest.approx(2e3 / row["ms/token"])
        assert row["/loop"] == pytest.approx(row["ms/token"] / rows[0]["ms/token"])
    assert generate.measure(2, 16, 12, 2, 2, "float32", 3, jax.devices()[0], rounds=0,
                            only=("scanned",))[0].keys().isdisjoint({"ms/token", "/loop"})


@pytest.mark.parametrize("script", ["tpu_decode_hlo.py", "tpu_generate.py"])
def test_timing_without_a_tpu_attached_is_refused(script, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    with pytest.raises(SystemExit, match="--time runs the programs, so it needs a TPU attached; "
                                         "this host has none .JAX's backend is 'cpu'."):
        load_script(BENCHMARKS / script).main(["--time", "1", "--shapes", "16:256:1"])


def test_a_generate_program_over_the_chips_memory_is_a_row_that_says_so(generate, monkeypatch):
    monkeypatch.setattr(jax, "jit", FailingJit)
    rows = generate.measure(2, 16, 12, 2, 2, "float32", 3, jax.devices()[0], rounds=1, only=())
    assert [r["variant"] for r in rows] == list(generate.VARIANTS)
    assert all(r["slice-start"].startswith("does not fit: Ran out of memory on HBM") for r in rows)
    assert "| does not fit" in generate.hlo.table(rows, "header")
    monkeypatch.setattr(FailingJit, "error", "INTERNAL: something else")
    with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
        generate.measure(2, 16, 12, 2, 2, "float32", 3, jax.devices()[0], rounds=0, only=())


def test_generate_rows_with_the_cache_in_the_compilers_layout(generate):
    rows = generate.measure(2, 16, 12, 2, 2, "float32", 3, jax.devices()[0], rounds=2,
                            only=("loop", "decode"), auto_cache=True)
    assert [(r["variant"], r["cache layout"]) for r in rows] == [
        ("loop", "AUTO"), ("Stacked.decode", "AUTO")]
    assert all(r["ms/token"] > 0 and "/loop" in r for r in rows)
    assert generate.parse_args(["--auto-cache"]).auto_cache
    assert not generate.parse_args([]).auto_cache
