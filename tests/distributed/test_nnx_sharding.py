"""`stackwise.nnx.Stack` sharding metadata on 8 simulated CPU devices.

Runs in a subprocess with 8 simulated CPU devices (tests/_multidevice.py): the
layer axis joins every variable's ``out_sharding`` as with ``nnx.vmap``'s
``transform_metadata``, eager sharding places the stacked values by it.
"""

from __future__ import annotations

import pytest
from _multidevice import result, run_cases, run_module
from _tolerance import check, compare
from _trees import STACK_BOUND


def _partition_specs():
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import stackwise.nnx

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    class Block(nnx.Module):
        def __init__(self, rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
            self.linear = nnx.Linear(
                8,
                8,
                kernel_init=init,
                rngs=rngs,
                bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("model",)),
            )

        def __call__(self, x):
            return x + jnp.tanh(self.linear(x))

    out = {}
    with jax.set_mesh(mesh):
        for name in (None, "data"):
            s = stackwise.nnx.Stack(Block, n=4, rngs=nnx.Rngs(0), layer_axis_name=name)
            ref = nnx.vmap(Block, transform_metadata={nnx.PARTITION_NAME: name})(
                nnx.Rngs(0).split(4)
            )

            def spec(m):
                specs = nnx.get_partition_spec(nnx.state(m))["linear"]
                return {k: tuple(v.value) for k, v in specs.items()}

            y = nnx.jit(lambda m, x: m(x))(s, jnp.ones((4, 8)))
            out[str(name)] = dict(
                stack=spec(s.layers),
                vmap=spec(ref),
                layer=spec(s.to_layers()[0]),
                placed=tuple(s.layers.linear.kernel[...].sharding.spec),
                after_call=tuple(
                    nnx.get_partition_spec(nnx.state(s))["layers"]["linear"]["kernel"].value
                ),
                close=compare(y, nnx.scan(lambda x, b: (b(x), None))(jnp.ones((4, 8)), ref)[0]),
            )
    return out


_CASES = {"partition_specs": _partition_specs}


@pytest.fixture(scope="module")
def multi_device():
    return run_module(__file__)


def test_partition_specs_gain_the_layer_axis_on_8_devices(multi_device):
    out = result(multi_device, "partition_specs")
    out.pop("cpu_s")
    for name, res in out.items():
        axis = None if name == "None" else name
        assert res["stack"] == {"kernel": [axis, None, "model"], "bias": [axis, "model"]}
        assert res["stack"] == res["vmap"]  # as nnx.vmap with transform_metadata
        assert res["layer"] == {"kernel": [None, "model"], "bias": ["model"]}
        assert res["after_call"] == [axis, None, "model"]
        assert res["placed"] == [axis, None, "model"]  # eager sharding by the stacked spec
        check(res["close"], STACK_BOUND, name)  # the same outputs as nnx.scan's


if __name__ == "__main__":
    run_cases(_CASES)
