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
COLUMNS = ["variant", "remat", "compile s", "compile /nn.scan", "compile /hk.layer_stack",
           "step ms", "step /loop", "step /nn.scan", "step /hk.layer_stack", "model TFLOP",
           "XLA TFLOP", "MFU %", "peak MiB", "loss"]


@pytest.fixture(scope="module")
def train():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCHMARKS))  # (it imports tpu_decode_hlo and _devices)
        yield load_script(BENCHMARKS / "tpu_train.py")


def test_the_table_has_a_row_per_family_and_every_column(train, tmp_path, monkeypatch, capsys):
    argv = ["--tiny", "--rounds", "1", "--variants", "remat off", "--markdown",
            str(tmp_path / "t.md")]
    monkeypatch.setattr("sys.argv", ["benchmarks/tpu_train.py", *argv])
    rows = train.main(argv)
    assert [(r["variant"], r["remat"]) for r in rows] == [(f, "off") for f in train.FAMILIES]
    assert all(list(r) == COLUMNS for r in rows)
    assert rows[0]["step /loop"] == "1.00" and rows[2]["step /nn.scan"] == "1.00"
    flops = train.model_flops(**{k: train.TINY[k] for k in ("d", "hidden", "n", "seq", "batch")})
    assert {r["model TFLOP"] for r in rows} == {flops / 1e12}
    assert all(r["MFU %"] > 0 and r["peak MiB"] > 0 and r["XLA TFLOP"] > 0 for r in rows)
    text = (tmp_path / "t.md").read_text()
    header, _, table_head, rule, *lines = text.splitlines()
    assert f"(on {jax.default_backend()}: " in header
    assert header.endswith(f"`{shlex.join(['python', 'benchmarks/tpu_train.py', *argv])}`")
    assert table_head == "| " + " | ".join(COLUMNS) + " |" and len(lines) == len(rows)
    assert text.strip() == capsys.readouterr().out.strip()


def test_variants_picks_rows_by_part_of_their_name(train):
    args = train.parse_args(["--tiny", "--variants", "stackwise, loop"])
    assert args.rows == [f"{f}, remat {r}" for r in train.REMATS for f in ("loop", "stackwise")]
    assert len(train.parse_args(["--tiny"]).rows) == 12


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
    row = train.measure(name, train.builds(args, [])[name], args)
    assert row["step ms"].startswith("does not fit: Ran out of memory on HBM")
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
        for family in ("loop", "stackwise"):
            params, x, loss = found[f"{family}, remat {remat}"](args.n)
            results[family] = jax.jit(jax.value_and_grad(loss))(params, x)
    (loss_loop, grads_loop), (loss_stack, grads_stack) = results["loop"], results["stackwise"]
    grads_loop = jax.tree.map(lambda *layers: jnp.stack(layers), *grads_loop)
    d, heads, seq, hidden = args.d, args.heads, args.seq, args.hidden
    bound = reassociation_bound(depth=args.n, width=(d, d, d // heads, seq, d, d, d, hidden),
                                summed=args.batch * seq)
    assert_close({"loss": loss_stack, "grads": grads_stack},
                 {"loss": loss_loop, "grads": grads_loop}, bound,
                 zero=("['b']", "['bias']"), what=f"remat {remat}")


def test_model_flops_counts_the_weights_and_the_attention(train):
    # 16 blocks of d 1024, MLP 4096: 201M weights; 8 x 1024 tokens
    flops = train.model_flops(d=1024, hidden=4096, n=16, seq=1024, batch=8)
    weights = 16 * (4 * 1024**2 + 2 * 1024 * 4096)
    assert flops == 6 * weights * 8192 + 12 * 16 * 1024**2 * 1024 * 8
