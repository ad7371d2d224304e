"""Every adapter's params tree, as its framework hands it to optax, without listing leaves.

Haiku params (a dict by module name), linen variables, NNX state through ``nnx.Optimizer``
and an Equinox model through ``eqx.filter``: LAMB (a trust ratio per leaf) through
``stackwise.optax.layerwise`` equals plain LAMB on the loop model's per-layer params.
"""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import optax
import pytest
from _tolerance import check, compare
from flax import nnx
from test_optax_wrapper import ROUNDING_BOUND, _apart, _loop, _unloop

import stackwise.equinox
import stackwise.flax
import stackwise.haiku
import stackwise.nnx
import stackwise.optax as so

pytestmark = pytest.mark.slow  # imports and traces every framework

N, D, STEPS = 4, 8, 2


def _grads(params, t):
    return jax.tree.map(lambda a: jnp.sin(3.0 * a + t), params)


def _plain_loop(params, depth_of):
    """The plain optimizer on the loop model's params: the reference."""
    tx = _optimizer()

    @jax.jit
    def step(loop, state, t):
        grads = _loop(_grads(_unloop(loop, params, depth_of), t), depth_of)
        updates, state = tx.update(grads, state, loop)
        return optax.apply_updates(loop, updates), state

    loop = _loop(params, depth_of)
    state = tx.init(loop)
    for t in range(STEPS):
        loop, state = step(loop, state, t)
    return _unloop(loop, params, depth_of)


def _optimizer():
    return optax.chain(optax.adaptive_grad_clip(0.01), optax.sgd(0.1))


def _wrapped(params, stacked):
    tx = so.layerwise(_optimizer(), stacked)
    state = tx.init(params)
    step = jax.jit(tx.update)
    for t in range(STEPS):
        updates, state = step(_grads(params, t), state, params)
        params = optax.apply_updates(params, updates)
    return params


def haiku_case():
    class Block(hk.Module):
        def __call__(self, x):
            return x + jnp.tanh(hk.Linear(D)(x))

    model = hk.transform(lambda x: hk.Linear(D)(stackwise.haiku.Stack(Block, n=N)(x)))
    params = model.init(jax.random.key(0), jnp.ones((2, D)))
    stacked = lambda path: "stack/" in path  # noqa: E731  (the Stack's module name)
    return params, stacked, _wrapped(params, stacked)


def linen_case():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + jnp.tanh(nn.Dense(D)(x))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(D)(stackwise.flax.Stack(Block, n=N)(x))

    variables = Model().init(jax.random.key(0), jnp.ones((2, D)))
    stacked = {"params": {"Stack_0": True, "Dense_0": False}}
    return variables, (lambda path: "Stack_0" in path), _wrapped(variables, stacked)


def nnx_case():
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(D, D, rngs=rngs)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.blocks = stackwise.nnx.Stack(Block, n=N, rngs=rngs)
            self.head = nnx.Linear(D, D, rngs=rngs)

    model = Model(nnx.Rngs(0))
    before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))  # the model moves on
    stacked = so.stacked_in(model)
    optimizer = nnx.Optimizer(model, so.layerwise(_optimizer(), stacked), wrt=nnx.Param)
    for t in range(STEPS):
        optimizer.update(model, _grads(nnx.state(model, nnx.Param), t))
    return before, stacked, nnx.state(model, nnx.Param)


def equinox_case():
    class Block(eqx.Module):
        linear: eqx.nn.Linear

        def __init__(self, key):
            self.linear = eqx.nn.Linear(D, D, key=key)

    class Model(eqx.Module):
        blocks: stackwise.equinox.Stack
        head: eqx.nn.Linear

    keys = jax.random.split(jax.random.key(0))
    model = Model(stackwise.equinox.Stack(Block, n=N, key=keys[0]),
                  eqx.nn.Linear(D, D, key=keys[1]))
    params = eqx.filter(model, eqx.is_array)
    stacked = so.stacked_in(model)
    return params, stacked, _wrapped(params, stacked)


CASES = {"haiku": haiku_case, "linen": linen_case, "nnx": nnx_case, "equinox": equinox_case}


@pytest.mark.parametrize("framework", list(CASES))
def test_adapter_params_train_like_the_loop(framework):
    params, stacked, trained = CASES[framework]()
    depth_of = stacked if callable(stacked) else None
    depths = [depth_of(jax.tree_util.keystr(p)) for p, _ in
              jax.tree_util.tree_leaves_with_path(params)]
    assert 0 in depths and 1 in depths  # a stack and a leaf outside it
    reference = _plain_loop(params, lambda path: int(depth_of(path)))
    check(compare(trained, reference), ROUNDING_BOUND, framework)
    assert _apart(trained, params) > 100 * ROUNDING_BOUND


def _pattern_models():
    """An NNX and an Equinox model whose blocks are a pattern of 2 positions, 3 layers: built
    abstractly (`stacked_in` reads the structure), with params of ones of their shapes."""
    class NnxModel(nnx.Module):
        def __init__(self, rngs):
            linear = lambda rngs: nnx.Linear(D, D, rngs=rngs)  # noqa: E731
            self.blocks = stackwise.nnx.Stack([linear, linear], n=3, rngs=rngs)
            self.head = nnx.Linear(D, 2, rngs=rngs)

    class EqxModel(eqx.Module):
        blocks: stackwise.equinox.Stack
        head: eqx.nn.Linear

        def __init__(self, key):
            linear = lambda key: eqx.nn.Linear(D, D, key=key)  # noqa: E731
            self.blocks = stackwise.equinox.Stack([linear, linear], n=3, key=key)
            self.head = eqx.nn.Linear(D, 2, key=key)

    ones = lambda tree: jax.tree.map(lambda a: jnp.ones(a.shape, a.dtype), tree)  # noqa: E731
    nnx_model = nnx.eval_shape(lambda: NnxModel(nnx.Rngs(0)))
    eqx_model = eqx.filter_eval_shape(EqxModel, jax.random.key(0))
    return {"nnx": (nnx_model, ones(nnx.state(nnx_model, nnx.Param))),
            "equinox": (eqx_model, ones(eqx.filter(
                eqx_model, lambda x: isinstance(x, jax.ShapeDtypeStruct))))}


def test_stacked_in_gives_a_pattern_stack_its_positions():
    """`stacked_in` marks a pattern Stack's leaves with their positions, so `freeze=[0, 1]`
    names the model's layers 0 and 1: row 0 of position 0 and row 0 of position 1 (position 0
    holds layers 0 and 2, position 1 layer 1)."""
    positions = so.pattern(3, 2)
    for framework, (model, params) in _pattern_models().items():
        stacked = so.stacked_in(model)
        marks = [stacked(jax.tree_util.keystr(p))
                 for p, _ in jax.tree_util.tree_leaves_with_path(params)]
        assert {str(m) for m in marks} == {"0", *map(str, positions)}, (framework, marks)
        tx = so.layerwise(optax.sgd(1.0), stacked, freeze=[0, 1])
        grads = jax.tree.map(jnp.ones_like, params)
        updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
        for u, mark in zip(jax.tree.leaves(updates), marks):
            if mark in positions:
                assert u.shape[0] == (2 if mark == positions[0] else 1), (framework, mark)
                assert not jnp.any(u[0]) and jnp.all(u[1:] != 0), (framework, mark)
            else:
                assert mark == 0 and jnp.all(u != 0), (framework, mark)
