"""A linen Stack applied inside `jax.set_mesh` + `nn.logical_axis_rules` on explicit axes,
with FSDP: the layers' gathered params are not constrained back to their sharded layout.

Runs on 8 simulated CPU devices in a subprocess (tests/_multidevice.py).
"""

from __future__ import annotations

import pytest
from _multidevice import result, run_cases, run_module


def _fsdp_inside_the_rules():
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import stackwise
    import stackwise.flax

    mesh = jax.make_mesh((8,), ("data",))  # explicit axes
    rules = [("layers", None), ("embed", "data"), ("mlp", None)]

    def dense(features, names):
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)
        return nn.Dense(features, kernel_init=init)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.gelu(dense(32, ("embed", "mlp"))(x))
            return x + dense(16, ("mlp", "embed"))(h)

    model = stackwise.flax.Stack(Block, 4, layer_axis_name="layers", fsdp="data")
    x = jax.random.normal(jax.random.key(1), (16, 16))
    abstract = jax.eval_shape(model.init, jax.random.key(0), x)
    specs = stackwise.logical_specs(nn.get_partition_spec(abstract), rules, mesh=mesh)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    variables = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), x)

    def loss(v, x):
        return jnp.mean(model.apply(v, x) ** 2)

    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        grads = jax.jit(jax.grad(loss))(variables, xs)
    host = jax.tree.map(np.asarray, nn.unbox(variables))
    expected = jax.grad(loss)(host, np.asarray(x))
    kernel = lambda t: t["params"]["Dense_1"]["kernel"]  # noqa: E731
    return {
        "spec": str(kernel(grads).value.sharding.spec),
        "param_spec": str(kernel(variables).value.sharding.spec),
        "diff": float(
            max(
                np.abs(np.asarray(a) - b).max()
                for a, b in zip(jax.tree.leaves(nn.unbox(grads)), jax.tree.leaves(expected))
            )
        ),
    }


_CASES = {"fsdp_inside_the_rules": _fsdp_inside_the_rules}


@pytest.fixture(scope="module")
def multi_device():  # (the name that keeps the 8-device subprocess out of the fast tier)
    return run_module(__file__)


def test_applied_inside_the_logical_rules_with_fsdp(multi_device):
    r = result(multi_device, "fsdp_inside_the_rules")
    assert r["diff"] < 1e-5
    assert r["spec"] == r["param_spec"]  # the gradients come back sharded like the params


if __name__ == "__main__":
    run_cases(_CASES)
