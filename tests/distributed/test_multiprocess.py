"""A real multi-process run: `examples/multiprocess.py` on 8 CPU devices owned by 1, 2 or 4
processes gives the same loss, gradients and SGD step, and those of a plain Python loop.

The three runs (7 processes: jax.distributed on 127.0.0.1, gloo collectives between them) start
at once, share the cores and are killed if they outlast ``TIMEOUT_S``; a failed process's log is
in the failure message. The model uses FSDP over "data", tensor parallelism over "model" and a
pipeline over "stage"; with 2 processes the "data" axis crosses them, with 4 "data" and "stage"
do, so the FSDP gathers, the gradient reductions and the pipeline's ppermute go between
processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import _multiprocess
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerance import check, compare, reassociation_bound

import stackwise

pytestmark = pytest.mark.slow  # 7 processes, each importing JAX and compiling the step

EXAMPLE = _multiprocess.EXAMPLE

# Each array within *_BOUND * eps * (its largest magnitude) of the reference (tests/_tolerance.py).
#: Across processes (gloo) against one process's 8 devices: the same program, but for the order
#: of the cross-device sums (of 8 devices' parts) and what follows from them:
#: 6 * sqrt(8) = 17 eps. Measured on an AMD EPYC VM: 0.84 eps (one float32 ulp of a gradient).
PROCESSES_BOUND = reassociation_bound(depth=0, width=1, summed=8)
#: The sharded step against a plain loop on one device: 8 blocks, each a chain of sums (a norm's
#: of D, q/k/v's of D, the scores' of HEAD_DIM, the softmax's and weights @ v's of SEQ, o's of
#: D, a norm's and up's of D, down's of HIDDEN), the grads summing BATCH * SEQ = 64 tokens:
#: 6 * (2 * 8 * 34.1 + sqrt(64)) = 3,326 eps, 4e-4 of the scale (the absolute 2e-5 it replaces
#: was 9,600 eps of the smallest grads, of scale 0.0175). Measured on an AMD EPYC VM: 8 eps. A
#: relative error of 1e-3 is 8,389 eps.
LOOP_BOUND = reassociation_bound(depth=8, width=(16, 16, 8, 8, 8, 16, 16, 16, 32), summed=64)
#: The same random bits, scaled by 1/sqrt(fan_in) in another compiled program: normal's inverse
#: error function, a polynomial of 9 terms in Horner's form, with or without fused multiply-adds:
#: 6 * sqrt(9) = 18 eps. Measured on an AMD EPYC VM: 1.5 eps.
INIT_BOUND = reassociation_bound(depth=0, width=1, summed=9)
#: All three runs together, from their start (a loaded 2-core machine takes ~3x an idle one).
TIMEOUT_S = 400
RUNS = (1, 2, 4)


@pytest.fixture(scope="module")
def example():
    return _multiprocess.example()


_env = _multiprocess.env


@pytest.fixture(scope="module")
def runs(example, tmp_path_factory):
    """``{processes: [(view, arrays) of each process]}`` of the three runs, and the launcher's
    output. The 4-process run is the documented command (``--processes 4``), whose launcher
    kills its processes at ``--timeout``; the others start from here."""
    out = tmp_path_factory.mktemp("multiprocess")
    argv = [sys.executable, str(EXAMPLE), "--processes", "4", "--out", str(out / "4")]
    launcher = subprocess.Popen(  # in a session of its own: killed with its processes
        [*argv, "--timeout", str(TIMEOUT_S)],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    started = {}
    try:
        started = {n: example.Processes(n, out / str(n), _env()) for n in RUNS if n != 4}
        views = {n: run.wait(TIMEOUT_S) for n, run in started.items()}
        stdout, stderr = launcher.communicate(timeout=TIMEOUT_S + 60)
    finally:
        for run in started.values():
            run.kill()
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    if launcher.returncode:
        pytest.fail(f"`{' '.join(argv[1:])}` failed:\n{stderr[-5000:]}")
    views[4] = [json.loads((out / "4" / f"process_{i}.json").read_text()) for i in range(4)]
    return {
        "launcher": stdout,
        **{
            n: [(v, dict(np.load(out / str(n) / f"process_{v['process']}.npz"))) for v in vs]
            for n, vs in views.items()
        },
    }


def test_every_process_of_every_run_gets_the_one_process_results(runs):
    ((_, one),) = runs[1]
    assert {"loss", "loss_after_step"} < set(one) and len(one) > 30  # every param and grad
    for n in RUNS[1:]:
        assert [v["process"] for v, _ in runs[n]] == list(range(n))
        for view, arrays in runs[n]:
            assert view["devices"] == [8 // n, 8]
            check(compare(arrays, one), PROCESSES_BOUND, f"{n} processes, {view['process']}")
    assert float(one["loss_after_step"]) < float(one["loss"])  # the step is a descent step
    # The launcher prints each process's part and the loss.
    lines = runs["launcher"].splitlines()
    assert [line.split(":")[0] for line in lines[:4]] == [f"process {i} of 4" for i in range(4)]
    assert lines[-1].startswith(f"loss {float(one['loss']):.6f}, after one SGD step")


def _reference(example, params, tokens):
    """The loss, gradients and loss after the step of a plain loop; the FSDP blocks' init."""
    loss, grads = jax.value_and_grad(example.loop_loss)(params, tokens)
    stepped = jax.tree.map(lambda p, g: p - example.LR * g, params, grads)
    init = stackwise.stack(example.block_init, example.block_apply, example.N_FSDP).init
    fsdp_init = init(jax.random.split(jax.random.key(0), 3)[1])  # model_init's key for them
    return loss, grads, example.loop_loss(stepped, tokens), fsdp_init


def test_the_step_equals_a_plain_loop_on_one_device(example, runs):
    ((_, one),) = runs[1]
    shapes = jax.eval_shape(example.model_init, jax.random.key(0))  # the run has the values
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(shapes)]
    tree = jax.tree_util.tree_structure(shapes)
    params = jax.tree_util.tree_unflatten(tree, [jnp.asarray(one[f"params{p}"]) for p in paths])
    tokens = jnp.asarray(example.batch_rows(range(example.BATCH)))
    loss, grads, after, fsdp_init = jax.jit(_reference, static_argnums=0)(example, params, tokens)
    step = dict(zip((f"grads{p}" for p in paths), jax.tree.leaves(grads)))
    step.update(loss=loss, loss_after_step=after)
    check(compare(step, {k: one[k] for k in step}), LOOP_BOUND, "the step against the loop")
    # The params born sharded on the mesh are the stack's init on one device.
    born = {
        f"params['fsdp_blocks']{jax.tree_util.keystr(p)}": np.asarray(v)
        for p, v in jax.tree_util.tree_leaves_with_path(fsdp_init)
    }
    check(compare(born, {k: one[k] for k in born}), INIT_BOUND, "init")


def test_the_collectives_cross_processes_and_each_holds_its_part(runs):
    for n in RUNS:
        views = [v for v, _ in runs[n]]
        owner = np.array(views[0]["mesh_processes"])  # [data][stage][model] -> process
        # "model" stays inside a process; with 2 processes "data" crosses them, with 4 both
        # "data" and "stage" do: the FSDP gathers, gradient sums and the pipeline's ppermute.
        assert (owner == owner[:, :, :1]).all()
        crossing = [len(np.unique(np.moveaxis(owner, a, 0)[:, 0, 0])) > 1 for a in (0, 1)]
        assert crossing == [n >= 2, n >= 4], n
        # Each process holds only its devices' rows of the batch: together, every row once.
        rows = sorted(r for v in views for r in v["batch_rows"])
        assert rows == list(range(8)) and all(len(v["batch_rows"]) == 8 // n for v in views)
        for v in views:
            assert v["param_bytes_per_device"] == views[0]["param_bytes_per_device"]
            assert v["param_bytes_per_device"] < v["param_bytes"] / 3  # 1/4, and what's small
            # The pipeline's ppermute, FSDP's gathers and the gradients' reductions.
            assert {"collective-permute", "all-gather", "all-reduce"} <= set(v["collectives"])


def test_a_failed_process_is_reported_with_its_log(example, tmp_path):
    run = example.Processes(1, tmp_path, _env(XLA_FLAGS="--no_such_xla_flag"))
    with pytest.raises(RuntimeError, match=r"processes \[0\] failed") as info:
        run.wait(TIMEOUT_S)
    assert "no_such_xla_flag" in str(info.value)


def test_processes_past_the_timeout_are_killed(example, tmp_path):
    run = example.Processes(2, tmp_path, _env())
    with pytest.raises(RuntimeError, match=r"still running 0.2 s after the start, killed"):
        run.wait(0.2)
    assert all(c.poll() is not None for c in run.children)
