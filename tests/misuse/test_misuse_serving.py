"""The misuse catalogue of the serving layout (`stackwise.to_serving`, `stackwise.from_serving`
and `Stacked.apply` given a `stackwise.Serving`): one row per bad call, the error it must
raise and words its message must hold (the argument or option, and the fix)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _misuse import assert_refused, case
from jax.sharding import Mesh

import stackwise

N = 4
PARAMS = {"w": jnp.ones((N, 3, 3))}
CACHE = jnp.zeros((N, 5, 3))
X = jnp.ones((1, 3))
MESH = Mesh(np.array(jax.devices()[:1]), ("stage",))


def _layer(p, x):
    return x @ p["w"]


def _decode(p, cache, x, pos):
    cache = jax.lax.dynamic_update_slice(cache, x @ p["w"], (pos, 0))
    return x + cache.sum(0, keepdims=True), cache


def _with_state(**options):
    return stackwise.stack(None, _decode, N, with_state=True, **options)


def _served(tree=PARAMS, **kw):
    return stackwise.to_serving(tree, **kw)


def _pattern():
    layers = stackwise.stack([None, None], [_layer, _layer], N)
    a = b = {"w": jnp.ones((2, 3, 3))}
    layers.apply(_served((a, b)), X)  # converted without pattern=2


def _pipeline():
    pp = stackwise.pipeline(None, _layer, 2, MESH, microbatches=1)
    pp.apply(_served({"w": jnp.ones((2, 3, 3))}), jnp.ones((2, 3)))


SERVING = [
    case(
        "to_serving of a Serving",
        lambda: stackwise.to_serving(_served()),
        TypeError,
        "stackwise.to_serving",
        "already in the serving layout",
        "stackwise.from_serving(tree)",
    ),
    case(
        "to_serving of a tree holding a Serving",
        lambda: stackwise.to_serving({"a": _served(), "b": PARAMS}),
        TypeError,
        "holds one at ['a']",
        "Convert a stacked tree once",
    ),
    case(
        "to_serving of leaves of two depths",
        lambda: stackwise.to_serving({"w": jnp.ones((4, 2)), "v": jnp.ones((3, 2))}),
        ValueError,
        "stackwise.to_serving",
        "the same leading layer axis",
        "['v']: shape (3, 2)",
    ),
    case(
        "to_serving with a pattern that is not an int",
        lambda: stackwise.to_serving(PARAMS, pattern="2"),
        TypeError,
        "`pattern`",
        "a positive int",
    ),
    case(
        "from_serving of a stacked tree",
        lambda: stackwise.from_serving(PARAMS),
        TypeError,
        "stackwise.from_serving",
        "`serving` must be a `stackwise.Serving`",
        "already in the stacked layout",
    ),
    case(
        "served params with a stacked cache",
        lambda: _with_state().apply(_served(), CACHE, X, 0),
        TypeError,
        "the params are in the serving layout",
        "the state are stacked",
        "`stackwise.to_serving(state)`",
    ),
    case(
        "stacked params with a served cache",
        lambda: _with_state().apply(PARAMS, _served(CACHE), X, 0),
        TypeError,
        "the state are in the serving layout",
        "`stackwise.to_serving(params)`",
        "`stackwise.from_serving(state)`",
    ),
    case(
        "served params of another depth",
        lambda: stackwise.stack(None, _layer, 6).apply(_served(), X),
        ValueError,
        "hold 4 layers",
        "n=6",
        "stackwise.slice_layers",
    ),
    case(
        "a pattern's params served without pattern=",
        _pattern,
        ValueError,
        "converted without `pattern`",
        "a pattern of 2 layers",
        "`stackwise.to_serving(params, pattern=2)`",
    ),
    case(
        "one layer's params served with a pattern",
        lambda: stackwise.stack(None, _layer, N).apply(_served((PARAMS,), pattern=1), X),
        ValueError,
        "converted with pattern=1",
        "one layer repeated",
        "without `pattern`",
    ),
    case(
        "a Serving inside stacked params",
        lambda: stackwise.stack(None, _layer, N).apply({"a": _served()}, X),
        TypeError,
        "hold a `stackwise.Serving` at params['a']",
        "`stackwise.to_serving(stacked_params)`",
    ),
    case(
        "a Serving of Servings",
        lambda: stackwise.stack(None, _layer, 1).apply(stackwise.Serving([_served()]), X),
        TypeError,
        "at [0]",
        "convert a stacked tree once, not twice",
    ),
    case(
        "a stack built with fsdp",
        lambda: stackwise.stack(None, _layer, N, fsdp="data").apply(_served(), X),
        ValueError,
        "`fsdp=('data',)`",
        "keeps each layer's params whole",
        "without it",
    ),
    case(
        "a stack built with nested remat",
        lambda: stackwise.stack(None, _layer, N, nested=True).apply(_served(), X),
        ValueError,
        "`nested=True`",
        "build the stack you serve with without it",
    ),
    case(
        "a pipeline given served params",
        _pipeline,
        TypeError,
        "stackwise.pipeline",
        "`params` is in the serving layout",
        "`stackwise.from_serving(params)`",
    ),
]


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", SERVING)
def test_misuse_serving(call, error, words):
    assert_refused(call, error, words)


# --------------------------------------------------------------------------
# The adapters run their framework's stacked variables only: a Serving put in their
# params is refused with the framework's exact loop conversion as the fix. (NNX's served
# Stack: tests/misuse/test_misuse_serving_nnx.py.)

X4 = jnp.ones((1, 4))


def _haiku():
    import haiku as hk

    import stackwise.haiku

    f = hk.transform(lambda x: stackwise.haiku.Stack(lambda: hk.Linear(4), 3)(x))
    params = f.init(jax.random.key(0), X4)
    f.apply({k: stackwise.to_serving(v) for k, v in params.items()}, None, X4)


def _flax():
    import flax.linen as nn

    import stackwise.flax

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return stackwise.flax.Stack(nn.Dense(4), 3)(x)

    variables = Model().init(jax.random.key(0), X4)
    served = {"params": {k: stackwise.to_serving(t) for k, t in variables["params"].items()}}
    Model().apply(served, X4)


def _eqx_stack(**options):
    from functools import partial

    import equinox as eqx

    import stackwise.equinox

    linear = partial(eqx.nn.Linear, 4, 4)
    return stackwise.equinox.Stack(linear, 3, key=jax.random.key(0), **options)


def _equinox():
    import equinox as eqx

    stack = _eqx_stack()  # a Serving inside the stacked layers, not the layers themselves
    eqx.tree_at(lambda s: s.layers.weight, stack, stackwise.to_serving(stack.layers.weight))(X4[0])


def _eqx_reshaped():
    import equinox as eqx

    served = _eqx_stack().to_serving()
    eqx.tree_at(lambda s: s.layers.layers[2].weight, served, jnp.ones((4, 5)))(X4[0])


def _eqx_short():
    import equinox as eqx

    served = _eqx_stack().to_serving()
    short = stackwise.Serving(served.layers.layers[:2])
    eqx.tree_at(lambda s: s.layers, served, short)(X4[0])


def _eqx_state_index():
    import equinox as eqx

    import stackwise.equinox

    make = eqx.nn.make_with_state(stackwise.equinox.Stack)
    stack, _ = make(partial_batchnorm(), 2, key=jax.random.key(0))
    stack.to_serving()


def _eqx_state():
    import equinox as eqx

    import stackwise.equinox

    make = eqx.nn.make_with_state(stackwise.equinox.Stack)
    return make(partial_batchnorm(), 2, key=jax.random.key(0))[1]


def partial_batchnorm():
    import equinox as eqx

    def normed(key):
        linear = eqx.nn.Linear(4, 4, key=key)
        return eqx.nn.Sequential([linear, eqx.nn.BatchNorm(4, "b", mode="batch")])

    return normed


def _eqx_stacked_state():
    import equinox as eqx

    import stackwise.equinox

    make = eqx.nn.make_with_state(stackwise.equinox.Stack)
    stack, state = make(partial_batchnorm(), 2, key=jax.random.key(0))
    served, _ = stack.to_serving(state)  # (which makes `state` stale, as Equinox's update)
    stacked = make(partial_batchnorm(), 2, key=jax.random.key(0))[1]
    jax.vmap(served, axis_name="b", in_axes=(0, None))(X4, stacked)


def _eqx_served_state(call):
    import equinox as eqx

    import stackwise.equinox

    make = eqx.nn.make_with_state(stackwise.equinox.Stack)
    stack, state = make(partial_batchnorm(), 2, key=jax.random.key(0))
    served, served_state = stack.to_serving(state)
    call(served, served_state, lambda: make(partial_batchnorm(), 2, key=jax.random.key(0))[1])


def _eqx_other_state(served, served_state, stacked):
    import equinox as eqx

    other = eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, "b", mode="batch")[1]
    served.from_serving(other)


def _eqx_stacked_cache():
    from functools import partial

    import equinox as eqx

    import stackwise.equinox

    class Cached(eqx.Module):
        w: jax.Array

        def __init__(self, *, key):
            self.w = jnp.ones((3, 3))

        def __call__(self, x, cache, pos):
            return _decode({"w": self.w}, cache, x, pos)

    stack = stackwise.equinox.Stack(partial(Cached), N, with_state=True, key=jax.random.key(0))
    stack.to_serving()(X, CACHE, 0)  # the cache left stacked


ADAPTERS = [
    case("haiku Stack given served params", _haiku, TypeError, "stackwise.haiku.Stack",
         "`params['stack/linear']` is in the serving layout", "`stackwise.haiku.to_loop`"),
    case("flax Stack given served variables", _flax, TypeError, "stackwise.flax.Stack",
         "`variables['params']` is in the serving layout", "`stackwise.flax.to_loop`"),
    case("equinox Stack holding a Serving inside its layers", _equinox, TypeError,
         "stackwise.equinox.Stack", "`layers.weight` is in the serving layout",
         "`Stack.to_serving()`", "stackwise.to_serving"),
    case("equinox to_serving twice", lambda: _eqx_stack().to_serving().to_serving(),
         TypeError, "Stack(Linear, n=3).to_serving", "already in the serving layout",
         "stack.from_serving()"),
    case("equinox from_serving of a stacked Stack", lambda: _eqx_stack().from_serving(),
         TypeError, "Stack(Linear, n=3).from_serving", "not in the serving layout",
         "stack.to_serving()"),
    case("equinox to_serving of an fsdp Stack", lambda: _eqx_stack(fsdp="data").to_serving(),
         ValueError, "`fsdp='data'`", "Build the Stack without `fsdp`"),
    case("equinox to_serving of eqx.nn.State blocks without the state", _eqx_state_index,
         TypeError, ".to_serving", "eqx.nn.StateIndex", "`stack, state = "
         "stack.to_serving(state)`", "got NoneType"),
    case("equinox to_serving given a state its blocks do not hold",
         lambda: _eqx_stack().to_serving(_eqx_state()), TypeError, ".to_serving",
         "no block holds an eqx.nn.StateIndex", "stackwise.to_serving(cache)"),
    case("equinox from_serving given the stacked eqx.nn.State",
         lambda: _eqx_served_state(lambda served, _, stacked: served.from_serving(stacked())),
         TypeError, ".from_serving", "is stacked, not served"),
    case("equinox from_serving given another model's eqx.nn.State",
         lambda: _eqx_served_state(_eqx_other_state), ValueError, ".from_serving",
         "holds no values for the Stack's eqx.nn.StateIndex es", "stack.to_serving(state)"),
    case("equinox served eqx.nn.State Stack called without its State",
         lambda: _eqx_served_state(lambda served, *_: served(X4[0], {})), TypeError,
         "takes the eqx.nn.State converted with it", "got dict"),
    case("equinox to_layers(state) of a served Stack",
         lambda: _eqx_served_state(lambda served, state, _: served.to_layers(state)), TypeError,
         ".to_layers", "in the serving layout", "stack.from_serving(state)"),
    case("equinox served Stack given its stacked eqx.nn.State", _eqx_stacked_state, TypeError,
         "is not its serving layout", "`stack, state = stack.to_serving(state)`"),
    case("equinox served layer reshaped", _eqx_reshaped, TypeError, "served layer 2",
         "differs from layer 0 at `.weight`", "stack.to_serving()"),
    case("equinox served layers of another depth", _eqx_short, ValueError,
         "holds 2 blocks, but the Stack has n=3", "stack.to_serving()"),
    case("equinox served Stack given a stacked cache", _eqx_stacked_cache, TypeError,
         "the params are in the serving layout", "but the state are stacked",
         "stackwise.to_serving(state)"),
]  # fmt: skip


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", ADAPTERS)
def test_misuse_serving_in_adapters(call, error, words):
    assert_refused(call, error, words)
