"""`stackwise.flax.Stack` partitioning on 8 simulated CPU devices.

Runs in a subprocess with 8 simulated CPU devices (tests/_multidevice.py): the
layer axis joins the partition specs as in ``nn.scan``, the params are placed by
them, and the sharded program gives the one-device numbers.
"""

from __future__ import annotations

import pytest
from _multidevice import result, run_cases, run_module
from _trees import assert_trees_close


def _partitioning():
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import stackwise.flax

    assert jax.device_count() == 8, jax.devices()
    D, H, N = 8, 16, 4

    class Block(nn.Module):
        scan_out: bool = False

        @nn.compact
        def __call__(self, x):
            w = self.param(  # mesh axis names
                "w", nn.with_partitioning(nn.initializers.normal(0.3), (None, "model")), (D, H)
            )
            dense = nn.Dense(  # logical axis names
                D,
                kernel_init=nn.with_logical_partitioning(
                    nn.initializers.normal(0.3), ("mlp", "embed")
                ),
            )
            y = x + jnp.tanh(dense(jnp.tanh(x @ w)))
            return (y, None) if self.scan_out else y

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return stackwise.flax.Stack(Block, N, layer_axis_name="layers", name="stack")(x)

    class ScanModel(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(
                Block,
                variable_axes={True: 0},
                split_rngs={"params": True},
                length=N,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            return scan(scan_out=True, name="stack")(x)[0]

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("layers", "model"))
    # "model" is a mesh axis in `w`'s spec; a rule lets logical_to_mesh keep it.
    rules = (("layers", "layers"), ("model", "model"), ("embed", None), ("mlp", "model"))
    x = jax.random.normal(jax.random.key(1), (4, D))
    model = Model()

    # Specs from the abstract init: the layer axis is prepended to every spec.
    abstract = jax.eval_shape(model.init, jax.random.key(0), x)
    specs = nn.get_partition_spec(abstract)["params"]["stack"]
    assert specs["w"] == P("layers", None, "model"), specs["w"]
    assert specs["Dense_0"]["kernel"] == P("layers", "mlp", "embed"), specs
    scan_specs = nn.get_partition_spec(jax.eval_shape(ScanModel().init, jax.random.key(0), x))
    assert scan_specs["params"]["stack"] == specs, (scan_specs, specs)

    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
    variables = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), x)
    stack = variables["params"]["stack"]
    assert stack["w"].value.sharding.spec == P("layers", None, "model")
    assert stack["Dense_0"]["kernel"].value.sharding.spec == P("layers", "model", None)
    # Each device holds half the layers and a quarter of the model axis.
    assert stack["w"].value.addressable_shards[0].data.shape == (N // 2, D, H // 4)

    def loss(variables, x):
        return jnp.sum(jnp.sin(model.apply(variables, x)))

    # Inside the mesh and the logical rules each layer's boxes are unboxed with a
    # sharding constraint of the per-layer rank.
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        y = jax.jit(model.apply)(variables, x)
        g = jax.jit(jax.grad(loss))(variables, x)
        lowered = jax.jit(model.apply).lower(variables, x).as_text()
    assert "sharding_constraint" in lowered or "mhlo.sharding" in lowered

    # The same numbers on one device, without any partitioning.
    host = jax.tree.map(np.asarray, nn.unbox(variables))
    y_ref = model.apply(host, np.asarray(x))
    g_ref = jax.grad(loss)(host, np.asarray(x))
    assert_trees_close(np.asarray(y), y_ref)
    assert_trees_close(nn.unbox(g), g_ref)
    return {}


_CASES = {"partitioning": _partitioning}


@pytest.fixture(scope="module")
def multi_device():
    return run_module(__file__)


def test_stack_partitioning_on_an_8_device_mesh(multi_device):
    result(multi_device, "partitioning")


if __name__ == "__main__":
    run_cases(_CASES)
