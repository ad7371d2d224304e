"""The one serving API, the same in the core and every framework: `to_serving(what holds the
params, path)` gives a new object in the serving layout and `from_serving(..., path)` gives the
stacked one back, bit for bit, changing nothing it was given.

One property per framework, for one block written once (`_layer`, a write into its own cache
and a read of it): decoding token by token in the serving layout equals, bitwise, the plain
loop over per-layer slices of the stacked params and the stacked decode (`Stacked.decode`; a
framework Stack built with `unroll=True`), which runs the same arithmetic layer by layer; the
final caches are the loop's; the same tokens decoded by one jitted program that is given the
stacked params and cache and converts them itself, before its token loop (docs/finetune.md,
"Many tokens in one program"), end with the same output and cache; and the round trip gives
every leaf back exactly. The first framework runs in the fast tier; each framework's own file
tests the rest of its serving layout (tests/core/test_serving.py,
tests/adapters/test_*serving*.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import pytest
from _trees import assert_trees_bitwise, assert_trees_close
from _versions import JAX

import stackwise

N, T, D = 3, 4, 8  # layers, cache positions, width
STEPS = 3
X0 = jax.random.normal(jax.random.key(9), (1, D))


def _layer(w, cache, x, pos):
    """One layer, the same in every framework: writes its row of the cache, reads it all."""
    cache = jax.lax.dynamic_update_slice(cache, jnp.tanh(x @ w), (pos, 0))
    return x + 0.5 * cache.sum(0, keepdims=True), cache


class Served(NamedTuple):
    """What a framework's case gives back to the shared checks."""

    w: jax.Array  # the stacked weights, (N, D, D), for the plain loop
    served: list  # each token's output, decoded in the serving layout
    caches: list  # the served decode's last cache, per layer
    decoded: list  # each token's output from the stacked decode (unroll=True)
    pairs: list  # (given, from_serving(to_serving(given, path), path)), to be equal bitwise
    unchanged: list  # (a deep copy of what was given, what was given after converting)
    generated: tuple  # (last output, stacked cache (N, T, D)) of one jitted program that
    #                   converts the stacked params and cache inside it, then decodes STEPS tokens


def _tokens(step: Callable[..., tuple[jax.Array, Any]], state: Any) -> tuple[list, Any]:
    """Decodes STEPS tokens from X0: ``step(x, state, pos) -> (y, state)``; y is the next x."""
    x, ys = X0, []
    for pos in range(STEPS):
        x, state = step(x, state, pos)
        ys.append(x)
    return ys, state


def _loop(w: jax.Array) -> tuple[list, list]:
    """The reference: a Python loop over per-layer slices of the stacked weights."""

    def step(x, caches, pos):
        caches = list(caches)
        for i in range(N):
            x, caches[i] = _layer(w[i], caches[i], x, pos)
        return x, caches

    return _tokens(jax.jit(step), [jnp.zeros((T, D))] * N)


def _core() -> Served:
    def init(key):
        return {"w": jax.random.normal(key, (D, D)) / D}, jnp.zeros((T, D))

    def apply(p, cache, x, pos):
        return _layer(p["w"], cache, x, pos)

    layers = stackwise.stack(init, apply, N, with_state=True)
    params, cache = layers.init(jax.random.key(0))
    model = {"embed": jnp.ones((2, D)), "blocks": params}
    given = copy.deepcopy(model)
    served = stackwise.to_serving(model, "blocks")
    assert isinstance(served["blocks"], stackwise.Serving) and served["embed"] is model["embed"]
    step = jax.jit(layers.apply, donate_argnums=1)
    ys, served_cache = _tokens(
        lambda x, c, pos: step(served["blocks"], c, x, pos), stackwise.to_serving(cache)
    )
    decoded, _ = _tokens(jax.jit(lambda x, c, pos: layers.decode(params, c, x, pos)), cache)
    back = stackwise.from_serving(served, "blocks")
    cache_back = stackwise.from_serving({"c": served_cache}, "c")["c"]
    assert cache_back.shape == cache.shape

    @jax.jit
    def generate(model, cache, x):
        served = stackwise.to_serving(model, "blocks")
        assert isinstance(served["blocks"], stackwise.Serving)  # (of traced values)

        def one(pos, carry):
            return layers.apply(served["blocks"], carry[1], carry[0], pos)

        x, cache = jax.lax.fori_loop(0, STEPS, one, (x, stackwise.to_serving(cache)))
        return x, stackwise.from_serving(cache)

    return Served(params["w"], ys, list(served_cache.layers), decoded,
                  [(model, back)], [(given, model)], generate(model, cache, X0))  # fmt: skip


def _haiku() -> Served:
    hk = pytest.importorskip("haiku")
    import stackwise.haiku

    class Block(hk.Module):
        def __call__(self, x, pos):
            w = hk.get_parameter("w", (D, D), init=hk.initializers.RandomNormal(1 / D))
            cache = hk.get_state("cache", (T, D), init=jnp.zeros)
            x, cache = _layer(w, cache, x, pos)
            hk.set_state("cache", cache)
            return x

    def model(unroll):
        return hk.transform_with_state(
            lambda x, pos: stackwise.haiku.Stack(Block, N, unroll=unroll)(x, pos)
        )

    f, f_decode = model(1), model(True)
    params, state = f.init(jax.random.key(0), X0, 0)
    state = jax.tree.map(jnp.zeros_like, state)  # (init ran the layers once)
    given = copy.deepcopy((params, state))
    to, back = stackwise.haiku.to_serving, stackwise.haiku.from_serving
    served_params, served_state = to(params, "stack"), to(state, "stack")
    assert isinstance(served_params["stack/block"]["w"], stackwise.Serving)
    apply = jax.jit(f.apply, donate_argnums=1)
    ys, served_state = _tokens(
        lambda x, s, pos: apply(served_params, s, None, x, pos), served_state
    )
    decode = jax.jit(f_decode.apply)
    decoded, _ = _tokens(lambda x, s, pos: decode(params, s, None, x, pos), state)
    caches = list(served_state["stack/block"]["cache"].layers)
    pairs = [(params, back(served_params, "stack")), (state, back(to(state, "stack"), "stack"))]

    @jax.jit
    def generate(params, state, x):
        served = to(params, "stack")
        assert isinstance(served["stack/block"]["w"], stackwise.Serving)  # (of traced values)

        def one(pos, carry):
            return f.apply(served, carry[1], None, carry[0], pos)

        x, state = jax.lax.fori_loop(0, STEPS, one, (x, to(state, "stack")))
        return x, back(state, "stack")["stack/block"]["cache"]

    return Served(params["stack/block"]["w"], ys, caches, decoded, pairs,
                  [(given, (params, state))], generate(params, state, X0))  # fmt: skip


def _flax() -> Served:
    nn = pytest.importorskip("flax.linen")
    import stackwise.flax

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, pos):
            w = self.param("w", nn.initializers.normal(1 / D), (D, D))
            cache = self.variable("cache", "c", jnp.zeros, (T, D))
            x, cache.value = _layer(w, cache.value, x, pos)
            return x

    class Model(nn.Module):
        unroll: Any = 1

        @nn.compact
        def __call__(self, x, pos):
            return stackwise.flax.Stack(Block, N, unroll=self.unroll, name="layers")(x, pos)

    variables = Model().init(jax.random.key(0), X0, 0)
    variables = {**variables, "cache": jax.tree.map(jnp.zeros_like, variables["cache"])}
    given = copy.deepcopy(variables)
    served = stackwise.flax.to_serving(variables, "layers")
    assert isinstance(served["cache"]["layers"]["c"], stackwise.Serving)

    def stepper(model, params, donate):
        def step(params, cache, x, pos):
            y, new = model.apply({"params": params, "cache": cache}, x, pos, mutable=["cache"])
            return y, new["cache"]

        step = jax.jit(step, donate_argnums=1 if donate else ())
        return lambda x, cache, pos: step(params, cache, x, pos)

    back = stackwise.flax.from_serving(served, "layers")  # (before its cache is donated)
    ys, cache = _tokens(stepper(Model(), served["params"], True), served["cache"])
    decoded, _ = _tokens(stepper(Model(True), variables["params"], False), variables["cache"])

    @jax.jit
    def generate(variables, x):
        served = stackwise.flax.to_serving(variables, "layers")
        assert isinstance(served["params"]["layers"]["w"], stackwise.Serving)  # (traced values)

        def one(pos, carry):
            y, new = Model().apply({"params": served["params"], "cache": carry[1]}, carry[0],
                                   pos, mutable=["cache"])
            return y, new["cache"]

        x, cache = jax.lax.fori_loop(0, STEPS, one, (x, served["cache"]))
        back = stackwise.flax.from_serving({**served, "cache": cache}, "layers")
        return x, back["cache"]["layers"]["c"]

    return Served(variables["params"]["layers"]["w"], ys, list(cache["layers"]["c"].layers),
                  decoded, [(variables, back)], [(given, variables)],
                  generate(variables, X0))  # fmt: skip


def _nnx() -> Served:
    nnx = pytest.importorskip("flax.nnx")
    import stackwise.nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jax.random.normal(rngs.params(), (D, D)) / D)
            self.cache = nnx.Cache(jnp.zeros((T, D)))

        def __call__(self, x, pos):
            y, self.cache[...] = _layer(self.w[...], self.cache[...], x, pos)
            return y

    class Model(nnx.Module):
        def __init__(self, unroll=1):
            self.embed = nnx.Linear(D, D, rngs=nnx.Rngs(1))
            self.blocks = stackwise.nnx.Stack(Block, N, rngs=nnx.Rngs(0), unroll=unroll)

    model = Model()
    given = nnx.clone(model)
    served = stackwise.nnx.to_serving(model, "blocks")
    assert type(served) is Model
    assert isinstance(served.blocks.layers.w.get_value(), stackwise.Serving)
    call = nnx.jit(lambda m, x, pos: m.blocks(x, pos))
    ys, _ = _tokens(lambda x, m, pos: (call(m, x, pos), m), served)
    decoded, _ = _tokens(lambda x, m, pos: (call(m, x, pos), m), Model(unroll=True))
    caches = list(served.blocks.layers.cache.get_value().layers)
    back = stackwise.nnx.from_serving(stackwise.nnx.to_serving(model, "blocks"), "blocks")

    @nnx.jit
    def generate(model, x):
        served = stackwise.nnx.to_serving(model, "blocks")
        assert isinstance(served.blocks.layers.w.get_value(), stackwise.Serving)  # (traced)
        for pos in range(STEPS):  # (NNX's modules in a lax loop need nnx.fori_loop)
            x = served.blocks(x, pos)
        nnx.update(model, nnx.state(stackwise.nnx.from_serving(served, "blocks")))
        return x

    fresh = nnx.clone(given)  # (its cache still empty)
    generated = generate(fresh, X0), fresh.blocks.layers.cache[...]
    return Served(model.blocks.layers.w[...], ys, caches, decoded,
                  [(nnx.state(model), nnx.state(back))],
                  [(nnx.state(given), nnx.state(model))], generated)  # fmt: skip


def _equinox() -> Served:
    eqx = pytest.importorskip("equinox")
    import stackwise.equinox

    class Block(eqx.Module):
        w: jax.Array

        def __init__(self, *, key):
            self.w = jax.random.normal(key, (D, D)) / D

        def __call__(self, x, cache, pos):
            return _layer(self.w, cache, x, pos)

    def stack(unroll):
        return stackwise.equinox.Stack(
            Block, N, with_state=True, unroll=unroll, key=jax.random.key(0)
        )

    model = {"embed": jnp.ones((2, D)), "blocks": stack(1)}
    given = copy.deepcopy(model)
    served = stackwise.equinox.to_serving(model, "blocks")
    assert isinstance(served["blocks"].layers, stackwise.Serving)
    cache = jnp.zeros((N, T, D))
    call = jax.jit(lambda m, x, c, pos: m(x, c, pos), donate_argnums=2)
    ys, served_cache = _tokens(
        lambda x, c, pos: call(served["blocks"], x, c, pos), stackwise.to_serving(cache)
    )
    decode = jax.jit(lambda m, x, c, pos: m(x, c, pos))
    decoded, _ = _tokens(lambda x, c, pos: decode(stack(True), x, c, pos), cache)
    back = stackwise.equinox.from_serving(served, "blocks")

    @eqx.filter_jit
    def generate(model, cache, x):
        served = stackwise.equinox.to_serving(model, "blocks")
        assert isinstance(served["blocks"].layers, stackwise.Serving)  # (of traced values)

        def one(pos, carry):
            return served["blocks"](carry[0], carry[1], pos)

        x, cache = jax.lax.fori_loop(0, STEPS, one, (x, stackwise.to_serving(cache)))
        return x, stackwise.from_serving(cache)

    return Served(model["blocks"].layers.w, ys, list(served_cache.layers), decoded,
                  [(model, back)], [(given, model)], generate(model, cache, X0))  # fmt: skip


@pytest.mark.parametrize("framework", [_core, _haiku, _flax, _nnx, _equinox],
                         ids=["core", "haiku", "flax", "nnx", "equinox"])  # fmt: skip
def test_serving_decodes_as_the_loop_and_the_stacked_decode_and_converts_back(framework):
    case = framework()
    ys_loop, caches_loop = _loop(case.w)
    # Bitwise the loop's from jax 0.10.2 on XLA:CPU; jax 0.10.0 (.ci/oldest) orders the core's
    # served sums otherwise in the last bits: there, within float32's bound.
    same = assert_trees_bitwise if JAX >= (0, 10, 2) else assert_trees_close
    same(case.served, ys_loop)
    same(case.caches, caches_loop)
    same(case.decoded, ys_loop)
    x, cache = case.generated
    assert_trees_close(x, ys_loop[-1])
    assert_trees_close(cache, jnp.stack(caches_loop))
    for given, back in case.pairs:
        assert jax.tree.structure(back) == jax.tree.structure(given)
        assert_trees_bitwise(back, given)
    for before, after in case.unchanged:
        assert jax.tree.structure(after) == jax.tree.structure(before)
        assert_trees_bitwise(after, before)
