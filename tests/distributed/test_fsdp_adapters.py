"""FSDP from every adapter on explicit mesh axes, params placed by logical axis names.

Each framework's Stack is built with ``fsdp=("data", "fsdp")`` on an explicit
``jax.make_mesh((4, 2), ("data", "fsdp"))``; its params are annotated with
logical names (linen: ``nn.with_logical_partitioning``; NNX:
``nnx.with_partitioning``; Haiku: a plain per-leaf mapping) and placed by
``stackwise.logical_specs`` with rules that split ``"embed"`` over both mesh
axes. Outputs and gradients equal one device's, gradients come back sharded
like the params, and each layer's weights are gathered inside the loop only.

Runs in a subprocess with 8 simulated CPU devices (see ``_CASES``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hlo import collectives
from _multidevice import result, run_cases, run_module
from _tolerance import check, compare, reassociation_bound
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

D, N, BATCH = 64, 4, 16

# float32 sums reassociated across devices: the loss and grads within SHARDED_BOUND * eps * (the
# leaf's largest magnitude) of one device's (tests/_tolerance.py). N layers of two matmuls
# (contractions of D and 2 * D terms), a loss over the BATCH x D outputs (grads summing the BATCH
# rows): 6 * (2 * 4 * (sqrt(64) + sqrt(128)) + sqrt(1024)) = 1,120 eps, 1.3e-4 of the scale.
# Measured on an AMD EPYC VM (the suite's XLA flags, XLA's default fusion emitters, optimisation
# level 2): at most 16 eps (Haiku's loss, a sum of sin that cancels), 2.3 on the grads. A relative
# error of 1e-3 is 8,389 eps.
SHARDED_BOUND = reassociation_bound(depth=N, width=(D, 2 * D), summed=BATCH * D)
AXES = ("data", "fsdp")
RULES = [("embed", AXES), ("mlp", None), ("layers", None)]


def _mesh():
    return jax.make_mesh((4, 2), AXES)


def _check(loss, placed, host, x, unbox=lambda tree: tree):
    """Loss and grads on the mesh against one device; specs and gathers of the program."""
    xs = jax.device_put(x, NamedSharding(_mesh(), P(AXES)))
    grad = jax.jit(jax.value_and_grad(loss))
    (value, g), (value_ref, g_ref) = grad(placed, xs), jax.value_and_grad(loss)(host, x)
    placed, g = unbox(placed), unbox(g)

    def specs(tree):
        return [str(P(*_trimmed(a.sharding.spec))) for a in jax.tree.leaves(tree)]

    gathers = [(shape.split("{")[0], depth) for op, shape, depth in
               collectives(grad.lower(placed, xs).compile().as_text()) if op == "all-gather"]
    return {
        "max_err": compare({"loss": value, "grads": g}, {"loss": value_ref, "grads": g_ref}),
        "param_specs": specs(placed),
        "grad_specs": specs(g),
        "gathered_in_loop": sorted({s for s, depth in gathers if depth}),
        "gathered_outside": sorted({s for s, depth in gathers if not depth}),
    }


def _trimmed(spec) -> tuple:
    spec = list(spec)
    while spec and spec[-1] is None:
        spec.pop()
    return tuple(spec)


def _case_haiku():
    import haiku as hk

    import stackwise.haiku

    class Block(hk.Module):
        def __call__(self, x):
            h = jax.nn.gelu(hk.Linear(2 * D)(x))  # block/linear: D -> 2D
            return x + hk.Linear(D)(h)  # block/linear_1: 2D -> D

    f = hk.without_apply_rng(
        hk.transform(lambda x: stackwise.haiku.Stack(Block, N, fsdp=AXES)(x))
    )
    x = jax.random.normal(jax.random.key(1), (BATCH, D))
    params = f.init(jax.random.key(0), x)
    names = {  # one layer's logical names; shard_stacked adds the layer axis
        "stack/block/linear": {"w": ("embed", "mlp"), "b": ("mlp",)},
        "stack/block/linear_1": {"w": ("mlp", "embed"), "b": ("embed",)},
    }
    placed = stackwise.shard_stacked(params, _mesh(), stackwise.logical_specs(names, RULES))
    return _check(lambda p, v: jnp.sum(jnp.sin(f.apply(p, v))), placed, params, x)


def _case_linen():
    import flax.linen as nn

    import stackwise.flax

    def dense(features, names):
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)
        return nn.Dense(features, kernel_init=init)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + dense(D, ("mlp", "embed"))(nn.gelu(dense(2 * D, ("embed", "mlp"))(x)))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            stack = stackwise.flax.Stack(Block, N, layer_axis_name="layers", fsdp=AXES)
            return stack(x)

    model = Model()
    x = jax.random.normal(jax.random.key(1), (BATCH, D))
    abstract = jax.eval_shape(model.init, jax.random.key(0), x)
    # The names include the layer axis ("layers"); the rules place it.
    specs = stackwise.logical_specs(nn.get_partition_spec(abstract), RULES, mesh=_mesh())
    shardings = jax.tree.map(lambda s: NamedSharding(_mesh(), s), specs)
    variables = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), x)
    host = jax.tree.map(np.asarray, nn.unbox(variables))
    loss = lambda v, x: jnp.sum(jnp.sin(model.apply(v, x)))  # noqa: E731
    return _check(loss, variables, host, x, unbox=nn.unbox)


def _case_nnx():
    from flax import nnx

    import stackwise.nnx

    def linear(d_in, d_out, names, rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), names)
        return nnx.Linear(d_in, d_out, kernel_init=init, rngs=rngs)

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up = linear(D, 2 * D, ("embed", "mlp"), rngs)
            self.down = linear(2 * D, D, ("mlp", "embed"), rngs)

        def __call__(self, x):
            return x + self.down(jax.nn.gelu(self.up(x)))

    with nnx.use_eager_sharding(False):  # placed below, by the rules
        stack = stackwise.nnx.Stack(Block, N, rngs=nnx.Rngs(0), layer_axis_name="layers",
                                    fsdp=AXES)
    graphdef, state = nnx.split(stack)
    specs = stackwise.logical_specs(nnx.get_partition_spec(state), RULES, mesh=_mesh())
    placed = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(_mesh(), s), specs))
    x = jax.random.normal(jax.random.key(1), (BATCH, D))
    host = jax.tree.map(np.asarray, state)

    def loss(state, x):
        return jnp.sum(jnp.sin(nnx.merge(graphdef, state)(x)))

    return _check(loss, placed, host, x)


_CASES = {"haiku": _case_haiku, "linen": _case_linen, "nnx": _case_nnx}


@pytest.fixture(scope="module")
def multi_device():
    pytest.importorskip("haiku")
    pytest.importorskip("flax")
    return run_module(__file__, timeout=600)


@pytest.mark.parametrize("framework", list(_CASES))
def test_fsdp_matches_one_device_grads_stay_sharded(multi_device, framework):
    # Defect 5: Haiku and linen Stacks could not use FSDP on explicit mesh axes (Haiku:
    # "dot_general ... illegally sharded result"; linen: a ShardingTypeError).
    r = result(multi_device, framework)
    check(r["max_err"], SHARDED_BOUND, framework)
    assert r["grad_specs"] == r["param_specs"]
    # Both kernels' "embed" axis is split over both mesh axes, the layer axis replicated.
    assert "P(None, ('data', 'fsdp'))" in r["param_specs"]  # up: (layers, embed, mlp)
    assert "P(None, None, ('data', 'fsdp'))" in r["param_specs"]  # down: (layers, mlp, embed)


@pytest.mark.parametrize("framework", list(_CASES))
def test_fsdp_gathers_one_layer_inside_the_loop(multi_device, framework):
    r = result(multi_device, framework)
    assert f"f32[{D},{2 * D}]" in r["gathered_in_loop"]
    assert f"f32[{2 * D},{D}]" in r["gathered_in_loop"]
    assert not [s for s in r["gathered_outside"] if s.startswith(f"f32[{N},")]


if __name__ == "__main__":
    run_cases(_CASES)
