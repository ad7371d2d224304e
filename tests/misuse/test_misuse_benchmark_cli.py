"""Misuses of the benchmarks' command lines (`benchmarks/checkpoint_load.py`, `optimizer_step.py`,
`tpu_decode_hlo.py`, `offload_memory.py`, `tpu_train.py`, `autostack_compile.py`,
`multi_lora_decode.py`, `trace_depth.py`, `tpu_generate.py`).

Each is refused by argument parsing, before a checkpoint is written or JAX runs: exit status 2 and a
message naming the flag. The parser runs in-process: `parse_args(argv)`.
"""

from __future__ import annotations

import pathlib

import pytest
from _misuse import assert_cli_refused
from _scripts import load_script

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "checkpoint_load.py"

#: (argv, what the message must name (the flag), a part of the message).
CASES = [
    (["--gib", "0"], "--gib", "expected above 0, got '0'"),
    (["--gib", "nan"], "--gib", "expected above 0, got 'nan'"),
    (["--gib", "two"], "--gib", "expected a number, got 'two'"),
    (["--per-file", "0"], "--per-file", "expected 1 or more, got '0'"),
    (["--per-file", "1.5"], "--per-file", "expected a number, got '1.5'"),
    (["--repeats", "0"], "--repeats", "expected 1 or more, got '0'"),
    (["--settle", "-1"], "--settle", "expected 0 or more, got '-1'"),
    (["--settle", "nan"], "--settle", "expected 0 or more, got 'nan'"),
    (["--folder", "{file}"], "--folder", "not a folder; give an existing folder"),
]


@pytest.fixture(scope="module")
def script():
    return load_script(SCRIPT)


@pytest.mark.every_case
@pytest.mark.parametrize(("argv", "flag", "message"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_refused(script, tmp_path, capsys, argv, flag, message):
    (tmp_path / "file").write_text("")
    argv = [a.replace("{file}", str(tmp_path / "file")) for a in argv]
    assert_cli_refused(script.parse_args, argv, flag, message, capsys)


def test_a_run_of_the_flags_parses(script, tmp_path):
    args = script.parse_args(["--gib", "0.5", "--per-file", "4", "--repeats", "3",
                              "--settle", "5", "--folder", str(tmp_path)])
    assert (args.gib, args.per_file, args.repeats, args.settle) == (0.5, 4, 3, 5.0)
    assert args.folder == str(tmp_path)


OPTIMIZER_STEP = SCRIPT.parent / "optimizer_step.py"


@pytest.mark.every_case
@pytest.mark.parametrize("flag", ["--n", "--d", "--hidden", "--rounds"])
@pytest.mark.parametrize("value", ["0", "-3", "2.5"])
def test_optimizer_step_sizes_are_positive_integers(tmp_path, capsys, flag, value):
    script = load_script(OPTIMIZER_STEP)  # (imports JAX and optax; the parser runs first)
    assert_cli_refused(script.parse_args, [flag, value], flag,
                       f"expected a positive integer, got {value!r}", capsys)


TPU_DECODE_HLO = SCRIPT.parent / "tpu_decode_hlo.py"
OFFLOAD_MEMORY = SCRIPT.parent / "offload_memory.py"
TPU_TRAIN = SCRIPT.parent / "tpu_train.py"
AUTOSTACK_COMPILE = SCRIPT.parent / "autostack_compile.py"
TRACE_DEPTH = SCRIPT.parent / "trace_depth.py"
TPU_GENERATE = SCRIPT.parent / "tpu_generate.py"

#: (script, argv, the flag the message names, a part of the message): the TPU-compiled tables'
#: flags, refused by the parser before JAX or libtpu is imported.
TPU_TABLE_CASES = [
    (TPU_DECODE_HLO, ["--n", "0"], "--n", "expected a positive integer, got '0'"),
    (TPU_DECODE_HLO, ["--heads", "two"], "--heads", "expected a positive integer, got 'two'"),
    (TPU_DECODE_HLO, ["--shapes", "512:1024"], "--shapes",
     "expected D:T:B triples of positive integers, comma-separated (e.g. 512:1024:8), got "
     "'512:1024'"),
    (TPU_DECODE_HLO, ["--shapes", "512:0:8"], "--shapes", "got '512:0:8'"),
    (TPU_DECODE_HLO, ["--dtypes", "float32,float16"], "--dtypes",
     "expected float32 and/or bfloat16, comma-separated, got 'float16'"),
    (TPU_DECODE_HLO, ["--heads", "3", "--shapes", "512:64:1"], "--heads",
     "3 heads do not divide D=512 of --shapes"),
    (TPU_DECODE_HLO, ["--time", "-1"], "--time", "expected an integer of 0 or more, got '-1'"),
    (TPU_DECODE_HLO, ["--time", "2.5"], "--time", "expected an integer of 0 or more, got '2.5'"),
    (TPU_DECODE_HLO, ["--profile", "/tmp/p"], "--profile",
     "traces the timed rounds, so it needs --time R (R >= 1)"),
    (TPU_GENERATE, ["--tokens", "0"], "--tokens", "expected a positive integer, got '0'"),
    (TPU_GENERATE, ["--shapes", "512:64:1", "--tokens", "32", "--time", "1"], "--tokens",
     "2 calls of 32 tokens run past the cache's 64 positions of --shapes; fewer tokens or calls"),
    (TPU_GENERATE, ["--heads", "3", "--shapes", "512:64:1"], "--heads",
     "3 heads do not divide D=512 of --shapes"),
    (TPU_GENERATE, ["--variants", "loop,nnx"], "--variants",
     "'nnx' matches no variant; the variants are: loop, Stacked.decode, stackwise (scanned), "
     "to_serving in the jit"),
    (TPU_GENERATE, ["--dtypes", "int8"], "--dtypes",
     "expected float32 and/or bfloat16, comma-separated, got 'int8'"),
    (OFFLOAD_MEMORY, ["--shapes", "24:1024:x"], "--shapes",
     "expected n:d:batch triples of positive integers"),
    *((TPU_TRAIN, [flag, value], flag, f"expected a positive integer, got {value!r}")
      for flag in ("--d", "--heads", "--hidden", "--n", "--seq", "--batch", "--rounds",
                   "--compiles", "--loop-compiles")
      for value in ("0", "-1", "1.5")),
    (TPU_TRAIN, ["--heads", "3"], "--heads", "3 heads do not divide --d 1024"),
    (TPU_TRAIN, ["--tiny", "--d", "33"], "--heads", "2 heads do not divide --d 33"),
    (TPU_TRAIN, ["--profile", str(TPU_TRAIN)], "--profile",
     f"{str(TPU_TRAIN)!r} is a file; expected a folder (new or existing) for the traces"),
    (TPU_TRAIN, ["--peak", "0"], "--peak", "expected a positive TFLOP/s, got 0.0"),
    (TPU_TRAIN, ["--peak", "nan"], "--peak", "expected a positive TFLOP/s, got nan"),
    (TPU_TRAIN, ["--variants", "nnx"], "--variants",
     "'nnx' matches no row; the rows are: loop, remat off; stackwise, remat off"),
    (TPU_TRAIN, ["--variants", ".Stack", "--remat", "layer"], "--remat",
     "'layer' is not a comma-separated list of off, dots, full"),
    (TPU_TRAIN, ["--variants", "nnx", "--remat", "dots"], "--variants",
     "'nnx' matches no row at --remat 'dots'; the rows are: loop, remat off;"),
    *((AUTOSTACK_COMPILE, [flag, value], flag, f"expected a positive integer, got {value!r}")
      for flag in ("--n", "--pairs", "--loop-seconds") for value in ("0", "-1", "1.5")),
    (AUTOSTACK_COMPILE, ["--loop-compiles", "-1"], "--loop-compiles",
     "expected an integer of 0 or more, got '-1'"),
    (AUTOSTACK_COMPILE, ["--blocks", "mlp,decode"], "--blocks",
     "expected blocks among transformer, mlp, got 'mlp,decode'"),
    (AUTOSTACK_COMPILE, ["--blocks", ","], "--blocks",
     "expected blocks among transformer, mlp, got ','"),
    *((TRACE_DEPTH, ["--offsets", value], "--offsets",
       f"expected comma-separated integers of 0 or more, got {value!r}")
      for value in ("0,-4", "two", "0,,8", "1.5")),
    *((TRACE_DEPTH, ["--rounds", value], "--rounds", f"expected a positive integer, got {value!r}")
      for value in ("0", "x")),
]


@pytest.mark.every_case
@pytest.mark.parametrize(("path", "argv", "flag", "message"), TPU_TABLE_CASES,
                         ids=[f"{c[0].stem} {' '.join(c[1])}" for c in TPU_TABLE_CASES])
def test_tpu_tables_refuse(path, capsys, monkeypatch, argv, flag, message):
    monkeypatch.syspath_prepend(str(path.parent))  # (offload_memory.py imports its sibling)
    assert_cli_refused(load_script(path).parse_args, argv, flag, message, capsys)


def test_tpu_tables_parse_their_flags(monkeypatch):
    monkeypatch.syspath_prepend(str(TPU_DECODE_HLO.parent))
    args = load_script(TPU_DECODE_HLO).parse_args(
        ["--n", "48", "--shapes", "256:512:8,1024:4096:1", "--heads", "4", "--dtypes", "bfloat16"])
    assert (args.n, args.shapes, args.heads, args.dtypes) == (
        48, [(256, 512, 8), (1024, 4096, 1)], 4, ["bfloat16"])
    assert load_script(OFFLOAD_MEMORY).parse_args(["--shapes", "2:8:4"]).shapes == [(2, 8, 4)]


MULTI_LORA_DECODE = SCRIPT.parent / "multi_lora_decode.py"


@pytest.mark.parametrize("flag", ["--n", "--d", "--batch", "--adapters", "--rank", "--cache",
                                  "--rounds"])
@pytest.mark.parametrize("value", ["0", "-3", "2.5"])
def test_multi_lora_decode_sizes_are_positive_integers(capsys, monkeypatch, flag, value):
    monkeypatch.syspath_prepend(str(MULTI_LORA_DECODE.parent))  # (it imports its sibling)
    script = load_script(MULTI_LORA_DECODE)  # (imports JAX; the parser runs first)
    assert_cli_refused(script.parse_args, [flag, value], flag,
                       f"expected a positive integer, got '{value}'", capsys)
