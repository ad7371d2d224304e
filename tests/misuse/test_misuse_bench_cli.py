"""Misuses of the `stackwise-bench` command line, as a user who mistypes would try them.

Each is refused before any work (nothing measured, nothing written) with one line that names
the flag, exit status 2 and no traceback. The command runs in-process (`main(argv)`).
"""

from __future__ import annotations

import os

import pytest

import stackwise.bench
from stackwise.bench import BenchConfig, Result, cli, measure, run_benchmark

#: (argv, the flag the message must name, a part of the message); "{tmp}" is a fresh folder.
CASES = [
    (["--blocks", "cnn"], "--blocks", "unknown cnn; choose from mlp"),
    (["--blocks", "mlp,cnn"], "--blocks", "unknown cnn"),
    (["--blocks", ","], "--blocks", "no block named"),
    (["--blocks"], "--blocks", "expected one argument"),
    (["--n", "0,8"], "--n", "positive"),
    (["--n", "8,x"], "--n", "comma-separated ints"),
    (["--n", ""], "--n", "positive"),
    (["--transformer-n", "-1"], "--transformer-n", "positive"),
    (["--decode-n", "2.5"], "--decode-n", "comma-separated ints"),
    # A pattern of 3 layers needs n >= 3: refused, not run with its stackwise rows skipped.
    (["--blocks", "pattern", "--pattern-n", "2"], "--pattern-n", "need n >= 3"),
    (["--blocks", "pattern", "--pattern-n", "2,6"], "--pattern-n", "need n >= 3"),
    (["--quick", "--pattern-n", "1"], "--pattern-n", "need n >= 3"),
    # A depth flag of a block that does not run would be ignored: refused.
    (["--blocks", "mlp", "--pattern-n", "4"], "--pattern-n", "block is not run"),
    (["--quick", "--decode-n", "4"], "--decode-n", "block is not run"),
    # The decode blocks' sizes: well formed, for a block that runs, heads dividing D, a cache
    # longer than the prompt.
    (["--decode-shape", "1024:2048"], "--decode-shape", "expected D:T:B, three positive ints"),
    (["--decode-shape", "1024:0:8"], "--decode-shape", "got '1024:0:8'"),
    (["--decode-shape", "a:b:c"], "--decode-shape", "e.g. 1024:2048:8, got 'a:b:c'"),
    (["--decode-heads", "0"], "--decode-heads", "positive"),
    (["--blocks", "mlp", "--decode-shape", "512:1024:8"], "--decode-shape",
     "neither the decode nor the prefill block is run (--blocks mlp)"),
    (["--blocks", "mlp", "--decode-heads", "8"], "--decode-heads", "neither the decode"),
    (["--decode-dtype", "float16"], "--decode-dtype",
     "invalid choice: 'float16'"),  # (argparse lists the choices, quoted or not by version)
    (["--blocks", "mlp", "--decode-dtype", "bfloat16"], "--decode-dtype",
     "--decode-dtype bfloat16: neither the decode nor the prefill block is run"),
    (["--one-at-a-time=yes"], "--one-at-a-time", "ignored explicit argument 'yes'"),
    (["--blocks", "decode", "--decode-shape", "100:1024:8", "--decode-heads", "8"],
     "--decode-heads", "8 heads do not divide D=100"),
    (["--blocks", "prefill", "--decode-shape", "102:1024:8"], "--decode-shape",
     "4 heads do not divide D=102"),
    (["--blocks", "decode", "--decode-shape", "256:64:8"], "--decode-shape",
     "a cache of 64 positions holds no token after the 64-token prompt"),
    (["--rounds", "0"], "--rounds", "positive"),
    (["--rounds", "2,3"], "--rounds", "one positive int"),
    (["--rounds", "1.5"], "--rounds", "comma-separated ints"),
    (["--compile-repeats", "0"], "--compile-repeats", "positive"),
    (["--seed", "-1"], "--seed", "from 0 to 4294967295"),
    (["--seed", str(2**32)], "--seed", "from 0 to 4294967295"),
    (["--seed", "x"], "--seed", "invalid int value"),
    (["--variants", "stackwise,stackwsie", "--blocks", "mlp"], "--variants",
     "'stackwsie' matches no variant of the blocks mlp; the variants there are: loop"),
    (["--variants", "haiku.Stack", "--blocks", "mlp"], "--variants",
     "no variant of the blocks mlp matches haiku.Stack"),
    # Outputs, checked before the run starts.
    (["--csv", "{tmp}/missing/out.csv"], "--csv", "there is no folder {tmp}/missing"),
    (["--csv", "{tmp}"], "--csv", "a folder; give a file path"),
    (["--plot", "{tmp}/missing/out.png"], "--plot", "there is no folder"),
    (["--plot", "{tmp}/out.csv"], "--plot", "matplotlib cannot write .csv files"),
    (["--markdown", "{tmp}/missing/out.md"], "--markdown", "there is no folder"),
    (["--csv", "{tmp}/a.out", "--plot", "{tmp}/a.out"], "--plot", "also given to --csv"),
    (["--csv", "{tmp}/t.csv", "--markdown", "{tmp}/../{tmp_name}/t.csv"], "--markdown",
     "also given to --csv"),
    (["--stpes", "3"], "--stpes", "unrecognized arguments"),
    (["--quick", "mlp"], "mlp", "unrecognized arguments"),
]


def refused(argv: list[str], capsys) -> str:
    """The error of ``main(argv)``, which must exit with status 2, unwrapped."""
    with pytest.raises(SystemExit) as exit_:
        stackwise.bench.main([*argv, "--no-progress"])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert "wrote" not in captured.out and "total time" not in captured.out  # no work done
    # After argparse's usage lines: the error, one line (a list of the variants there are
    # follows the first line when nothing matches; the first line names the flag).
    error = captured.err[captured.err.index("stackwise-bench: error: "):]
    assert error.count("\n") == 1 or error.startswith("stackwise-bench: error: --variants")
    return " ".join(error.split())


@pytest.mark.every_case
@pytest.mark.parametrize("argv, flag, message", CASES)
def test_misuse_is_refused_naming_the_flag(argv, flag, message, tmp_path, capsys):
    fill = {"tmp": str(tmp_path), "tmp_name": tmp_path.name}
    argv = [a.format(**fill) for a in argv]
    if not any(a in ("--csv", "--plot") for a in argv):  # never write into the working folder
        argv += ["--csv", str(tmp_path / "b.csv"), "--plot", str(tmp_path / "b.png")]
    error = refused(argv, capsys)
    assert error.startswith("stackwise-bench: error: ") and flag in error, error
    assert message.format(**fill) in error
    assert sorted(os.listdir(tmp_path)) == []  # nothing written


def test_an_output_that_cannot_be_written_is_refused(tmp_path, capsys, monkeypatch):
    # (as root every folder is writable: stand in for a read-only one)
    monkeypatch.setattr(cli.os, "access", lambda path, mode: False)
    error = refused(["--csv", str(tmp_path / "b.csv"), "--plot", ""], capsys)
    assert f"--csv {tmp_path / 'b.csv'}: not writable" in error


def test_depths_a_block_does_not_accept_are_refused_by_the_library_too():
    need = r"pattern_ns=\(2,\): the pattern block's rows need n >= 3"
    with pytest.raises(ValueError, match=need):
        run_benchmark(BenchConfig.quick(blocks=("pattern",), pattern_ns=(2,)), progress=False)


def test_a_decode_dtype_the_blocks_do_not_run_in_is_refused_by_the_library():
    with pytest.raises(ValueError, match=r"dec_dtype='float16': the decode and prefill blocks "
                       r"run in float32 or bfloat16"):
        run_benchmark(BenchConfig.quick(blocks=("decode",), dec_dtype="float16"), progress=False)


def test_a_variant_that_failed_makes_the_exit_status_1_and_the_rest_is_written(
    tmp_path, capsys, monkeypatch
):
    measured = Result("mlp", 2, "jax", "stackwise", "off", compile_s=0.1, step_s=0.01)
    note = "mlp/stackwise remat n=2: failed, skipped (RuntimeError: out of memory)"
    monkeypatch.setattr(measure, "run_benchmark", lambda cfg, **_: ([measured], [note]))
    csv = tmp_path / "b.csv"
    code = stackwise.bench.main(["--quick", "--csv", str(csv), "--plot", "", "--no-progress"])
    assert code == 1 and csv.is_file()
    assert "1 variant(s) failed and were left out" in capsys.readouterr().err


@pytest.mark.parametrize("one_at_a_time", [False, True], ids=["together", "one at a time"])
def test_a_variant_out_of_device_memory_is_told_to_select_fewer(monkeypatch, one_at_a_time):
    """Every variant of a depth is held at once (their steps are timed in turns): a variant
    that finds the device full is skipped with a note that says so and how to fit; measured
    one at a time, that it does not fit alone."""
    built = measure._build

    def build(case, n):
        if case.name == "stackwise default":
            raise RuntimeError("RESOURCE_EXHAUSTED: E0100: RuntimeBufferAllocationFailure:")
        return built(case, n)

    monkeypatch.setattr(measure, "_build", build)
    results, notes = run_benchmark(BenchConfig.quick(blocks=("mlp",), ns=(2,), variants=(
        "stackwise default", "lax.scan (hand)"), one_at_a_time=one_at_a_time), progress=False,
        log=lambda _: None)
    assert [r.variant for r in results] == ["lax.scan (hand)"]  # the other, measured
    (note,) = [note for note in notes if measure.FAILED in note]
    assert note.startswith("mlp/stackwise default n=2: failed, skipped (RuntimeError: "
                           "RESOURCE_EXHAUSTED")
    if one_at_a_time:
        assert note.endswith("out of device memory with this variant alone: give smaller sizes")
    else:
        assert "out of device memory" in note and "select fewer with --variants" in note
        assert "--one-at-a-time" in note
