"""The example's ``--preset``: the sizes it stands for, resolved by the command line (no model
is built: a v5e-sized model is not trained on the CPU), each overridden by its flag given."""

from _scripts import load_example


def test_the_v5e_preset_gives_a_chip_sized_bfloat16_run():
    cli = load_example().cli
    args = cli.parse_args(["--preset", "v5e"])
    assert (args.layers, args.d_model, args.heads, args.seq_len, args.batch) == (
        16, 1024, 16, 1024, 8)
    assert (args.compute_dtype, args.remat, args.steps) == ("bfloat16", True, 300)
    assert {"layers", "d_model", "seq_len", "batch", "steps"} <= args.given


def test_a_flag_given_overrides_the_preset():
    cli = load_example().cli
    args = cli.parse_args(["--preset", "v5e", "--layers", "12", "--compute-dtype", "float32"])
    assert (args.layers, args.d_model, args.compute_dtype) == (12, 1024, "float32")


def test_without_a_preset_the_defaults_stand():
    cli = load_example().cli
    args = cli.parse_args([])
    assert (args.layers, args.compute_dtype, args.remat) == (None, "float32", False)
    assert cli.RUN_DEFAULTS["layers"] == 4


def test_the_preset_is_in_the_help():
    assert "--preset {v5e}" in load_example().cli.parser().format_help()
