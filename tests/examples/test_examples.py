"""Tests of the example, examples/transformer_lm.py: its package examples/lm/.

Smoke runs (a few training steps of a tiny model, a checkpoint round trip, the Python-loop layout
and KV-cached decoding against the full forward, a short sample) for each framework; resuming
after Ctrl-C against an uninterrupted run; the checkpoint errors; the five frameworks' models
being one model, with the default blocks and with a pattern of local and global blocks.

Each run is a subprocess (a fresh JAX, so it can compile at a low XLA optimisation level: the
runs are dominated by compile time) with the suite's strict settings: rank promotion raises and
warnings are errors.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import os
import pathlib
import re
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _scripts import load_example

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
TINY = "--layers 2 --d-model 32 --heads 2 --seq-len 16 --batch 2 --sample-len 12 --quiet"
#: Cached decoding and the unstacked loop compute the same logits in another order.
LOGITS_ATOL = 1e-4
#: The five frameworks compute the same function with differently ordered float32 ops.
FRAMEWORKS_ATOL = 1e-4


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    """The example runs' environment (with the suite's XLA_FLAGS, tests/conftest.py). They share
    a compilation cache: most of their programs are the same tiny model's, and compiling
    dominates them. The run's own cache where it has one (tests/conftest.py: on the CPU), so
    that these runs, test_lora_example.py's and the rest of the run's tests read what another
    compiled first; else a folder of this module's."""
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(
        tmp_path_factory.mktemp("jax_cache"))
    return dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        JAX_NUMPY_RANK_PROMOTION="raise",
        JAX_COMPILATION_CACHE_DIR=cache,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )


# Runs the example's `main` for each [argv, ctrl_c_at] in argv[2] (JSON) and prints the results
# as JSON on the last line. ctrl_c_at: send SIGINT (what Ctrl-C sends) to itself when the log
# line of that step is printed, else null.
DRIVER = """
import json, os, signal, sys
sys.path.insert(0, sys.argv[1])
from lm import cli
results = []
for argv, ctrl_c_at in json.loads(sys.argv[2]):
    def log(line, at=ctrl_c_at):
        print(line)
        if at is not None and line.startswith(f"step {at:5d} "):
            os.kill(os.getpid(), signal.SIGINT)
    results.append(cli.main(argv.split(), log=log))
print(json.dumps(results))
"""


def run_example(env: dict, *runs: str | tuple[str, int]) -> list[dict]:
    """The results of ``main(argv)`` for each run: ``argv``, or ``(argv, ctrl_c_at_step)``."""
    runs = [(r, None) if isinstance(r, str) else r for r in runs]
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-c", DRIVER, str(EXAMPLES), json.dumps(runs)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    output = f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0, f"the example failed:\n{output}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def checkpoint_arrays(path) -> dict:
    """The arrays of the last step of the orbax checkpoint folder ``path``, by their path."""
    import orbax.checkpoint as ocp

    step = max(int(p.name) for p in pathlib.Path(path).iterdir() if p.name.isdigit())
    with ocp.StandardCheckpointer() as checkpointer:
        state = checkpointer.restore(pathlib.Path(path).resolve() / str(step) / "state")
    return {jax.tree_util.keystr(p): np.asarray(a)
            for p, a in jax.tree_util.tree_leaves_with_path(state)}


def safetensors_shapes(folder) -> dict:
    """The tensors' names and shapes in the safetensors files of ``folder``."""
    from safetensors import safe_open

    out = {}
    for file in sorted(pathlib.Path(folder).glob("*.safetensors")):
        with safe_open(str(file), "numpy") as f:
            out.update({name: list(f.get_slice(name).get_shape()) for name in f.keys()})
    return out


def check_run(result: dict, framework: str, steps: int) -> None:
    assert result["framework"] == framework
    assert [step for step, _ in result["losses"]][-1:] == [steps]
    assert all(np.isfinite(loss) for _, loss in result["losses"])
    assert [step for step, _ in result["val_loss"]] == list(range(steps + 1))
    assert result["val_bits_per_char"] == pytest.approx(result["val_loss"][-1][1] / math.log(2))
    # The stacked params in a Python loop's layout give the same logits...
    assert result["loop_diff"] <= LOGITS_ATOL
    # ...and so does decoding token by token from the per-layer KV cache.
    assert result["cache_diff"] <= LOGITS_ATOL
    # The pure-JAX model samples in the serving layout (per-layer buffers), checked the same.
    assert ("serving_diff" in result) == (framework == "jax")
    if framework == "jax":
        assert result["serving_diff"] <= LOGITS_ATOL
        assert all(v > 0 for v in result["decode_best_tokens_per_s"].values())
    assert result["prefill_tokens_per_s"] > 0 and result["decode_tokens_per_s"] > 0
    assert result["sample"].startswith("\n") and len(result["sample"]) == 1 + 12


ADAPTERS = ("haiku", "flax", "nnx", "equinox")


@pytest.fixture(scope="module")
def adapter_runs(tmp_path_factory, env) -> dict:
    """A smoke run of each installed adapter framework exporting per-layer safetensors, then
    sampling from each export, all in one process (one start-up of JAX and the frameworks):
    ``{framework: (result, checkpoint, export, loaded)}``."""
    tmp = tmp_path_factory.mktemp("adapters")
    installed = [f for f in ADAPTERS if importlib.util.find_spec(f"stackwise.{f}") is not None]
    installed = [f for f in installed if importlib.util.find_spec(
        {"haiku": "haiku", "nnx": "flax"}.get(f, f)) is not None]
    runs = [f"--framework {f} --steps 3 {TINY} --checkpoint {tmp / f} --export {tmp / f}_hf"
            for f in installed]
    runs += [f"--load-safetensors {tmp / f}_hf --sample-len 12 --quiet" for f in installed]
    results = run_example(env, *runs)
    n = len(installed)
    return {f: (r, tmp / f, tmp / f"{f}_hf", loaded)
            for f, r, loaded in zip(installed, results[:n], results[n:])}


@pytest.mark.slow
@pytest.mark.parametrize("framework", ADAPTERS)
def test_adapter_frameworks(framework, adapter_runs):
    if framework not in adapter_runs:
        pytest.skip(f"stackwise.{framework} or its framework is not installed")
    result, ckpt, export, loaded = adapter_runs[framework]
    check_run(result, framework, 3)
    assert load_example().checkpoints.read_meta(ckpt)["run"]["framework"] == framework
    # The export: the same Hugging Face-style checkpoint as the pure-JAX model's (names,
    # torch's (out, in) shapes), whatever the framework's own names and layouts; sampled from
    # (stackwise.load_checkpoint into the framework's params), the same model.
    shapes = safetensors_shapes(export)
    assert shapes["model.layers.1.self_attn.qkv_proj.weight"] == [96, 32]
    assert shapes["model.layers.0.mlp.down_proj.weight"] == [32, 128]
    assert shapes["model.layers.0.input_layernorm.bias"] == [32]
    assert shapes["lm_head.weight"][1] == 32 and len(shapes) == 5 + 2 * 10
    assert loaded["framework"] == framework and "losses" not in loaded
    assert loaded["sample"] == result["sample"]
    assert loaded["loop_diff"] <= LOGITS_ATOL and loaded["cache_diff"] <= LOGITS_ATOL


@pytest.fixture(scope="module")
def trained(tmp_path_factory, env) -> dict:
    """A tiny pure-JAX run saved to a checkpoint (every 2 steps, keeping 2), then --restore of
    it exporting per-layer safetensors, --resume, the same command again, and sampling from
    the export."""
    tmp = tmp_path_factory.mktemp("trained")
    ckpt, export = tmp / "lm", tmp / "hf"
    common = f"--steps 3 {TINY} --checkpoint {ckpt}"
    trained, restored, resumed, again, loaded, other = run_example(
        env,
        f"{common} --save-every 2 --keep 2",
        f"{common} --restore --export {export}",
        f"{common} --resume",
        common,
        f"--load-safetensors {export} --sample-len 12 --quiet",
        f"--load-safetensors {export} --framework equinox --sample-len 12 --quiet",
    )
    return {"ckpt": ckpt, "trained": trained, "restored": restored, "resumed": resumed,
            "again": again, "export": export, "loaded": loaded, "other": other}


@pytest.mark.slow
def test_pattern_trains_checkpoints_and_samples(tmp_path, env):
    ckpt, export = tmp_path / "lm", tmp_path / "hf"
    pattern = "--pattern local,local,global --window 4"
    result, loaded = run_example(
        env,
        f"--steps 3 {TINY} --layers 4 {pattern} --checkpoint {ckpt} --export {export}",
        f"--load-safetensors {export} --sample-len 12 --quiet",
    )
    check_run(result, "jax", 3)
    run = load_example().checkpoints.read_meta(ckpt)["run"]
    assert (run["pattern"], run["window"], run["layers"]) == ("local,local,global", 4, 4)
    arrays = checkpoint_arrays(ckpt)  # position p of the pattern holds layers p, p + 3: 2, 1, 1
    depths = [arrays[f"['params']['blocks'][{p}]['qkv']"].shape[0] for p in range(3)]
    assert depths == [2, 1, 1]
    # The export has the 4 layers under their own index, whatever their pattern position, and
    # gives back the same model: the same sample.
    shapes = safetensors_shapes(export)
    assert [shapes[f"model.layers.{i}.self_attn.qkv_proj.weight"] for i in range(4)] == [
        [96, 32]] * 4
    assert loaded["sample"] == result["sample"] and loaded["loop_diff"] <= LOGITS_ATOL


@pytest.mark.slow  # the `trained` fixture: five runs of the example, ~20 s
def test_jax_train_checkpoint_restore(trained):
    check_run(trained["trained"], "jax", 3)
    # Restoring the checkpoint gives back the very same model: the same sample, same logits.
    restored = trained["restored"]
    assert "losses" not in restored
    assert restored["sample"] == trained["trained"]["sample"]
    assert restored["loop_diff"] <= LOGITS_ATOL and restored["cache_diff"] <= LOGITS_ATOL
    # --resume of a finished run has nothing to train: it samples.
    resumed = trained["resumed"]
    assert "losses" not in resumed and resumed["sample"] == trained["trained"]["sample"]
    assert resumed["val_loss"] == trained["trained"]["val_loss"][-1:]
    # The same command again (the README's first, run twice) samples from the finished run.
    again = trained["again"]
    assert "losses" not in again and again["sample"] == trained["trained"]["sample"]
    # Saved every 2 steps and at the last, the last 2 kept.
    assert sorted(int(p.name) for p in trained["ckpt"].iterdir()) == [2, 3]
    # The export: per-layer safetensors under Hugging Face-style names, torch's (out, in)
    # layout, and the run; loaded back (stackwise.load_checkpoint), the same samples.
    shapes = safetensors_shapes(trained["export"])
    assert shapes["model.layers.1.self_attn.qkv_proj.weight"] == [96, 32]
    assert shapes["model.layers.0.mlp.down_proj.weight"] == [32, 128]
    assert shapes["lm_head.weight"][1] == 32 and shapes["model.norm.weight"] == [32]
    assert len(shapes) == 5 + 2 * 10  # embed, norm (2), head (2); 10 per layer
    assert restored["exported"][-1].endswith("transformer_lm.json")
    loaded = trained["loaded"]
    assert loaded["sample"] == trained["trained"]["sample"] and "losses" not in loaded
    assert loaded["loop_diff"] <= LOGITS_ATOL and loaded["cache_diff"] <= LOGITS_ATOL
    # Another framework's model reads the same export (one set of names for all five): the
    # Equinox model, which keeps torch's layout, samples what the pure-JAX model sampled.
    other = trained["other"]
    assert other["framework"] == "equinox" and other["sample"] == trained["trained"]["sample"]
    assert other["loop_diff"] <= LOGITS_ATOL and other["cache_diff"] <= LOGITS_ATOL


@pytest.mark.slow
def test_resume_after_ctrl_c_equals_an_uninterrupted_run(tmp_path, env):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    common = f"--steps 16 {TINY}"  # validates and saves every 2 steps
    # Ctrl-C as step 0's line is printed: the run stops after step 1 and saves there.
    full, interrupted, resumed = run_example(
        env,
        f"{common} --checkpoint {straight}",
        (f"{common} --checkpoint {stopped}", 0),
        f"{common} --checkpoint {stopped} --resume",
    )
    assert interrupted["stopped_at"] == 1 and "sample" not in interrupted
    assert [step for step, _ in resumed["val_loss"]] == [1, *range(2, 17, 2)]
    # Params, optimizer state, step and RNG were saved: the resumed run computes exactly what the
    # uninterrupted one did.
    assert resumed["val_loss"][1:] == full["val_loss"][1:]
    assert resumed["sample"] == full["sample"]
    a, b = checkpoint_arrays(straight), checkpoint_arrays(stopped)
    assert sorted(a) == sorted(b)
    assert any(name.startswith("['opt_state']") for name in a) and "['rng']" in a
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.slow
def test_ctrl_c_saves_and_exits_without_a_traceback(tmp_path, env):
    ckpt = tmp_path / "lm"
    cmd = [sys.executable, "-u", str(EXAMPLES / "transformer_lm.py"), "--steps", "1000000"]
    cmd += [*TINY.split(), "--checkpoint", str(ckpt)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in proc.stdout:  # Ctrl-C once training has started
            if line.startswith("step     0 "):
                proc.send_signal(signal.SIGINT)
                break
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    stopped = re.search(r"stopped at step (\d+) of 1000000: saved (\S+)\. .*--resume", out)
    assert stopped and pathlib.Path(stopped.group(2)) == ckpt, out
    assert load_example().checkpoints.read_meta(ckpt)["step"] == int(stopped.group(1))


def test_restore_without_a_checkpoint_says_to_train_first(tmp_path, capsys):
    missing = tmp_path / "none"
    # The command line's own function, in-process (the misuse catalogue, tests/misuse, has the
    # other refusals).
    assert load_example().cli.cli(["--restore", "--checkpoint", str(missing)]) == 2
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr
    assert f"error: --restore: there is no checkpoint at {missing}. Train first" in stderr


def test_default_checkpoint_is_in_examples_checkpoints():
    lm = load_example()
    assert lm.cli.parse_args([]).checkpoint == EXAMPLES / "checkpoints" / "lm_jax"
    assert lm.cli.parse_args(["--framework", "nnx"]).checkpoint.name == "lm_nnx"


@pytest.mark.slow  # the `trained` fixture: five runs of the example, ~20 s
@pytest.mark.parametrize(
    "flags, message",
    [
        # Training over another run's checkpoint: refused, naming what differs.
        # One line: what differs and the flag to pass.
        ("--steps 5", r"^\S+ holds another run \(step 3 of 3; --steps: 3 in the checkpoint vs 5 "
         r"here\): pass --overwrite to replace it, --checkpoint PATH [^\n]*$"),
        ("--steps 3 --layers 3", r"--layers: 2 in the checkpoint vs 3 here\): pass --overwrite"),
        # Restoring or resuming with a flag that disagrees with the checkpoint: named.
        ("--restore --layers 4", r"another run than the flags ask for \(--layers: 2 in the"),
        ("--resume --steps 9", r"\(--steps: 3 in the checkpoint vs 9 here\): leave these"),
        ("--restore --framework flax", r"saved by the jax model: pass --framework jax"),
        ("--restore --pattern local,global", r"--pattern: global in the checkpoint vs local,gl"),
        ("--resume --window 8", r"\(--window: 16 in the checkpoint vs 8 here\)"),
        # The optimizer is part of the run: its state is in the checkpoint.
        ("--steps 3 --optimizer lamb",
         r"\(step 3 of 3; --optimizer: adamw in the checkpoint vs lamb here\)"),
        ("--resume --optimizer muon", r"\(--optimizer: adamw in the checkpoint vs muon here\)"),
    ],
)
def test_checkpoint_errors_name_what_to_do(trained, flags, message):
    lm = load_example()
    before = files_of(trained["ckpt"])
    tiny = TINY.replace("--layers 2 ", "") if "--layers" in flags else TINY
    argv = f"{tiny} {flags} --checkpoint {trained['ckpt']}".split()
    with pytest.raises(lm.cli.CheckpointError, match=message) as error:
        lm.cli.main(argv)
    assert "\n" not in str(error.value)  # one line
    assert files_of(trained["ckpt"]) == before  # never overwritten


def files_of(folder: pathlib.Path) -> dict:
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow  # the `trained` fixture: five runs of the example, ~20 s
def test_restore_takes_the_flags_left_out_from_the_checkpoint(trained):
    lm = load_example()
    args = lm.cli.parse_args(["--restore", "--checkpoint", str(trained["ckpt"])])
    lm.run.settle_args(args, lm.checkpoints.read_meta(trained["ckpt"]), lm.cli.MODEL_FIELDS)
    assert (args.layers, args.d_model, args.heads, args.seq_len) == (2, 32, 2, 16)
    assert (args.pattern, args.window) == ("global", 16)


@pytest.mark.slow  # the `trained` fixture: five runs of the example, ~20 s
def test_a_checkpoint_from_before_patterns_and_optimizers_is_global_adamw(trained, tmp_path):
    lm = load_example()
    meta = lm.checkpoints.read_meta(trained["ckpt"])
    for field in ("pattern", "window", "optimizer"):
        del meta["run"][field]
    old = tmp_path / "old"
    lm.checkpoints.save_checkpoint(old, {"x": np.zeros(1)}, meta)
    assert lm.checkpoints.read_meta(old)["run"] == lm.checkpoints.read_meta(trained["ckpt"])["run"]


def test_checkpoint_format_and_errors(tmp_path):
    lm = load_example()
    w = np.arange(6, dtype=np.float32).reshape(3, 2)
    params = {"blocks": {"w": w}, "head": np.ones(2, np.float32)}
    path = tmp_path / "ckpt"
    meta = {"format": lm.cli.FORMAT, "run": {}, "step": 0, "val_loss": 1.0, "chars": "ab"}
    for step in range(5):  # the last 3 steps kept (--keep)
        lm.checkpoints.save_checkpoint(path, {**params, "head": params["head"] * step},
                                       {**meta, "step": step})
    assert sorted(p.name for p in path.iterdir()) == ["2", "3", "4"]
    arrays = checkpoint_arrays(path)  # orbax reads it: one array per leaf, by its path
    assert sorted(arrays) == ["['blocks']['w']", "['head']"]
    np.testing.assert_array_equal(arrays["['head']"], params["head"] * 4)
    assert lm.checkpoints.read_meta(path) == {**meta, "step": 4, "run": lm.cli.OLD_RUN_FIELDS}
    assert {"meta", "state"} <= {p.name for p in (path / "4").iterdir()}  # the two items
    restored = lm.checkpoints.load_checkpoint(path, jax.eval_shape(lambda: params))
    np.testing.assert_array_equal(restored["blocks"]["w"], params["blocks"]["w"])

    deeper = {"blocks": {"w": np.zeros((4, 2), np.float32)}, "head": np.ones(2, np.float32)}
    shallower = r"ckpt/4: blocks/w is float32\[3, 2\], the model expects float32\[4, 2\].*--layers"
    with pytest.raises(lm.cli.CheckpointError, match=shallower):
        lm.checkpoints.load_checkpoint(path, deeper)
    half = {"blocks": {"w": np.zeros((3, 2), jnp.bfloat16)}, "head": np.ones(2, np.float32)}
    with pytest.raises(lm.cli.CheckpointError,
                       match=r"float32\[3, 2\], the model expects bfloat16"):
        lm.checkpoints.load_checkpoint(path, half)  # (orbax alone would cast it)
    with pytest.raises(lm.cli.CheckpointError, match=r"no array other"):
        lm.checkpoints.load_checkpoint(path, {**params, "other": np.zeros(2, np.float32)})
    with pytest.raises(lm.cli.CheckpointError, match=r"has an array head this model lacks"):
        lm.checkpoints.load_checkpoint(path, {"blocks": params["blocks"]})
    lm.checkpoints.clear_checkpoint(path)  # (--overwrite, at its first save)
    assert list(path.iterdir()) == []


def test_bad_prompt_and_framework():
    lm = load_example()
    with pytest.raises(ValueError, match="not in the training text"):
        lm.data.encode("abc", "abz")
    with pytest.raises(SystemExit):  # argparse rejects it with a usage message
        lm.cli.parse_args(["--framework", "torch"])
    with pytest.raises(SystemExit):  # one of --resume, --restore, --overwrite
        lm.cli.parse_args(["--resume", "--overwrite"])
    with pytest.raises(SystemExit):
        lm.cli.parse_args(["--steps", "0"])
    with pytest.raises(SystemExit):
        lm.cli.parse_args(["--text", "no/such/file.txt"])
    with pytest.raises(lm.cli.UsageError,
                       match=r"--d-model 36 must be a multiple of 2 \* --heads = 8"):
        lm.cli.main(["--d-model", "36", "--heads", "4", "--checkpoint", "unused"])


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--pattern local,lokal", r"--pattern local,lokal: 'lokal' is not a kind of block"),
        ("--pattern local,", r"--pattern local,: '' is not a kind of block"),
        ("--pattern local --window 65", r"--window 65 is longer than --seq-len 64"),
        ("--pattern local,global --layers 1", r"--layers 1 is fewer than the 2 entries"),
    ],
)
def test_bad_pattern(flags, message):
    lm = load_example()
    with pytest.raises(lm.cli.UsageError, match=message):
        lm.cli.main([*flags.split(), "--checkpoint", "unused"])
    # A global-only model does not use the window: it is not checked against --seq-len.
    args = lm.cli.parse_args(["--window", "99"])
    lm.run.settle_args(args, None, ())
    assert lm.run.parse_pattern(args) == ("global",)


# --------------------------------------------------------------------------
# The five frameworks' models are one model, with a pattern of local and global blocks too.

#: The pattern the tests use: n = 5 is not a multiple of its 3, and a window of 3 of the 12
#: tokens makes the local blocks' mask matter in training and in decoding past the prefill.
PATTERN = {"pattern": ("local", "local", "global"), "layers": 5, "window": 3, "seq_len": 12}
#: Each framework's names of the pattern's positions, as their index.
POSITIONS = {"local": 0, "local_1": 1, "global": 2, "Local_0": 0, "Local_1": 1, "Global_0": 2}


def canonical_name(path) -> str:
    """A leaf's name in one naming for all frameworks: ``blocks/qkv``, ``blocks/up_bias``,
    with a pattern ``blocks/0/qkv`` (position 0)..."""
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    name = re.sub(r"^lm/", "", name)  # Haiku's module names
    name = re.sub(r"^blocks/(block|layers)/", "blocks/", name)  # Haiku's, NNX's, Equinox's Stack
    position = re.match(r"^blocks/([A-Za-z]+(?:_\d+)?)/", name)  # Haiku's, linen's positions
    if position and position.group(1) in POSITIONS:
        name = name.replace(position.group(1), str(POSITIONS[position.group(1)]), 1)
    name = re.sub(r"(ln\d|ln_f)/weight$", r"\1/scale", name)  # Equinox's LayerNorm
    name = re.sub(r"/(kernel|w|embedding|embeddings|weight)$", "", name)
    name = re.sub(r"(ln\d|ln_f)/offset$", r"\1/bias", name)
    return re.sub(r"^((?:blocks/(?:\d+/)?)?(?:qkv|out|up|down|head))/(bias|b)$", r"\1_bias", name)


def canonical_leaf(framework: str, path, leaf):
    """A leaf in the pure-JAX model's layout: Equinox's Linear keeps its weight as
    ``[out, in]``, the others as ``[in, out]`` (the transpose is its own inverse)."""
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    linear = re.search(r"(qkv|out|up|down|head)/weight$", name)
    return jnp.swapaxes(leaf, -1, -2) if framework == "equinox" and linear else leaf


def canonical(framework: str, params) -> dict[str, jax.Array]:
    leaves = jax.tree_util.tree_leaves_with_path(params)
    out = {canonical_name(p): canonical_leaf(framework, p, leaf) for p, leaf in leaves}
    assert len(out) == len(leaves), "two leaves with one canonical name"
    return out


def same_model_report(check_loop_and_cache: bool = False, **sizes) -> dict:
    """For each framework: its params' canonical names and shapes, and the largest difference
    between its logits and the pure-JAX model's when given the pure-JAX model's params; if
    asked, the stacked params in the Python loop's layout, and KV-cached decoding (a prefill,
    then token by token), against the full forward (the smoke runs check those for the
    default model)."""
    lm_models = load_example().model

    config = lm_models.Config(**{"vocab": 11, "layers": 3, "d_model": 16, "heads": 2, **sizes})
    tokens = jax.random.randint(jax.random.key(1), (2, config.seq_len), 0, config.vocab)
    positions = jnp.arange(config.seq_len)
    prefill = config.seq_len // 2 - 1
    report, reference = {}, None
    for framework in lm_models.FRAMEWORKS:  # "jax" first
        lm = lm_models.build(framework, config)
        # Only the pure-JAX model's init runs (its values are every framework's): the others'
        # params are their names and shapes (their inits run in the smoke runs and the
        # adapters' tests).
        params = jax.eval_shape(lm.init, jax.random.key(0))
        if reference is None:
            values = jax.jit(lm.init)(jax.random.key(0))
            reference = canonical(framework, values)
            expected, _ = jax.jit(lm.apply)(values, tokens, positions)
        same = jax.tree_util.tree_map_with_path(
            lambda path, _, ref=reference, fw=framework: canonical_leaf(
                fw, path, ref[canonical_name(path)]
            ),
            params,
        )
        forward = jax.jit(lm.apply)
        logits, _ = forward(same, tokens, positions)
        shapes = jax.eval_shape(functools.partial(canonical, framework), params)
        report[framework] = {
            "shapes": {name: list(leaf.shape) for name, leaf in shapes.items()},
            "logits_diff": float(jnp.abs(logits - expected).max()),
        }
        if check_loop_and_cache:
            loop = jax.jit(lm.loop_apply)(lm.to_loop(same), tokens)
            steps, cache = [], lm.init_cache(2)
            tokens_at = [slice(i, i + 1) for i in range(prefill, config.seq_len)]
            for at in [slice(0, prefill), *tokens_at]:  # a prefill, then one token at a time
                step_logits, cache = forward(same, tokens[:, at], positions[at], cache)
                steps.append(step_logits)
            report[framework]["loop_diff"] = float(jnp.abs(loop - logits).max())
            cache_diff = jnp.abs(jnp.concatenate(steps, axis=1) - logits).max()
            report[framework]["cache_diff"] = float(cache_diff)
    if config.pattern != ("global",):  # the same params with global blocks only
        lm = lm_models.build("jax", dataclasses.replace(config, pattern=("global",) * 3))
        logits, _ = jax.jit(lm.apply)(params_of_jax(reference, lm), tokens, positions)
        report["all_global_diff"] = float(jnp.abs(logits - expected).max())
    return report


def params_of_jax(reference: dict, lm) -> dict:
    """The pure-JAX model ``lm``'s params with the values of ``reference`` (canonical names)."""
    template = jax.eval_shape(lm.init, jax.random.key(0))
    return jax.tree_util.tree_map_with_path(lambda p, _: reference[canonical_name(p)], template)


@pytest.fixture(scope="module")
def reports(env) -> dict:
    """``same_model_report`` of the default model and of the :data:`PATTERN` model."""
    pytest.importorskip("stackwise.haiku")
    pytest.importorskip("stackwise.flax")
    pytest.importorskip("stackwise.equinox")
    code = (
        "import json, sys; sys.path[:0] = sys.argv[1:3]; import test_examples as t; "
        "print(json.dumps({'default': t.same_model_report(seq_len=8), "
        "'pattern': t.same_model_report(True, **t.PATTERN)}))"
    )
    here = str(pathlib.Path(__file__).parent)  # (and tests/, for _scripts)
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-c", code, here, str(pathlib.Path(here).parent)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("model", ["default", "pattern"])
def test_the_five_frameworks_are_one_model(reports, model):
    report = {k: v for k, v in reports[model].items() if k != "all_global_diff"}
    assert list(report) == ["jax", "haiku", "flax", "nnx", "equinox"]
    for framework, r in report.items():
        # The same params (names and shapes, so the same count) in every framework...
        assert r["shapes"] == report["jax"]["shapes"], framework
        # ...and, given the same values, the same logits.
        assert r["logits_diff"] <= FRAMEWORKS_ATOL, framework
    if model == "pattern":  # 3 positions: 2 layers, 2, 1
        assert report["jax"]["shapes"]["blocks/0/qkv"][0] == 2
        assert report["jax"]["shapes"]["blocks/2/qkv"][0] == 1


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["jax", "haiku", "flax", "nnx", "equinox"])
def test_pattern_stack_equals_loop_and_cached_decoding(reports, framework):
    r = reports["pattern"][framework]
    # The stacked params in a Python loop's layout (the framework's conversion) give the same
    # logits, and so does decoding from the per-layer KV cache, past the local blocks' window.
    assert r["loop_diff"] <= LOGITS_ATOL
    assert r["cache_diff"] <= LOGITS_ATOL


@pytest.mark.slow
def test_local_blocks_see_only_their_window(reports):
    lm_models = load_example().model

    # The mask: a query at t sees the keys at t - window + 1 .. t.
    window, length = 3, 7
    keys = jnp.eye(length)[None, :, None, :]  # key/value j: the one-hot vector of j
    pos = jnp.arange(length)
    seen = lm_models.attention(jnp.zeros_like(keys), keys, keys, pos, pos, window)[0, :, 0] > 0
    t, j = np.arange(length)[:, None], np.arange(length)[None, :]
    np.testing.assert_array_equal(np.asarray(seen), (j <= t) & (t - j < window))
    # The model uses it: the same params with global blocks only give other logits.
    assert reports["pattern"]["all_global_diff"] > 100 * FRAMEWORKS_ATOL


def test_the_command_line_offers_what_the_example_has():
    # The command line names its choices without importing JAX; they are the models' and
    # the optimizers' own, and the run time it announces is the docstring's figure.
    lm = load_example()

    assert lm.cli.FRAMEWORKS == lm.model.FRAMEWORKS
    assert lm.cli.OPTIMIZER_NAMES == tuple(lm.train.OPTIMIZERS)
    assert f"{lm.cli.DEFAULT_RUN_S} s on 2 idle CPU cores" in " ".join(lm.__doc__.split())


def test_the_run_is_announced_with_its_length_before_it_starts():
    lm = load_example()
    args = lm.cli.parse_args([])
    lm.run.settle_args(args, None, ())
    assert lm.run.announce(args, 0) == (
        f"training 1600 steps (1 to 1600; --steps N to change): {lm.cli.DEFAULT_RUN_S} s from "
        "start to sample on 2 idle CPU cores, more on a busy machine; the estimate from this "
        "machine's steps follows the compile")
    args.steps = 200  # another run: no measured figure, the estimate comes from the steps
    assert lm.run.announce(args, 50) == (
        "training 150 steps (51 to 200; --steps N to change): the estimate from this "
        "machine's steps follows the compile")


def test_the_estimate_comes_from_the_steps_after_the_first():
    lm = load_example()
    estimate = lm.train.Estimate(start=4, steps=100)  # the first step, 5, starts the clock
    lines = [estimate.after(i, jnp.zeros(())) for i in range(5, 100)]
    assert [i for i, line in zip(range(5, 100), lines) if line] == [5 + lm.train.Estimate.WINDOW]
    assert re.fullmatch(r"\d+ ms a step: about \d+ s for the 85 steps left, plus validations "
                        r"and saves", lines[lm.train.Estimate.WINDOW])
    assert not any(lm.train.Estimate(0, 20).after(i, 0.0) for i in range(1, 21))  # too short


def test_a_relative_checkpoint_path_is_made_absolute(tmp_path, monkeypatch):
    # orbax and tensorstore's `file://` take no path relative to the cwd: a relative
    # --checkpoint once made every restore report the checkpoint as damaged.
    monkeypatch.chdir(tmp_path)
    args = load_example().cli.parse_args(["--checkpoint", "ck"])
    assert args.checkpoint == tmp_path / "ck" and args.checkpoint.is_absolute()
