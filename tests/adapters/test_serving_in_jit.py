"""A generate written as one jitted program converts to the serving layout inside it, before its
token loop (docs/finetune.md, "Many tokens in one program"): every framework's ``to_serving``
and ``from_serving`` take traced values. Per framework, three tokens decoded by one program that
is given the stacked params and cache, converts them, runs its token loop in the serving layout
and stacks the cache again, equal the same tokens decoded step by step on the stacked layout,
with the same final cache. (The core's case is the docs' block, run by tests/package.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _trees import assert_trees_close

import stackwise

N, T, D, TOKENS = 3, 4, 8, 3
X0 = jax.random.normal(jax.random.key(9), (1, D))


def _layer(w, cache, x, pos):
    """One layer: writes its row of the cache, reads it all."""
    cache = jax.lax.dynamic_update_slice(cache, jnp.tanh(x @ w), (pos, 0))
    return x + 0.5 * cache.sum(0, keepdims=True), cache


def _haiku():
    hk = pytest.importorskip("haiku")
    import stackwise.haiku as swh

    class Block(hk.Module):
        def __call__(self, x, pos):
            w = hk.get_parameter("w", (D, D), init=hk.initializers.RandomNormal(1 / D))
            cache = hk.get_state("cache", (T, D), init=jnp.zeros)
            x, cache = _layer(w, cache, x, pos)
            hk.set_state("cache", cache)
            return x

    f = hk.transform_with_state(lambda x, pos: swh.Stack(Block, N)(x, pos))
    params, state = f.init(jax.random.key(0), X0, 0)
    state = jax.tree.map(jnp.zeros_like, state)

    @jax.jit
    def generate(params, state, x):
        served = swh.to_serving(params, "stack")
        assert isinstance(served["stack/block"]["w"], stackwise.Serving)  # (traced values)

        def one(pos, carry):
            return f.apply(served, carry[1], None, carry[0], pos)

        x, state = jax.lax.fori_loop(0, TOKENS, one, (x, swh.to_serving(state, "stack")))
        return x, swh.from_serving(state, "stack")

    x, stepped = X0, state
    for pos in range(TOKENS):
        x, stepped = f.apply(params, stepped, None, x, pos)
    return generate(params, state, X0), (x, stepped)


def _flax():
    nn = pytest.importorskip("flax.linen")
    import stackwise.flax as swf

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, pos):
            w = self.param("w", nn.initializers.normal(1 / D), (D, D))
            cache = self.variable("cache", "c", jnp.zeros, (T, D))
            x, cache.value = _layer(w, cache.value, x, pos)
            return x

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x, pos):
            return swf.Stack(Block, N, name="layers")(x, pos)

    def step(params, cache, x, pos):
        y, new = Model().apply({"params": params, "cache": cache}, x, pos, mutable=["cache"])
        return y, new["cache"]

    variables = Model().init(jax.random.key(0), X0, 0)
    variables = {**variables, "cache": jax.tree.map(jnp.zeros_like, variables["cache"])}

    @jax.jit
    def generate(variables, x):
        served = swf.to_serving(variables, "layers")
        assert isinstance(served["params"]["layers"]["w"], stackwise.Serving)

        def one(pos, carry):
            return step(served["params"], carry[1], carry[0], pos)

        x, cache = jax.lax.fori_loop(0, TOKENS, one, (x, served["cache"]))
        return x, swf.from_serving({**served, "cache": cache}, "layers")["cache"]

    x, cache = X0, variables["cache"]
    for pos in range(TOKENS):
        x, cache = step(variables["params"], cache, x, pos)
    return generate(variables, X0), (x, cache)


def _nnx():
    nnx = pytest.importorskip("flax.nnx")
    import stackwise.nnx as swn

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jax.random.normal(rngs.params(), (D, D)) / D)
            self.cache = nnx.Cache(jnp.zeros((T, D)))

        def __call__(self, x, pos):
            y, self.cache[...] = _layer(self.w[...], self.cache[...], x, pos)
            return y

    class Model(nnx.Module):
        def __init__(self):
            self.blocks = swn.Stack(Block, N, rngs=nnx.Rngs(0))

    model = Model()
    stepped = nnx.clone(model)

    @nnx.jit
    def generate(model, x):
        served = swn.to_serving(model, "blocks")
        assert isinstance(served.blocks.layers.w.get_value(), stackwise.Serving)
        for pos in range(TOKENS):  # (NNX's modules in a lax loop need nnx.fori_loop)
            x = served.blocks(x, pos)
        nnx.update(model, nnx.state(swn.from_serving(served, "blocks")))
        return x

    x = X0
    for pos in range(TOKENS):
        x = stepped.blocks(x, pos)
    out = generate(model, X0)
    return (out, model.blocks.layers.cache[...]), (x, stepped.blocks.layers.cache[...])


def _equinox():
    eqx = pytest.importorskip("equinox")
    import stackwise.equinox as swe

    class Block(eqx.Module):
        w: jax.Array

        def __init__(self, *, key):
            self.w = jax.random.normal(key, (D, D)) / D

        def __call__(self, x, cache, pos):
            return _layer(self.w, cache, x, pos)

    stack = swe.Stack(Block, N, with_state=True, key=jax.random.key(0))

    @eqx.filter_jit
    def generate(model, cache, x):
        served = swe.to_serving(model)
        assert isinstance(served.layers, stackwise.Serving)

        def one(pos, carry):
            return served(carry[0], carry[1], pos)

        x, cache = jax.lax.fori_loop(0, TOKENS, one, (x, stackwise.to_serving(cache)))
        return x, stackwise.from_serving(cache)

    x, cache = X0, jnp.zeros((N, T, D))
    for pos in range(TOKENS):
        x, cache = stack(x, cache, pos)
    return generate(stack, jnp.zeros((N, T, D)), X0), (x, cache)


@pytest.mark.parametrize("framework", [_haiku, _flax, _nnx, _equinox],
                         ids=["haiku", "flax", "nnx", "equinox"])  # fmt: skip
def test_a_generate_that_converts_inside_its_jit_decodes_as_the_stacked_steps(framework):
    (x, cache), (want_x, want_cache) = framework()
    assert float(jnp.abs(want_x - X0).max()) > 0  # (the layers did something)
    assert_trees_close(x, want_x)
    assert_trees_close(cache, want_cache)
    assert float(jnp.abs(jax.tree.leaves(want_cache)[0][:, TOKENS - 1]).max()) > 0
