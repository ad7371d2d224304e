"""Smoke tests of examples/transformer_lm.py: a few training steps, a checkpoint round trip,
the unstacked Python loop and KV-cached decoding against the full forward, a short sample; for
each framework.

Each run is a subprocess (a fresh JAX, so it can compile at a low XLA optimisation level: the
runs are dominated by compile time) with the suite's strict settings: rank promotion raises and
warnings are errors.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
TINY = "--steps 3 --layers 2 --d-model 32 --heads 2 --seq-len 16 --batch 2 --sample-len 12"
#: Cached decoding and the unstacked loop compute the same logits in another order.
LOGITS_ATOL = 1e-4

# Runs the example's `main` and prints what it returned as the last line, as JSON.
DRIVER = """
import json, sys
sys.path.insert(0, sys.argv[1])
import transformer_lm
results = [transformer_lm.main(argv.split()) for argv in sys.argv[2:]]
print(json.dumps(results))
"""


def run_example(*argvs: str) -> list[dict]:
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        JAX_NUMPY_RANK_PROMOTION="raise",
        XLA_FLAGS="--xla_backend_optimization_level=0",
    )
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-c", DRIVER, str(EXAMPLES), *argvs],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    output = f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0, f"the example failed:\n{output}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def load_example():
    """The example as a module, for its pure helpers."""
    spec = importlib.util.spec_from_file_location("transformer_lm", EXAMPLES / "transformer_lm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # (it puts examples/ on sys.path, for lm_models)
    return module


def check_run(result: dict, framework: str) -> None:
    assert result["framework"] == framework
    assert [step for step, _ in result["losses"]] == [3]
    assert all(np.isfinite(loss) for _, loss in result["losses"])
    assert len(result["val_loss"]) == 4  # before training and after each step
    # The stacked params as a Python loop over unstacked layers give the same logits...
    assert result["loop_diff"] <= LOGITS_ATOL
    # ...and so does decoding token by token from the per-layer KV cache.
    assert result["cache_diff"] <= LOGITS_ATOL
    assert result["sample"].startswith("\n") and len(result["sample"]) == 1 + 12


@pytest.mark.parametrize("framework", ["haiku", "flax", "nnx"])
def test_adapter_frameworks(framework, tmp_path):
    pytest.importorskip(f"stackwise.{framework}")
    ckpt = tmp_path / "lm.npz"
    (result,) = run_example(f"--framework {framework} {TINY} --quiet --checkpoint {ckpt}")
    check_run(result, framework)
    assert ckpt.exists()


def test_jax_train_checkpoint_restore(tmp_path):
    ckpt = tmp_path / "lm.npz"
    common = f"--framework jax {TINY} --quiet --checkpoint {ckpt}"
    trained, restored = run_example(common, common + " --restore")
    check_run(trained, "jax")
    # Restoring the checkpoint gives back the very same model: the same sample, same logits.
    assert "losses" not in restored
    assert restored["sample"] == trained["sample"]
    assert restored["loop_diff"] <= LOGITS_ATOL and restored["cache_diff"] <= LOGITS_ATOL


def test_checkpoint_format_and_errors(tmp_path):
    lm = load_example()
    w = np.arange(6, dtype=np.float32).reshape(3, 2)
    params = {"blocks": {"w": w}, "head": np.ones(2, np.float32)}
    path = tmp_path / "ckpt.npz"
    lm.save_checkpoint(path, params, {"framework": "jax"})
    with np.load(path) as f:  # plain numpy reads it: one array per leaf, named by its path
        assert sorted(f.files) == ["['blocks']['w']", "['head']", "__meta__"]
        np.testing.assert_array_equal(f["['blocks']['w']"], params["blocks"]["w"])
    assert lm.read_meta(path) == {"framework": "jax"}
    restored = lm.load_checkpoint(path, params)
    np.testing.assert_array_equal(restored["blocks"]["w"], params["blocks"]["w"])

    deeper = {"blocks": {"w": np.zeros((4, 2), np.float32)}, "head": np.ones(2, np.float32)}
    with pytest.raises(ValueError, match=r"\['blocks'\]\['w'\] has shape \(3, 2\).*--layers"):
        lm.load_checkpoint(path, deeper)
    with pytest.raises(ValueError, match=r"no array \['other'\]"):
        lm.load_checkpoint(path, {"other": np.zeros(2, np.float32)})


def test_bad_prompt_and_framework():
    lm = load_example()
    with pytest.raises(ValueError, match="not in the training text"):
        lm.encode("abc", "abz")
    with pytest.raises(SystemExit):  # argparse rejects it with a usage message
        lm.parse_args(["--framework", "torch"])
