"""benchmarks/tpu_train.py at toy sizes on the CPU: its table (rows, columns, the command in
its header) and its stack computing the loop's loss and gradients (what it times on a TPU)."""

import pathlib
import shlex

import jax
import jax.numpy as jnp
import pytest
from _scripts import load_script
from _tolerance import assert_close, reassociation_bound

BENCHMARKS = pathlib.Path(__file__).parents[2] / "benchmarks"
COLUMNS = ["variant", "remat", "compile s", "compiles", "trace / lower / XLA s", "compile /tool",
           "compile /nn.scan", "compile /hk.layer_stack", "step ms", "step /loop", "step /tool",
           "step /nn.scan", "step /hk.layer_stack", "model TFLOP", "XLA TFLOP", "MFU %",
           "peak MiB", "loss"]
FAMILIES = ["loop", "stackwise", "stackwise unroll=2", "stackwise unroll=True", "nn.scan",
            "stackwise.flax.Stack", "hk.layer_stack", "stackwise.haiku.Stack"]


@pytest.fixture(scope="module")
def train():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCHMARKS))  # (it imports tpu_decode_hlo and _devices)
        yield load_script(BENCHMARKS / "tpu_train.py")


@pytest.mark.slow  # (14 compiles of eight families: 20-40 s)
def test_the_table_has_a_row_per_family_and_every_column(train, tmp_path, monkeypatch, capsys):
    argv = ["--tiny", "--rounds", "1", "--compiles", "2", "--variants", "remat off",
            "--markdown", str(tmp_path / "t.md")]
    monkeypatch.setattr("sys.argv", ["benchmarks/tpu_train.py", *argv])
    rows = train.main(argv)
    assert [(r["variant"], r["remat"]) for r in rows] == [(f, "off") for f in FAMILIES]
    assert all(list(r) == COLUMNS for r in rows)
    assert rows[0]["step /loop"] == "1.00" and rows[4]["step /nn.scan"] == "1.00"
    assert rows[6]["step /hk.layer_stack"] == "1.00"
    by = {r["variant"]: r for r in rows}
    # the loop and the unrolled stack compile once (--loop-compiles), the others --compiles
    # times: their median
    assert [len(r["compiles"].split()) for r in rows] == [1, 2, 2, 1, 2, 2, 2, 2]
    for r in rows:
        seconds = [float(s) for s in r["compiles"].split()]
        # (the column shows 3 significant digits: 0.5% at most off)
        assert min(seconds) * 0.995 <= r["compile s"] <= max(seconds) * 1.005
        # each stage's median, apart: together within the compiles' range
        stages = [float(s) for s in r["trace / lower / XLA s"].split(" / ")]
        assert len(stages) == 3 and all(s > 0 for s in stages)
        assert sum(stages) <= max(seconds) * 1.015
    # an adapter's /tool ratios are to its own framework's tool, the other rows have none
    for adapter, tool in (("stackwise.flax.Stack", "nn.scan"),
                          ("stackwise.haiku.Stack", "hk.layer_stack")):
        for what in ("compile", "step"):
            assert by[adapter][f"{what} /tool"] == by[adapter][f"{what} /{tool}"] != "-"
        # the same block on the same params: the tool's first loss
        assert by[adapter]["loss"] == by[tool]["loss"]
    assert all(by[f]["compile /tool"] == by[f]["step /tool"] == "-"
               for f in ("loop", "stackwise", "stackwise unroll=2", "stackwise unroll=True",
                         "nn.scan", "hk.layer_stack"))
    flops = train.model_flops(**{k: train.TINY[k] for k in ("d", "hidden", "n", "seq", "batch")})
    assert {r["model TFLOP"] for r in rows} == {flops / 1e12}
    assert all(r["MFU %"] > 0 and r["peak MiB"] > 0 and r["XLA TFLOP"] > 0 for r in rows)
    text = (tmp_path / "t.md").read_text()
    header, _, table_head, rule, *lines = text.splitlines()
    assert f"(on {jax.default_backend()}: " in header
    assert header.endswith(f"`{shlex.join(['python', 'benchmarks/tpu_train.py', *argv])}`")
    assert table_head == "| " + " | ".join(COLUMNS) + " |" and len(lines) == len(rows)
    assert text.strip() == capsys.readouterr().out.strip()


@pytest.mark.slow  # (two rows compiled and traced: ~5 s)
def test_profile_writes_each_rows_trace_and_compiled_program(train, tmp_path, monkeypatch):
    folder = tmp_path / "new" / "profile"  # (made, parents too)
    argv = ["--tiny", "--rounds", "1", "--compiles", "1", "--variants", "loop,stackwise",
            "--remat", "dots", "--profile", str(folder)]
    monkeypatch.setattr("sys.argv", ["benchmarks/tpu_train.py", *argv])
    rows = train.main(argv)
    assert [(r["variant"], r["remat"]) for r in rows] == [("loop", "dots"), ("stackwise", "dots")]
    for slug, loops in (("loop_remat_dots", False), ("stackwise_remat_dots", True)):
        text = (folder / f"{slug}.hlo.txt").read_text()
        assert text.startswith("HloModule ")
        assert (" while(" in text) == loops  # (the stack's scan is a while loop, the loop's not)
        assert list((folder / slug).rglob("*.xplane.pb")), f"no trace of {slug}"
    assert sorted(p.name for p in folder.iterdir()) == [
        "loop_remat_dots", "loop_remat_dots.hlo.txt", "stackwise_remat_dots",
        "stackwise_remat_dots.hlo.txt"]


def test_variants_picks_rows_by_family_or_part_of_their_name(train):
    args = train.parse_args(["--tiny", "--variants", "stackwise, loop"])
    assert args.rows == [f"{f}, remat {r}" for r in train.REMATS for f in ("loop", "stackwise")]
    assert len(train.parse_args(["--tiny"]).rows) == 24


@pytest.mark.parametrize(("variants", "remat", "rows"), [
    ("remat dots", "", [f"{f}, remat dots" for f in FAMILIES]),
    (".Stack", "off", ["stackwise.flax.Stack, remat off", "stackwise.haiku.Stack, remat off"]),
    ("stackwise.haiku.Stack, nn.scan", "full",
     ["nn.scan, remat full", "stackwise.haiku.Stack, remat full"]),
    ("haiku", "dots,full", ["stackwise.haiku.Stack, remat dots",
                            "stackwise.haiku.Stack, remat full"]),
    ("stackwise,.Stack,nn.scan,hk.layer_stack", "full",
     [f"{f}, remat full" for f in FAMILIES if f not in ("loop", "stackwise unroll=2",
                                                        "stackwise unroll=True")]),
    ("unroll", "dots", ["stackwise unroll=2, remat dots", "stackwise unroll=True, remat dots"]),
    ("unroll=True", "off", ["stackwise unroll=True, remat off"]),
    ("", "off", [f"{f}, remat off" for f in FAMILIES]),
])
def test_variants_and_remat_pick_the_new_rows(train, variants, remat, rows):
    assert train.parse_args(["--tiny", "--variants", variants, "--remat", remat]).rows == rows


@pytest.mark.parametrize(("argv", "flag"), [
    (["--compiles", "0"], "--compiles"), (["--compiles", "-2"], "--compiles"),
    (["--loop-compiles", "0"], "--loop-compiles"), (["--remat", "layer"], "--remat"),
    (["--variants", "nothing"], "--variants"),
    (["--variants", "loop", "--remat", "off,"], None),
])
def test_misuse_is_argparses_error_naming_the_flag(train, capsys, argv, flag):
    if flag is None:  # (an empty part is no part)
        assert train.parse_args(["--tiny", *argv]).rows == ["loop, remat off"]
        return
    with pytest.raises(SystemExit) as e:
        train.parse_args(["--tiny", *argv])
    assert e.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize(("counts", "rounds"), [
    ({"a": 1}, [["a"]]),
    ({"a": 3, "b": 3, "c": 3}, [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]),
    ({"loop": 1, "b": 3, "c": 3}, [["loop", "b", "c"], ["b", "c"], ["c", "b"]]),
    ({"loop": 1, "b": 2, "c": 2, "d": 2}, [["loop", "b", "c", "d"], ["b", "c", "d"]]),
    ({"a": 2, "b": 4}, [["a", "b"], ["b", "a"], ["b"], ["b"]]),
    ({}, []),
])
def test_compile_order_rotates_the_rows_by_the_round(train, counts, rounds):
    assert train.compile_order(list(counts), counts) == rounds


def test_no_row_always_compiles_first_or_second(train):
    rows = [f"{f}, remat dots" for f in FAMILIES]
    rounds = train.compile_order(rows, {r: 1 if r.startswith("loop") else 3 for r in rows})
    for row in rows[1:]:
        places = [order.index(row) for order in rounds]
        assert len(places) == 3 and len(set(places)) == 3  # (a new place each round)


def test_the_compile_column_is_the_median_of_the_interleaved_compiles(train, monkeypatch):
    """``measure_all`` with ``measure`` and ``cold_compile`` replaced: who compiles when,
    and what the row gets."""
    calls = []
    # (trace, lower, XLA) seconds of each compile, in call order: the XLA stage its total - 2
    seconds = iter([(0.5, 0.5, t - 1.0) for t in [5.0, 1.5, 2.0, 9.0, 3.0, 4.0, 7.0]])

    def measure(name, build, args):
        calls.append(("measure", name))
        family, remat = name.split(", remat ")
        if family == "nn.scan":
            return {"variant": family, "remat": remat, "step ms": "does not fit: HBM"}, None
        return {"variant": family, "remat": remat, "compiles": [next(seconds)]}, (name,)

    def cold_compile(name):
        calls.append(("compile", name))
        return next(seconds), None

    monkeypatch.setattr(train, "measure", measure)
    monkeypatch.setattr(train, "cold_compile", cold_compile)
    args = train.parse_args(["--tiny", "--compiles", "3", "--variants",
                             "loop,stackwise,nn.scan,stackwise.flax.Stack", "--remat", "dots"])
    found = {name: None for name in args.rows}
    rows = train.measure_all(found, args)
    L, S, N, F = args.rows
    assert calls == [("measure", L), ("measure", S), ("measure", N), ("measure", F),
                     ("compile", S), ("compile", F),  # (N did not fit: not again)
                     ("compile", F), ("compile", S)]
    assert [r["variant"] for r in rows] == ["loop", "stackwise", "nn.scan",
                                           "stackwise.flax.Stack"]
    # in call order L 5, S 1.5, F 2, S 9, F 3, F 4, S 7 (each the sum of its three stages)
    assert [r.get("compile s") for r in rows] == [5.0, 7.0, None, 3.0]
    assert [r.get("compiles") for r in rows] == ["5", "1.5 9 7", None, "2 3 4"]
    # each stage's own median: S's XLA stages 0.5, 8, 6; F's 1, 2, 3
    assert [r.get("trace / lower / XLA s") for r in rows] == [
        "0.5 / 0.5 / 4", "0.5 / 0.5 / 6", None, "0.5 / 0.5 / 2"]


def test_the_chip_sizes_are_the_default_and_a_flag_overrides_them(train):
    args = train.parse_args(["--batch", "4"])
    assert (args.d, args.heads, args.hidden, args.n, args.seq, args.batch) == (
        1024, 16, 4096, 16, 1024, 4)
    assert train.parse_args(["--tiny", "--n", "5"]).n == 5


def test_a_program_over_the_devices_memory_is_a_row_that_says_so(train, monkeypatch):
    def too_big(loss):
        class Step:
            def trace(self, *args):
                raise jax.errors.JaxRuntimeError(
                    "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required "
                    "for HLO temporaries (18.92G) exceeds available HBM (15.75G).")

        return Step()

    monkeypatch.setattr(train, "sgd_step", too_big)
    args = train.parse_args(["--tiny", "--variants", "stackwise, remat off"])
    name = args.rows[0]
    row, again = train.measure(name, train.builds(args, [])[name], args)
    assert row["step ms"].startswith("does not fit: Ran out of memory on HBM")
    assert again is None  # (not compiled again)
    assert train.with_ratios([row])[0]["step /loop"] == "-"


def test_another_error_is_raised(train, monkeypatch):
    def broken(loss):
        class Step:
            def trace(self, *args):
                raise jax.errors.JaxRuntimeError("INTERNAL: something else")

        return Step()

    monkeypatch.setattr(train, "sgd_step", broken)
    args = train.parse_args(["--tiny", "--variants", "stackwise, remat off"])
    with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
        train.measure(args.rows[0], train.builds(args, [])[args.rows[0]], args)


@pytest.mark.parametrize("remat", ["off", "dots", "full"])
def test_the_stack_computes_the_loops_loss_and_gradients(train, remat):
    """The stack and the loop of the table, on the same params, compared at float32 with
    'highest' matmuls, where only the order of their sums may differ: within
    ``reassociation_bound`` (tests/_tolerance.py derives it) of a chain of ``n`` blocks, each
    summing over d (the norms, the qkv, out and fc1 projections), the head size (the scores),
    seq (the weighted values) and hidden (fc2), with the loss and the gradients summing
    over the batch's tokens. (In bfloat16 such a bound, over every rounding of a block's
    forward and backward pass, exceeds the values' own size: the table's runs compare the
    first steps' losses there.)"""
    args = train.parse_args(["--tiny"])
    found = train.builds(args, [])
    with jax.default_matmul_precision("highest"):
        results = {}
        for family in ("loop", "stackwise", "stackwise unroll=2", "stackwise unroll=True"):
            params, x, loss = found[f"{family}, remat {remat}"](args.n)
            results[family] = jax.jit(jax.value_and_grad(loss))(params, x)
    loss_loop, grads_loop = results.pop("loop")
    grads_loop = jax.tree.map(lambda *layers: jnp.stack(layers), *grads_loop)
    d, heads, seq, hidden = args.d, args.heads, args.seq, args.hidden
    bound = reassociation_bound(depth=args.n, width=(d, d, d // heads, seq, d, d, d, hidden),
                                summed=args.batch * seq)
    for family, (loss_stack, grads_stack) in results.items():
        assert_close({"loss": loss_stack, "grads": grads_stack},
                     {"loss": loss_loop, "grads": grads_loop}, bound,
                     zero=("['b']", "['bias']"), what=f"{family}, remat {remat}")


def test_model_flops_counts_the_weights_and_the_attention(train):
    # 16 blocks of d 1024, MLP 4096: 201M weights; 8 x 1024 tokens
    flops = train.model_flops(d=1024, hidden=4096, n=16, seq=1024, batch=8)
    weights = 16 * (4 * 1024**2 + 2 * 1024 * 4096)
    assert flops == 6 * weights * 8192 + 12 * 16 * 1024**2 * 1024 * 8


@pytest.mark.parametrize("remat", ["off", "dots", "full"])
@pytest.mark.parametrize(("adapter", "tool"), [("stackwise.flax.Stack", "nn.scan"),
                                               ("stackwise.haiku.Stack", "hk.layer_stack")])
def test_an_adapter_computes_its_tools_loss_and_gradients(train, adapter, tool, remat):
    """The adapter's row runs the tool's block on the tool's params (converted): at float32
    with 'highest' matmuls, its loss and gradients are the tool's, within the
    reassociation bound of the test above."""
    args = train.parse_args(["--tiny"])
    found = train.builds(args, [])
    with jax.default_matmul_precision("highest"):
        results = {}
        for family in (tool, adapter):
            params, x, loss = found[f"{family}, remat {remat}"](args.n)
            results[family] = jax.jit(jax.value_and_grad(loss))(params, x)
    (loss_tool, grads_tool), (loss_adapter, grads_adapter) = results[tool], results[adapter]
    # the same leaves in the same order, under other names (the Stack's, the tool's)
    grads_adapter = jax.tree.unflatten(jax.tree.structure(grads_tool),
                                       jax.tree.leaves(grads_adapter))
    d, heads, seq, hidden = args.d, args.heads, args.seq, args.hidden
    bound = reassociation_bound(depth=args.n, width=(d, d, d // heads, seq, d, d, d, hidden),
                                summed=args.batch * seq)
    assert_close({"loss": loss_adapter, "grads": grads_adapter},
                 {"loss": loss_tool, "grads": grads_tool}, bound,
                 zero=("['b']", "['bias']", "['offset']"), what=f"{adapter}, remat {remat}")
