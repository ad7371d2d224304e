"""The misuse catalogue of the serving layout (`stackwise.to_serving`, `stackwise.from_serving`
and `Stacked.apply` given a `stackwise.Serving`; the adapters' `to_serving` / `from_serving`):
one row per bad call, the error it must raise and words its message must hold (the argument or
option, and the fix)."""

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
        "`tree` must be a `stackwise.Serving`",
        "already in the stacked layout",
    ),
    case(
        "from_serving of a tree holding a Serving, without its path",
        lambda: stackwise.from_serving({"embed": X, "blocks": _served()}),
        TypeError,
        "`tree` must be a `stackwise.Serving`",
        "it holds one at ['blocks']",
        "give that place as `path`",
    ),
    case(
        "from_serving at a path that holds a stacked tree",
        lambda: stackwise.from_serving({"blocks": PARAMS}, "blocks"),
        TypeError,
        "`tree` at 'blocks' must be a `stackwise.Serving`",
    ),
    case(
        "to_serving at a path not in the tree",
        lambda: stackwise.to_serving({"embed": X, "blocks": PARAMS}, "decoder"),
        ValueError,
        "stackwise.to_serving",
        "`path` 'decoder' is not in `tree`",
        "its keys: 'embed', 'blocks'",
    ),
    case(
        "to_serving at a list index out of range",
        lambda: stackwise.to_serving({"blocks": [PARAMS]}, "blocks/1"),
        ValueError,
        "`tree` at 'blocks' has no '1'",
        "a list of 1",
    ),
    case(
        "to_serving at a path through an array",
        lambda: stackwise.to_serving({"blocks": PARAMS}, "blocks/w/0"),
        TypeError,
        "goes through dicts, lists and tuples",
        "`tree` at 'blocks/w' is one array float32[4, 3, 3]",
        "pass it as `tree`",
    ),
    case(
        "to_serving with an empty path",
        lambda: stackwise.to_serving({"blocks": PARAMS}, ""),
        TypeError,
        "`path` must name a place",
        "Leave `path` out (None) for the whole tree",
    ),
    case(
        "to_serving with a list of paths",
        lambda: stackwise.to_serving({"a": PARAMS, "b": PARAMS}, ["a", "b"]),
        TypeError,
        "`path` is one place, got a list",
        "the core's `pattern=k`",
        "one per call",
    ),
    case(
        "to_serving at a path already served",
        lambda: stackwise.to_serving(stackwise.to_serving({"b": PARAMS}, "b"), "b"),
        TypeError,
        "`tree` at 'b' must be stacked",
        "already in the serving layout",
    ),
    case(
        "to_serving at a path with pattern= but one stacked tree there",
        lambda: stackwise.to_serving({"blocks": PARAMS}, "blocks", pattern=2),
        TypeError,
        "stackwise.to_serving",
        "with pattern=2, pass a tuple of 2 stacked trees",
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


def _linen(n=3, **options):
    import flax.linen as nn

    import stackwise.flax

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return stackwise.flax.Stack(nn.Dense(4), n, name="layers", **options)(x)

    return Model()


def _linen_vars(n=3):
    return _linen(n).init(jax.random.key(0), X4)


def _linen_served(n=3):
    import stackwise.flax

    return stackwise.flax.to_serving(_linen_vars(n), "layers")


def _linen_two_depths():
    import stackwise.flax

    variables = {**_linen_vars(), "cache": {"layers": {"k": jnp.zeros((2, 5))}}}
    stackwise.flax.to_serving(variables, "layers")


def _linen_pattern_depths():
    import stackwise.flax

    params = {"layers": {"A_0": {"w": jnp.ones((1, 2))}, "B_0": {"w": jnp.ones((3, 2))}}}
    stackwise.flax.to_serving({"params": params}, ["layers/A_0", "layers/B_0"])


def _linen_mixed():
    import flax.linen as nn

    import stackwise.flax

    class Cached(nn.Module):
        @nn.compact
        def __call__(self, x):
            k = self.variable("cache", "k", jnp.zeros, x.shape)
            k.value = k.value + x
            return nn.Dense(4)(x) + k.value

    stack = stackwise.flax.Stack(Cached, 3)
    variables = stack.init(jax.random.key(0), X4)
    params = {"params": _kit_split(variables["params"])}
    stack.apply({**params, "cache": variables["cache"]}, X4, mutable=["cache"])


def _kit_split(tree):
    from stackwise import _kit

    return _kit.serving.split(tree, "test", "params")


def _linen_convert():
    import stackwise.flax

    model = _linen()
    stackwise.flax.convert(_linen_served(), model, model, X4)


def _linen_qwix(served_stats=False):
    import qwix

    import stackwise.flax

    model = _linen()
    ptq = qwix.quantize_model(model, qwix.PtqProvider(
        [qwix.QtRule(module_path=".*", weight_qtype="int8")]))
    abstract = jax.eval_shape(ptq.init, jax.random.key(0), X4)["params"]
    if served_stats:  # statistics are stacked per layer like params: served ones refused
        floats = model.init(jax.random.key(0), X4)["params"]
        stackwise.flax.quantize_params(floats, abstract, _linen_served()["params"])
    stackwise.flax.quantize_params(_linen_served()["params"], abstract)


def _eqx(name):
    import stackwise.equinox

    return getattr(stackwise.equinox, name)


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

    served = _eqx("to_serving")(_eqx_stack())
    eqx.tree_at(lambda s: s.layers.layers[2].weight, served, jnp.ones((4, 5)))(X4[0])


def _eqx_short():
    import equinox as eqx

    served = _eqx("to_serving")(_eqx_stack())
    short = stackwise.Serving(served.layers.layers[:2])
    eqx.tree_at(lambda s: s.layers, served, short)(X4[0])


def _eqx_state_index():
    import equinox as eqx

    import stackwise.equinox

    make = eqx.nn.make_with_state(stackwise.equinox.Stack)
    stack, _ = make(partial_batchnorm(), 2, key=jax.random.key(0))
    stackwise.equinox.to_serving(stack)


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
    # (which makes `state` stale, as Equinox's update)
    served, _ = stackwise.equinox.to_serving(stack, state=state)
    stacked = make(partial_batchnorm(), 2, key=jax.random.key(0))[1]
    jax.vmap(served, axis_name="b", in_axes=(0, None))(X4, stacked)


def _eqx_served_state(call):
    import equinox as eqx

    import stackwise.equinox

    make = eqx.nn.make_with_state(stackwise.equinox.Stack)
    stack, state = make(partial_batchnorm(), 2, key=jax.random.key(0))
    served, served_state = stackwise.equinox.to_serving(stack, state=state)
    call(served, served_state, lambda: make(partial_batchnorm(), 2, key=jax.random.key(0))[1])


def _eqx_other_state(served, served_state, stacked):
    import equinox as eqx

    other = eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, "b", mode="batch")[1]
    _eqx("from_serving")(served, state=other)


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
    stackwise.equinox.to_serving(stack)(X, CACHE, 0)  # the cache left stacked


ADAPTERS = [
    case("haiku Stack given whole modules in the core's serving layout", _haiku, TypeError,
         "stackwise.haiku.Stack", "`params['stack/linear']` is a Serving",
         "leaf-wise", "`stackwise.haiku.to_serving(params, 'stack')`"),
    case("flax Stack given the core's Serving of a subtree", _flax, TypeError,
         "stackwise.flax.Stack", "`variables['params']` is a `stackwise.Serving` of per-layer "
         "trees", "`stackwise.flax.to_serving(variables, path)`"),
    case("flax to_serving twice",
         lambda: stackwise.flax.to_serving(_linen_served(), "layers"), TypeError,
         "stackwise.flax.to_serving", "`variables['params']['layers']['bias']` is already in "
         "the serving layout", "convert a Stack's variables once"),
    case("flax from_serving of stacked variables",
         lambda: stackwise.flax.from_serving(_linen_vars(), "layers"), TypeError,
         "stackwise.flax.from_serving", "`variables['params']['layers']['bias']` is one array",
         "not in the serving layout", "`to_serving`"),
    case("flax to_serving of a path in no collection",
         lambda: stackwise.flax.to_serving(_linen_vars(), "decoder"), ValueError,
         "stackwise.flax.to_serving", "no collection has 'decoder'", "the Stack's path"),
    case("flax to_serving of collections of two depths", _linen_two_depths, ValueError,
         "stackwise.flax.to_serving", "different numbers of layers", "params/layers: 3",
         "cache/layers: 2"),
    case("flax to_serving of a pattern's positions of no one depth", _linen_pattern_depths,
         ValueError, "stackwise.flax.to_serving", "hold [1, 3] layers", "which no depth gives"),
    case("flax Stack given served params and a stacked cache", _linen_mixed, TypeError,
         "stackwise.flax.Stack", "`variables['cache']['k']` is one array", "while "
         "`variables['params']['Dense_0']['bias']` is served", "`to_serving`"),
    case("flax Stack given served variables of another depth",
         lambda: _linen(n=4).apply(_linen_served(), X4), ValueError,
         "`variables['params']['bias']` holds 3 layers", "(n=4) runs 4",
         "convert this Stack's own stacked variables"),
    case("flax Stack built with fsdp given served variables",
         lambda: _linen(fsdp="data").apply(_linen_served(), X4), ValueError,
         "`fsdp='data'`", "Build the Stack you serve with without `fsdp`",
         "stackwise.flax.from_serving(variables, path)"),
    case("flax Stack built with nested remat given served variables",
         lambda: _linen(nested=True).apply(_linen_served(), X4), ValueError,
         "`nested=True`", "without `nested`"),
    case("flax to_loop of served variables",
         lambda: stackwise.flax.to_loop(_linen_served(), "layers"), TypeError,
         "stackwise.flax.to_loop", "`variables['params']['layers']['bias']` is in the serving "
         "layout", "`stackwise.flax.from_serving(variables, path)`"),
    case("flax convert of served variables", _linen_convert, TypeError,
         "stackwise.flax.convert", "is in the serving layout", "stackwise.flax.from_serving"),
    case("flax quantize_params of served params", _linen_qwix, TypeError,
         "stackwise.flax.quantize_params", "`params['layers']['bias']` is in the serving "
         "layout", "stackwise.flax.from_serving"),
    case("flax quantize_params of served quant_stats", lambda: _linen_qwix(True), TypeError,
         "stackwise.flax.quantize_params", "`quant_stats['layers']['bias']` is in the serving "
         "layout", "stackwise.flax.from_serving"),
    case("equinox Stack holding a Serving inside its layers", _equinox, TypeError,
         "stackwise.equinox.Stack", "`layers.weight` is in the serving layout",
         "`stackwise.equinox.to_serving(stack)`", "stackwise.to_serving"),
    case("equinox to_serving twice",
         lambda: _eqx("to_serving")(_eqx("to_serving")(_eqx_stack())), TypeError,
         "stackwise.equinox.to_serving: stackwise.equinox.Stack(Linear, n=3)",
         "already in the serving layout",
         "stackwise.equinox.from_serving(module, path)"),
    case("equinox from_serving of a stacked Stack",
         lambda: _eqx("from_serving")(_eqx_stack()), TypeError,
         "stackwise.equinox.from_serving: stackwise.equinox.Stack(Linear, n=3)",
         "not in the serving layout",
         "stackwise.equinox.to_serving(module, path)"),
    case("equinox to_serving of an fsdp Stack",
         lambda: _eqx("to_serving")(_eqx_stack(fsdp="data")),
         ValueError, "`fsdp='data'`", "Build the Stack without `fsdp`"),
    case("equinox to_serving of a model, without path",
         lambda: _eqx("to_serving")([X4, _eqx_stack()]), TypeError,
         "stackwise.equinox.to_serving", "`module` is a list, not a `stackwise.equinox.Stack`",
         "give `path`", "its Stacks: '1'"),
    case("equinox to_serving at a path with no Stack",
         lambda: _eqx("to_serving")({"embed": X4, "blocks": _eqx_stack()}, "embed"),
         ValueError, "holds no `stackwise.equinox.Stack` at 'embed'",
         "its Stacks are at: 'blocks'"),
    case("equinox from_serving of a model holding no Stack",
         lambda: _eqx("from_serving")({"embed": X4}, "embed"), ValueError,
         "stackwise.equinox.from_serving", "its Stacks are at: none"),
    case("equinox to_serving with a list of paths",
         lambda: _eqx("to_serving")([_eqx_stack(), _eqx_stack()], ["0", "1"]), TypeError,
         "`path` is one place", "an NNX or Equinox Stack knows its own", "one per call"),
    case("equinox to_serving with a path that names no place",
         lambda: _eqx("to_serving")([_eqx_stack()], 0.5), TypeError,
         "`path` must name a place", "'blocks'"),
    case("equinox Stack.to_serving(), the old method",
         lambda: _eqx_stack().to_serving(), TypeError, "Stack(Linear, n=3).to_serving()",
         "no longer converted", "`stackwise.equinox.to_serving(stack)`", "returns a new model"),
    case("equinox Stack.to_serving(state), the old method with a State",
         lambda: _eqx_stack().to_serving(_eqx_state()), TypeError,
         "`stackwise.equinox.to_serving(stack, state=state)`"),
    case("equinox Stack.from_serving(), the old method",
         lambda: _eqx_stack().from_serving(), TypeError, "Stack(Linear, n=3).from_serving()",
         "`stackwise.equinox.from_serving(stack)`"),
    case("equinox Stack.from_serving(state), the old method with a State",
         lambda: _eqx_stack().from_serving(_eqx_state()), TypeError,
         "`stackwise.equinox.from_serving(stack, state=state)`"),
    case("equinox to_serving of eqx.nn.State blocks without the state", _eqx_state_index,
         TypeError, "stackwise.equinox.to_serving", "eqx.nn.StateIndex", "`stack, state = "
         "stackwise.equinox.to_serving(stack, state=state)`", "got NoneType"),
    case("equinox to_serving given a state its blocks do not hold",
         lambda: _eqx("to_serving")(_eqx_stack(), state=_eqx_state()), TypeError,
         "stackwise.equinox.to_serving", "no block holds an eqx.nn.StateIndex",
         "stackwise.to_serving(cache)"),
    case("equinox from_serving given the stacked eqx.nn.State",
         lambda: _eqx_served_state(
             lambda served, _, stacked: _eqx("from_serving")(served, state=stacked())),
         TypeError, "stackwise.equinox.from_serving", "is stacked, not served"),
    case("equinox from_serving given another model's eqx.nn.State",
         lambda: _eqx_served_state(_eqx_other_state), ValueError,
         "stackwise.equinox.from_serving",
         "holds no values for the Stack's eqx.nn.StateIndex es",
         "stackwise.equinox.to_serving(stack, state=state)"),
    case("equinox served eqx.nn.State Stack called without its State",
         lambda: _eqx_served_state(lambda served, *_: served(X4[0], {})), TypeError,
         "takes the eqx.nn.State converted with it", "got dict"),
    case("equinox to_layers(state) of a served Stack",
         lambda: _eqx_served_state(lambda served, state, _: served.to_layers(state)), TypeError,
         ".to_layers", "in the serving layout",
         "stackwise.equinox.from_serving(stack, state=state)"),
    case("equinox served Stack given its stacked eqx.nn.State", _eqx_stacked_state, TypeError,
         "is not its serving layout",
         "`stack, state = stackwise.equinox.to_serving(stack, state=state)`"),
    case("equinox served layer reshaped", _eqx_reshaped, TypeError, "served layer 2",
         "differs from layer 0 at `.weight`", "stackwise.equinox.to_serving(stack)"),
    case("equinox served layers of another depth", _eqx_short, ValueError,
         "holds 2 blocks, but the Stack has n=3", "stackwise.equinox.to_serving(stack)"),
    case("equinox served Stack given a stacked cache", _eqx_stacked_cache, TypeError,
         "the params are in the serving layout", "but the state are stacked",
         "stackwise.to_serving(state)"),
]  # fmt: skip


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", ADAPTERS)
def test_misuse_serving_in_adapters(call, error, words):
    assert_refused(call, error, words)


# --------------------------------------------------------------------------
# The Haiku Stack's leaf-wise serving layout (`stackwise.haiku.to_serving` / `from_serving`).


def _hk_model(n=3, block=None, **options):
    """``(transform, params, state)``: a Stack of ``n`` layers with a cache in Haiku state."""
    import haiku as hk

    import stackwise.haiku

    def cached(x):
        cache = hk.get_state("cache", (2, 4), init=jnp.zeros)
        hk.set_state("cache", cache + x)
        return x + hk.Linear(4)(x) + cache.sum(0, keepdims=True)

    block = block or cached
    f = hk.transform_with_state(lambda x: stackwise.haiku.Stack(block, n, **options)(x))
    params, state = f.init(jax.random.key(0), X4)
    return f, params, state


def _hk_pattern(n):
    import haiku as hk

    return _hk_model(n, [lambda x: hk.Linear(4)(x), lambda x: x + hk.Linear(4)(x)])


def _hk(name):
    import stackwise.haiku

    return getattr(stackwise.haiku, name)


def _hk_served_with_stacked_state():
    f, params, state = _hk_model()
    f.apply(_hk("to_serving")(params, "stack"), state, None, X4)


def _hk_mixed_params():
    f, params, state = _hk_model()
    served = _hk("to_serving")(params, "stack")
    served["stack/linear"] = {**served["stack/linear"],
                                     "b": params["stack/linear"]["b"]}
    f.apply(served, _hk("to_serving")(state, "stack"), None, X4)


def _hk_other_depth():
    f, _, _ = _hk_model(3)
    _, params, state = _hk_model(2)
    to = _hk("to_serving")
    f.apply(to(params, "stack"), to(state, "stack"), None, X4)


def _hk_option(**options):
    f, _, _ = _hk_model(3, **options)
    _, params, state = _hk_model(3)
    to = _hk("to_serving")
    f.apply(to(params, "stack"), to(state, "stack"), None, X4)


def _hk_served_tree():
    return _hk("to_serving")(_hk_model()[1], "stack")


def _hk_convert():
    import haiku as hk

    import stackwise.haiku

    def model(x):
        return stackwise.haiku.Stack(lambda: hk.Linear(4), 3)(x)

    def loop(x):
        for _ in range(3):
            x = hk.Linear(4)(x)
        return x

    params = hk.transform(model).init(jax.random.key(0), X4)
    stackwise.haiku.convert(_hk("to_serving")(params, "stack"), model, loop, X4)


def _hk_uneven():
    served = _hk_served_tree()
    w = served["stack/linear"]["w"]
    served["stack/linear"]["w"] = stackwise.Serving(w.layers[:2])
    _hk("from_serving")(served, "stack")


HAIKU = [
    case("haiku to_serving twice", lambda: _hk("to_serving")(_hk_served_tree(), "stack"),
         TypeError, "stackwise.haiku.to_serving", "`tree['stack/linear']['b']` is "
         "already in the serving layout", "convert a Stack's variables once"),
    case("haiku from_serving of stacked params",
         lambda: _hk("from_serving")(_hk_model()[1], "stack"), TypeError,
         "stackwise.haiku.from_serving", "`tree['stack/linear']['b']` is one array "
         "float32[3, 4], not in the serving layout", "`to_serving`"),
    case("haiku from_serving of leaves of different depths", _hk_uneven, ValueError,
         "stackwise.haiku.from_serving", "different numbers of layers",
         "`tree['stack/linear']['w']`: 2"),
    case("haiku to_serving of a pattern whose positions differ in depth, by the Stack's name",
         lambda: _hk("to_serving")(_hk_pattern(5)[1], "stack"), ValueError,
         "stackwise.haiku.to_serving", "the same leading layer axis",
         "pass `path` as the list of the positions' module names", "Stack.position_names"),
    case("haiku to_serving of a pattern's positions of depths no n gives",
         lambda: _hk("to_serving")({"stack/a/l": {"w": jnp.ones((1, 2))},
                                    "stack/b/l": {"w": jnp.ones((3, 2))}},
                                   ["stack/a", "stack/b"]),
         ValueError, "stackwise.haiku.to_serving",
         "the 2 pattern positions hold [1, 3] layers, which no depth gives"),
    case("haiku to_serving with nothing under path",
         lambda: _hk("to_serving")(_hk_model()[1], "stack_1"), ValueError,
         "no module named 'stack_1'", "'stack/linear'"),
    case("haiku to_serving with a path that is not a name",
         lambda: _hk("to_serving")(_hk_model()[1], 3), TypeError, "`path` must be",
         "'stack/block'"),
    case("haiku to_serving of a tree that is not a Haiku dict",
         lambda: _hk("to_serving")(PARAMS, "stack"), TypeError,
         "`tree` must be a Haiku params or state dict"),
    case("haiku served params with a stacked cache", _hk_served_with_stacked_state, TypeError,
         "stackwise.haiku.Stack", "`state['stack/~']['cache']` is one array",
         "not in the serving layout", "Convert them all with the adapter's `to_serving`"),
    case("haiku served params with a stacked leaf among them", _hk_mixed_params, TypeError,
         "`params['stack/linear']['b']` is one array float32[3, 4]",
         "while `params['stack/linear']['w']` is served"),
    case("haiku served variables of another depth", _hk_other_depth, ValueError,
         "`params['stack/linear']['b']` holds 2 layers", "(n=3) runs 3",
         "convert this Stack's own stacked variables"),
    case("haiku served variables given a Stack built with fsdp",
         lambda: _hk_option(fsdp="data"), ValueError, "`fsdp='data'`",
         "Build the Stack you serve with without `fsdp`", "stackwise.haiku.from_serving"),
    case("haiku served variables given a Stack built with nested remat",
         lambda: _hk_option(nested=True), ValueError, "`nested=True`",
         "Build the Stack you serve with without `nested`"),
    case("haiku to_loop of served params",
         lambda: _hk("to_loop")(_hk_served_tree(), "stack", "block"), TypeError,
         "stackwise.haiku.to_loop", "`tree['stack/linear']['b']` is in the serving "
         "layout", "`stackwise.haiku.from_serving(tree, path)`"),
    case("haiku from_loop of served loop params",
         lambda: _hk("from_loop")({"block/linear": {"w": stackwise.to_serving(PARAMS["w"])}},
                                  "stack/block", "block"), TypeError,
         "stackwise.haiku.from_loop", "`tree['block/linear']['w']` is in the serving layout"),
    case("haiku to_layer_stack of served params",
         lambda: _hk("to_layer_stack")(_hk_served_tree(), "stack"), TypeError,
         "stackwise.haiku.to_layer_stack", "is in the serving layout"),
    case("haiku convert of served params", _hk_convert, TypeError,
         "stackwise.haiku.convert", "`tree['stack/linear']['b']` is in the serving layout"),
]  # fmt: skip


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", HAIKU)
def test_misuse_serving_in_haiku(call, error, words):
    assert_refused(call, error, words)
