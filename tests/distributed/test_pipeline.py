"""Pipeline parallelism: outputs and gradients equal the unpipelined stack.

The multi-device checks run once, in a subprocess with 8 simulated CPU
devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``): this file is
also that subprocess's script (see ``_worker``). Each case records its largest
difference to a plain Python loop over the per-layer params, or the
traceback if it raised; the tests below assert on those records.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _multidevice import result, run_cases, run_module
from jax.sharding import AbstractMesh

import stackwise
from stackwise._pipeline import pipeline
from stackwise._sharding import shard_stacked

# float32 sums reassociated across microbatches, stages and the data axis.
PIPELINE_TOL = 2e-5

D = 8  # feature width


def _init(key):
    k1, k2 = jax.random.split(key)
    return {"w": jax.random.normal(k1, (D, D)) / D**0.5, "b": 0.1 * jax.random.normal(k2, (D,))}


def _apply(params, x, scale):
    return x + scale * jnp.tanh(x @ params["w"] + params["b"][None, :])


def _loop(apply):
    """The reference: a Python loop over per-layer slices of the params."""

    def run(params, x, *args):
        for p in stackwise.unstack_layers(params):
            x = apply(p, x, *args)
        return x

    return run


def _compare(pipelined, reference, params, x, *args, placed=None):
    """Largest |difference| of outputs and of grads w.r.t. params and x.

    ``placed``: the same params as placed on the mesh for the pipeline.
    """

    def loss(f):
        def fn(p, v):
            y = f(p, v, *args)
            return sum(jnp.sum(jnp.sin(leaf)) for leaf in jax.tree.leaves(y)), y

        return jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))

    (_, y), g = loss(pipelined)(params if placed is None else placed, x)
    (_, y_ref), g_ref = loss(reference)(params, x)
    diffs = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), (y, g), (y_ref, g_ref))
    return max(jax.tree.leaves(diffs))


def _case_gpipe_stage4_data2():
    """GPipe on mesh (stage=4, data=2), remat, params placed on the stages."""
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    n, m = 8, 4
    params = jax.jit(stackwise.stack(_init, _apply, n).init)(jax.random.key(0))
    placed = shard_stacked(params, mesh, layer_axis="stage")
    x = jax.random.normal(jax.random.key(1), (16, D))
    pp = pipeline(_apply, n, mesh, microbatches=m, data_axis="data", remat=True)
    jaxpr = str(jax.make_jaxpr(pp)(placed, x, 0.7))
    lowered = jax.jit(pp).lower(placed, x, 0.7).as_text()
    return {
        "max_err": _compare(pp, _loop(_apply), params, x, 0.7, placed=placed),
        "remat_in_jaxpr": "checkpoint" in jaxpr or "remat" in jaxpr,
        "collective_permutes": lowered.count("collective_permute"),
        "layers_per_device": [s.data.shape[0] for s in placed["w"].addressable_shards],
    }


def _case_gpipe_stage8_haiku():
    """GPipe on mesh (stage=8,), auto axes, a Haiku-transformed layer."""
    import haiku as hk

    def block(x):
        return x + jnp.tanh(hk.Linear(D)(x))

    f = hk.without_apply_rng(hk.transform(block))
    n, m = 8, 2
    mesh = jax.sharding.Mesh(jax.devices(), ("stage",))
    x = jax.random.normal(jax.random.key(1), (6, D))
    params = stackwise.stack(f.init, f.apply, n).init(jax.random.key(0), x)
    pp = pipeline(f.apply, n, mesh, microbatches=m)
    return {"max_err": _compare(pp, _loop(f.apply), params, x)}


def _case_circular_flax():
    """Circular schedule, mesh (stage=4, data=2), 2 chunks per device, M = S, linen."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + nn.tanh(nn.Dense(D)(x))

    block = Block()
    n, m = 8, 4
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    x = jax.random.normal(jax.random.key(1), (8, D))
    params = stackwise.stack(block.init, block.apply, n).init(jax.random.key(0), x)
    pp = pipeline(
        block.apply, n, mesh, microbatches=m, data_axis="data", schedule="circular", repeats=2
    )
    return {"max_err": _compare(pp, _loop(block.apply), params, x)}


def _case_circular_pytree_carry():
    """Circular, (stage=4, data=2), M > S, one layer per chunk; x is a pytree carry."""
    n, m = 8, 6
    mesh = jax.make_mesh((4, 2), ("stage", "data"))

    def apply(params, xs, scale):
        h, count = xs
        return _apply(params, h, scale), count + 1

    params = stackwise.stack(_init, apply, n).init(jax.random.key(0))
    xs = (jax.random.normal(jax.random.key(1), (12, D)), jnp.zeros((12,), jnp.float32))
    pp = pipeline(apply, n, mesh, microbatches=m, data_axis="data", schedule="circular")
    y = jax.jit(pp)(params, xs, 0.5)
    return {
        "max_err": _compare(pp, _loop(apply), params, xs, 0.5),
        "counts": sorted(set(y[1].tolist())),
    }


_CASES = {
    "gpipe_stage4_data2": _case_gpipe_stage4_data2,
    "gpipe_stage8_haiku": _case_gpipe_stage8_haiku,
    "circular_flax": _case_circular_flax,
    "circular_pytree_carry": _case_circular_pytree_carry,
}

@pytest.fixture(scope="module")
def multi_device():
    return run_module(__file__)


def _result(multi_device, name):
    return result(multi_device, name)


@pytest.mark.parametrize("name", list(_CASES))
def test_pipeline_matches_loop_outputs_and_grads(multi_device, name):
    assert _result(multi_device, name)["max_err"] < PIPELINE_TOL


def test_pipeline_runs_on_stages(multi_device):
    r = _result(multi_device, "gpipe_stage4_data2")
    assert r["layers_per_device"] == [2] * 8  # 8 layers over 4 stages, placed
    assert r["collective_permutes"] > 0  # activations move by ppermute
    assert r["remat_in_jaxpr"]  # each stage's layers are checkpointed


def test_pipeline_every_layer_runs_once(multi_device):
    # Each of the 8 layers adds 1 to the carry's counter, for every example.
    assert _result(multi_device, "circular_pytree_carry")["counts"] == [8.0]


# --------------------------------------------------------------------------
# Errors: checked before any device is used, so an abstract mesh will do.


def _params(n):
    return {"w": jnp.zeros((n, D, D)), "b": jnp.zeros((n, D))}


def test_error_mesh_without_stage_axis():
    mesh = AbstractMesh((4,), ("data",))
    with pytest.raises(ValueError, match=r"`stage_axis='stage'` is not an axis.*'data': 4"):
        pipeline(_apply, 8, mesh, microbatches=2)
    with pytest.raises(ValueError, match=r"`data_axis='batch'` is not an axis"):
        pipeline(_apply, 8, mesh, microbatches=2, stage_axis="data", data_axis="batch")


def test_error_layers_not_divisible_by_stages():
    mesh = AbstractMesh((4,), ("stage",))
    with pytest.raises(ValueError, match=r"n=6 layers cannot be split evenly into S=4 stages"):
        pipeline(_apply, 6, mesh, microbatches=2)
    with pytest.raises(ValueError, match=r"S\*repeats=4\*3=12 chunks"):
        pipeline(_apply, 8, mesh, microbatches=4, schedule="circular", repeats=3)


def test_error_batch_not_divisible_by_microbatches():
    mesh = AbstractMesh((2, 2), ("stage", "data"))
    pp = pipeline(_apply, 4, mesh, microbatches=3, data_axis="data")
    with pytest.raises(ValueError, match=r"divisible by microbatches=3 times the 'data' axis "
                       r"size 2 = 6.*\n  x: shape \(8, 8\)"):
        pp(_params(4), jnp.ones((8, D)), 1.0)


def test_error_other_arguments():
    mesh = AbstractMesh((4,), ("stage",))
    with pytest.raises(ValueError, match=r"at least as many microbatches as stages.*=2"):
        pipeline(_apply, 8, mesh, microbatches=2, schedule="circular")
    with pytest.raises(ValueError, match=r"`schedule` must be one of"):
        pipeline(_apply, 8, mesh, microbatches=2, schedule="1f1b")
    with pytest.raises(ValueError, match=r"`data_axis` and `stage_axis` are both"):
        pipeline(_apply, 8, mesh, microbatches=2, data_axis="stage")
    with pytest.raises(TypeError, match=r"`microbatches` must be a positive Python int"):
        pipeline(_apply, 8, mesh, microbatches=0)
    pp = pipeline(_apply, 8, mesh, microbatches=2)
    with pytest.raises(ValueError, match=r"leading layer axis of length n=8"):
        pp(_params(4), jnp.ones((4, D)), 1.0)
    with pytest.raises(TypeError, match=r"per-layer arguments"):
        pp(_params(8), jnp.ones((4, D)), stackwise.per_layer(jnp.ones(8)))


if __name__ == "__main__":
    run_cases(_CASES)
