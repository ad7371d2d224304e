"""Optimizer state under FSDP on 8 simulated devices: sharded like its leaf, and kept so.

Params placed by ``stackwise.fsdp_specs`` + ``stackwise.shard_stacked`` on an explicit
``("data",)`` mesh of 8; ``layerwise(adamw)`` (elementwise: runs as it is) and
``layerwise(lamb)`` (its trust ratio vmapped per layer), ``layerwise(adafactor)`` (its
state vmapped too). The state that ``init`` makes and a
jitted step returns is sharded like the param it belongs to, the compiled step has no
all-gather (each device updates its own shard; LAMB's per-layer norms are all-reduces of
scalars), and each device holds 1/8 of the optimizer state (``memory_analysis``).

Runs in a subprocess with 8 simulated CPU devices (see ``_CASES``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _multidevice import result, run_cases, run_module

N, D = 4, 64
DEVICES = 8


def _case(make):
    mesh = jax.make_mesh((DEVICES,), ("data",))
    with jax.set_mesh(mesh):
        return _on(mesh, make)


def _on(mesh, make):
    import optax

    import stackwise
    import stackwise.optax

    params = {"w": jnp.ones((N, D, 2 * D)), "b": jnp.ones((N, D))}
    placed = stackwise.shard_stacked(params, mesh, stackwise.fsdp_specs(params, mesh, "data"))
    tx = stackwise.optax.layerwise(make(optax))
    state = jax.jit(tx.init)(placed)

    @jax.jit
    def step(params, state):
        grads = jax.tree.map(jnp.sin, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    compiled = step.lower(placed, state).compile()
    new_params, new_state = step(placed, state)

    def like_params(tree):
        """(shape, spec) of every state leaf that has a param's shape, and the param's spec."""
        by_shape = {tuple(a.shape): str(a.sharding.spec) for a in jax.tree.leaves(placed)}
        return [(str(a.sharding.spec), by_shape[tuple(a.shape)]) for a in jax.tree.leaves(tree)
                if tuple(a.shape) in by_shape]

    leaves = jax.tree.leaves(state)
    total = sum(a.nbytes for a in leaves)
    per_device = sum(a.addressable_shards[0].data.nbytes for a in leaves)
    memory = compiled.memory_analysis()
    inputs = sum(a.nbytes for a in jax.tree.leaves((placed, state)))
    return {
        "init_specs": like_params(state),
        "step_specs": like_params(new_state),
        "param_specs": [str(a.sharding.spec) for a in jax.tree.leaves(new_params)],
        "all_gathers": compiled.as_text().count(" all-gather"),
        "state_fraction": per_device / total,
        "argument_fraction": memory.argument_size_in_bytes / inputs,
    }


_CASES = {
    "adamw": lambda: _case(lambda optax: optax.adamw(1e-3, weight_decay=0.1)),
    "lamb": lambda: _case(lambda optax: optax.lamb(1e-3)),
    # Its second moments are vmapped per layer: stacked by `init`'s vmap, then given the
    # param's sharding.
    "adafactor": lambda: _case(lambda optax: optax.adafactor(1e-3)),
}


@pytest.fixture(scope="module")
def multi_device():
    return run_module(__file__)


@pytest.mark.parametrize("name", list(_CASES))
def test_state_sharded_like_its_leaf_and_kept(multi_device, name):
    r = result(multi_device, name)
    assert r["init_specs"] and all(mine == leaf for mine, leaf in r["init_specs"])
    assert r["step_specs"] == r["init_specs"]
    assert all("data" in spec for spec in r["param_specs"])
    assert r["all_gathers"] == 0
    # 1/8 per device; the step count (a scalar) is replicated.
    assert r["state_fraction"] == pytest.approx(1 / DEVICES, rel=0.01)
    assert r["argument_fraction"] == pytest.approx(1 / DEVICES, rel=0.01)


if __name__ == "__main__":
    run_cases(_CASES)
