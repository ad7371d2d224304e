"""The misuse catalogue of the adapters: Stack, stack[i], to_layers/from_layers, conversions.

One table per framework: the call, the error it must raise, and words its message must
hold (the argument or leaf, and the fix). After the tables, what once went silently
wrong or crashed and now gives the right result: NumPy integer indices, NumPy and JAX
arrays mixed across layers, abstract trees through every conversion.
"""

from __future__ import annotations

from functools import partial

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _misuse import assert_refused, case
from flax import nnx

import stackwise
import stackwise.equinox
import stackwise.flax
import stackwise.haiku
import stackwise.nnx

KEY = jax.random.key(0)
X = jnp.ones((1, 4))


# --------------------------------------------------------------------------
# Equinox.

EQX = stackwise.equinox.Stack(partial(eqx.nn.Linear, 4, 4), 3, key=KEY)
EQX_SHORT = eqx.tree_at(lambda s: s.layers.weight, EQX, EQX.layers.weight[:2])


def _linear(weight):
    return eqx.tree_at(lambda m: m.weight, eqx.nn.Linear(2, 2, key=KEY), weight)


class _Normed(eqx.Module):
    norm: eqx.nn.BatchNorm

    def __init__(self, key):
        self.norm = eqx.nn.BatchNorm(4, axis_name="batch", mode="ema")

    def __call__(self, x, state):
        return self.norm(x, state)


def _state_of_another_depth():
    make = eqx.nn.make_with_state(stackwise.equinox.Stack)
    stack, _ = make(_Normed, n=3, key=KEY)
    _, shallower = make(_Normed, n=2, key=KEY)
    stack.to_layers(shallower)


def _eqx_has_aux_without_aux():
    stack = stackwise.equinox.Stack(partial(eqx.nn.Linear, 4, 4), 2, key=KEY, has_aux=True)
    jax.eval_shape(lambda x: stack(x), jnp.ones(4))


EQUINOX = [
    case(
        "stack[i] of a leaf with fewer layers than n",
        lambda: EQX_SHORT[2],
        ValueError,
        "layers.weight: shape (2, 4, 4)",
        "n=3",
    ),
    case(
        "to_layers() of a leaf with fewer layers than n",
        lambda: EQX_SHORT.to_layers(),
        ValueError,
        "layers.weight",
    ),
    case(
        "to_layers(state) of a State of another depth",
        _state_of_another_depth,
        ValueError,
        "state",
        "n=3",
        "shape (2, 4)",
    ),
    case(
        "to_layers(state) of a State of another model",
        lambda: eqx.nn.make_with_state(stackwise.equinox.Stack)(_Normed, n=2, key=KEY)[0].to_layers(
            eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, axis_name="batch", mode="ema")[1]
        ),
        ValueError,
        "holds no values",
        "make_with_state",
    ),
    case("stack[True]", lambda: EQX[True], TypeError, "a layer index must be an int", "bool"),
    case("stack[1.0]", lambda: EQX[1.0], TypeError, "a layer index must be an int", "float"),
    case("stack[3] of 3 layers", lambda: EQX[3], IndexError, "layer 3", "n=3"),
    case("stack[-4] of 3 layers", lambda: EQX[-4], IndexError, "layer -4"),
    case(
        "Stack(eqx.nn.Linear, n, key=k)",
        lambda: stackwise.equinox.Stack(eqx.nn.Linear, 2, key=KEY),
        TypeError,
        "`block`",
        "in_features",
        "functools.partial(Linear, ...)",
    ),
    case(
        "from_layers(blocks, key=k)",
        lambda: stackwise.equinox.Stack.from_layers(EQX.to_layers(), key=KEY),
        TypeError,
        "`key=`",
        "already built",
    ),
    case(
        "from_layers(blocks, an unknown option)",
        lambda: stackwise.equinox.Stack.from_layers(EQX.to_layers(), remat_policy=True),
        TypeError,
        "`remat_policy=`",
        "`remat`",
    ),
    case(
        "from_layers of a dict of blocks",
        lambda: stackwise.equinox.Stack.from_layers(dict(enumerate(EQX.to_layers()))),
        TypeError,
        "`blocks`",
        "list(blocks.values())",
    ),
    case(
        "from_layers of one block",
        lambda: stackwise.equinox.Stack.from_layers(EQX[0]),
        TypeError,
        "`blocks`",
        "one Linear",
    ),
    case(
        "from_layers of NumPy int64 weights, x64 off",
        lambda: stackwise.equinox.Stack.from_layers(
            [_linear(np.full((2, 2), 2**40 + i, np.int64)) for i in range(2)]
        ),
        TypeError,
        "`.weight` of block 0",
        "int64",
        "jax_enable_x64",
    ),
    case(
        "from_layers of NumPy float64 weights, x64 off",
        lambda: stackwise.equinox.Stack.from_layers([_linear(np.ones((2, 2)))] * 2),
        TypeError,
        "`.weight` of block 0",
        "float64",
        "astype(np.float32)",
    ),
    case(
        "from_layers of blocks of other sizes",
        lambda: stackwise.equinox.Stack.from_layers(
            [eqx.nn.Linear(4, 4, key=KEY), eqx.nn.Linear(4, 5, key=KEY)]
        ),
        TypeError,
        "block 1",
        "out_features",
        "4 vs 5",
    ),
    case(
        "has_aux=True, a block returning no aux",
        _eqx_has_aux_without_aux,
        TypeError,
        "`has_aux=True`",
        "one array float32[4]",
    ),
]


# --------------------------------------------------------------------------
# NNX.


def _nnx_stack(n=3):
    return stackwise.nnx.Stack(lambda rngs: nnx.Linear(4, 4, rngs=rngs), n, rngs=nnx.Rngs(0))


NNX = _nnx_stack()


def _nnx_short():
    short = _nnx_stack()
    short.layers.kernel = nnx.Param(short.layers.kernel[...][:2])
    return short


def _outer_rngs():
    outer = nnx.Rngs(1)
    stackwise.nnx.Stack(lambda rngs: nnx.Linear(2, 2, rngs=outer), 2, rngs=nnx.Rngs(0))


def _nnx_linear(kernel):
    linear = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    linear.kernel = nnx.Param(kernel)
    return linear


NNX_CASES = [
    case(
        "stack[i] of a variable with fewer layers than n",
        lambda: _nnx_short()[2],
        ValueError,
        "kernel (Param): shape (2, 4, 4)",
        "n=3",
    ),
    case(
        "to_layers() of a variable with fewer layers than n",
        lambda: _nnx_short().to_layers(),
        ValueError,
        "kernel (Param)",
    ),
    case("stack[True]", lambda: NNX[True], TypeError, "a layer index must be an int", "bool"),
    case("stack[0:2]", lambda: NNX[0:2], TypeError, "a layer index must be an int", "slice_layers"),
    case("stack[3] of 3 layers", lambda: NNX[3], IndexError, "layer 3", "n=3"),
    case(
        "make_block using an outer nnx.Rngs",
        _outer_rngs,
        TypeError,
        "an `nnx.Rngs` other than the one it is given",
        "lambda rngs: Block(..., rngs=rngs)",
    ),
    case(
        "from_layers(blocks, rngs=...)",
        lambda: stackwise.nnx.Stack.from_layers(NNX.to_layers(), rngs=nnx.Rngs(0)),
        TypeError,
        "`rngs=`",
        "already built",
    ),
    case(
        "from_layers of Linear(4, 4) and Linear(4, 5)",
        lambda: stackwise.nnx.Stack.from_layers(
            [nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 5, rngs=nnx.Rngs(0))]
        ),
        TypeError,
        "block 1",
        "`.out_features`: 4 vs 5",
    ),
    case(
        "from_layers of a kernel of another dtype",
        lambda: stackwise.nnx.Stack.from_layers(
            [_nnx_linear(jnp.ones((2, 2))), _nnx_linear(jnp.ones((2, 2), jnp.bfloat16))]
        ),
        TypeError,
        "block 1",
        "`.kernel` is bfloat16[2, 2] vs float32[2, 2]",
    ),
    case(
        "from_layers of NumPy int64 kernels, x64 off",
        lambda: stackwise.nnx.Stack.from_layers(
            [_nnx_linear(np.full((2, 2), 2**40, np.int64))] * 2
        ),
        TypeError,
        "kernel",
        "int64",
        "jax_enable_x64",
    ),
    case(
        "from_layers of a dict of blocks",
        lambda: stackwise.nnx.Stack.from_layers({"a": NNX[0]}),
        TypeError,
        "`blocks`",
    ),
    case(
        "layer_axis_name an int",
        lambda: stackwise.nnx.Stack(
            lambda rngs: nnx.Linear(2, 2, rngs=rngs), 2, rngs=nnx.Rngs(0), layer_axis_name=3
        ),
        TypeError,
        "`layer_axis_name`",
        "a str",
    ),
    case(
        "from_layers layer_axis_name a tuple",
        lambda: stackwise.nnx.Stack.from_layers(NNX.to_layers(), layer_axis_name=("a", "b")),
        TypeError,
        "`layer_axis_name`",
    ),
]


# --------------------------------------------------------------------------
# Haiku and linen.


class HkBlock(hk.Module):
    def __call__(self, x):
        return x + hk.Linear(4)(x)


def _hk_has_aux_without_aux():
    f = hk.transform(lambda x: stackwise.haiku.Stack(HkBlock, 2, has_aux=True)(x))
    f.init(KEY, X)


def _hk_fsdp_off_the_mesh():
    f = hk.transform(lambda x: stackwise.haiku.Stack(HkBlock, 2, fsdp="model")(x))
    params = jax.eval_shape(f.init, KEY, X)
    with jax.set_mesh(jax.make_mesh((1,), ("data",))):
        jax.eval_shape(f.apply, params, None, X)


HAIKU_FLAX = [
    case(
        "haiku has_aux=True, a block returning no aux",
        _hk_has_aux_without_aux,
        TypeError,
        "stackwise.haiku.Stack(HkBlock, n=2)",
        "`has_aux=True`",
        "one array float32[1, 4]",
    ),
    case(
        "haiku fsdp= an axis the mesh lacks",
        _hk_fsdp_off_the_mesh,
        ValueError,
        "`fsdp='model'`",
        "{'data': 1}",
    ),
    case(
        "linen Stack layer_axis_name an int",
        lambda: stackwise.flax.Stack(nn.Dense(4), 2, layer_axis_name=0).init(KEY, X),
        TypeError,
        "stackwise.flax.Stack(Dense, n=2)",
        "`layer_axis_name`",
    ),
    case(
        "linen Stack fsdp= a list with an int",
        lambda: stackwise.flax.Stack(nn.Dense(4), 2, fsdp=["data", 0]).init(KEY, X),
        TypeError,
        "`fsdp` must be a mesh axis name",
    ),
]


LOOP = {"params": {f"layers_{i}": {"kernel": jnp.ones((2, 2))} for i in range(3)}}
HK_LOOP = {f"block_{i}/linear": {"w": jnp.ones((2, 2))} for i in range(3)}

CONVERSIONS = [
    case(
        "linen from_loop names without {}",
        lambda: stackwise.flax.from_loop(LOOP, "blocks", "layers"),
        TypeError,
        "`names='layers'`",
        "'layers_{}'",
    ),
    case(
        "linen from_loop n=True",
        lambda: stackwise.flax.from_loop(LOOP, "blocks", "layers_{}", n=True),
        TypeError,
        "`n`",
        "bool",
    ),
    case(
        "linen from_loop n past the layers",
        lambda: stackwise.flax.from_loop(LOOP, "blocks", "layers_{}", n=4),
        ValueError,
        "n=4",
        "Pass n=3",
    ),
    case(
        "linen from_loop of a list",
        lambda: stackwise.flax.from_loop([1], "blocks", "l_{}"),
        TypeError,
        "`variables`",
        "got list",
    ),
    case(
        "linen to_loop path an int in a list",
        lambda: stackwise.flax.to_loop(LOOP, ["a", 3], "l_{}"),
        TypeError,
        "`path`",
        "got 3",
    ),
    case(
        "haiku from_loop path an int",
        lambda: stackwise.haiku.from_loop(HK_LOOP, 3, "block_{}"),
        TypeError,
        "`path`",
    ),
    case(
        "haiku from_loop names a dict",
        lambda: stackwise.haiku.from_loop(HK_LOOP, "stack", {"a": 1}),
        TypeError,
        "`names`",
    ),
    case(
        "haiku to_loop of leaves of two depths",
        lambda: stackwise.haiku.to_loop(
            {"stack/linear": {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}}, "stack", "block_{}"
        ),
        ValueError,
        "stack/linear/b: shape (2,)",
        "stack/linear/w: shape (3, 2)",
    ),
]


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", CONVERSIONS)
def test_misuse_conversions(call, error, words):
    assert_refused(call, error, words)


@pytest.mark.parametrize("call, error, words", EQUINOX)
def test_misuse_equinox(call, error, words):
    assert_refused(call, error, words)


@pytest.mark.parametrize("call, error, words", NNX_CASES)
def test_misuse_nnx(call, error, words):
    assert_refused(call, error, words)


@pytest.mark.parametrize("call, error, words", HAIKU_FLAX)
def test_misuse_haiku_and_flax(call, error, words):
    assert_refused(call, error, words)


# --------------------------------------------------------------------------
# What once went silently wrong or crashed, now right.


def _same(a, b):
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        jnp.array_equal(u, v) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def test_numpy_integer_depths_and_dtypes_kept_by_conversions():
    stacked = stackwise.flax.from_loop(LOOP, "blocks", "layers_{}", n=np.int64(3))
    assert stacked["params"]["blocks"]["kernel"].shape == (3, 2, 2)
    wide = {k: {"w": np.full((2, 2), 2**40, np.int64)} for k in HK_LOOP}
    w = stackwise.haiku.from_loop(wide, "stack", "block_{}")["stack/linear"]["w"]
    assert w.dtype == np.int64 and (w == 2**40).all()  # NumPy kept, never int32


def test_numpy_integer_indices_are_ints_in_every_adapter():
    for stack in (EQX, NNX):
        for i in (1, -1):
            assert _same(stack[np.int64(i)], stack[i])
            assert _same(stack[np.int32(i)], stack[i])


def test_equinox_numpy_and_jax_arrays_are_one_kind():
    weights = [np.arange(4.0, dtype=np.float32).reshape(2, 2), jnp.ones((2, 2))]
    stack = stackwise.equinox.Stack.from_layers([_linear(w) for w in weights])
    assert stack.layers.weight.dtype == jnp.float32
    assert _same(stack.layers.weight, jnp.stack([jnp.asarray(w) for w in weights]))


def test_abstract_trees_go_through_every_conversion():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.blocks = stackwise.nnx.Stack(lambda r: nnx.Linear(2, 2, rngs=r), 3, rngs=rngs)

    abstract = nnx.eval_shape(lambda: Model(nnx.Rngs(0)))
    state = nnx.state(abstract)
    loop = stackwise.nnx.to_loop(state, "blocks", "layers_{}")
    assert loop["layers_2"]["kernel"].get_value() == jax.ShapeDtypeStruct((2, 2), jnp.float32)
    back = stackwise.nnx.from_loop(loop, "blocks", "layers_{}")
    assert back["blocks"]["layers"]["kernel"].get_value().shape == (3, 2, 2)
    scan = stackwise.nnx.from_scan(stackwise.nnx.to_scan(state, "blocks"), "blocks")
    assert scan["blocks"]["layers"]["kernel"].get_value().shape == (3, 2, 2)
    layers = abstract.blocks.to_layers()
    assert layers[1].kernel.get_value() == jax.ShapeDtypeStruct((2, 2), jnp.float32)

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x):
            return stackwise.flax.Stack(nn.Dense(2), 3, name="blocks")(x)

    variables = jax.eval_shape(Linen().init, KEY, jnp.ones((1, 2)))

    class LinenLoop(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(3):
                x = nn.Dense(2, name=f"layers_{i}")(x)
            return x

    loop_variables = jax.eval_shape(LinenLoop().init, KEY, jnp.ones((1, 2)))
    ported = stackwise.flax.convert(loop_variables, LinenLoop(), Linen(), jnp.ones((1, 2)))
    assert ported == variables
    loop = stackwise.flax.to_loop(variables, "blocks", "layers_{}")
    assert loop["params"]["layers_1"]["kernel"] == jax.ShapeDtypeStruct((2, 2), jnp.float32)
    assert stackwise.flax.from_loop(loop, "blocks", "layers_{}") == variables
    assert (
        stackwise.flax.from_scan(stackwise.flax.to_scan(variables, "blocks"), "blocks") == variables
    )

    forward = hk.transform(lambda x: stackwise.haiku.Stack(HkBlock, 3)(x))
    params = jax.eval_shape(forward.init, KEY, X)
    loop = stackwise.haiku.to_loop(params, "stack", "block_{}")
    assert loop["block_2/hk_block/linear"]["w"] == jax.ShapeDtypeStruct((4, 4), jnp.float32)
    assert stackwise.haiku.from_loop(loop, "stack", "block_{}") == params
    layer_stack = stackwise.haiku.to_layer_stack(params, "stack")
    assert stackwise.haiku.from_layer_stack(layer_stack, "stack") == params


def test_abstract_blocks_stack_into_an_abstract_stack():
    blocks = [eqx.filter_eval_shape(partial(eqx.nn.Linear, 2, 3), key=KEY) for _ in range(3)]
    stack = stackwise.equinox.Stack.from_layers(blocks)
    assert stack.layers.weight == jax.ShapeDtypeStruct((3, 3, 2), jnp.float32)
    assert stack[2].weight == blocks[2].weight
    nnx_blocks = [nnx.eval_shape(lambda: nnx.Linear(2, 3, rngs=nnx.Rngs(0))) for _ in range(3)]
    nnx_stack = stackwise.nnx.Stack.from_layers(nnx_blocks)
    assert nnx_stack.layers.kernel.get_value() == jax.ShapeDtypeStruct((3, 2, 3), jnp.float32)
    assert nnx_stack[1].kernel.get_value() == nnx_blocks[1].kernel.get_value()


# --------------------------------------------------------------------------
# Building a Stack and its conversions: every error path one call can reach.


def _normed_blocks_and_states():
    made = [eqx.nn.make_with_state(_Normed)(KEY) for _ in range(2)]
    return [b for b, _ in made], [s for _, s in made]


def _states_not_states():
    blocks, states = _normed_blocks_and_states()
    stackwise.equinox.Stack.from_layers(blocks, [states[0], "state"])


def _states_of_another_block():
    blocks, states = _normed_blocks_and_states()
    other = eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, axis_name="batch", mode="ema")[1]
    stackwise.equinox.Stack.from_layers(blocks, [states[0], other])


NNX_TREE = {"blocks": {"layers": {"kernel": jnp.ones((3, 2, 2))}}}


def _in_haiku(make_stack):
    hk.transform(lambda x: make_stack()(x)).init(KEY, X)


BUILDING = [
    case(
        "Equinox Stack of no factories",
        lambda: stackwise.equinox.Stack([], 2, key=KEY),
        ValueError,
        "at least one block factory",
    ),
    case(
        "Equinox Stack of an int",
        lambda: stackwise.equinox.Stack(3, 2, key=KEY),
        TypeError,
        "`block` must be a function of a key",
    ),
    case(
        "Equinox factory that fails itself",
        lambda: stackwise.equinox.Stack(lambda key: eqx.nn.Linear(key=key), 2, key=KEY),
        TypeError,
        "in_features",
    ),
    case(
        "Equinox to_layers(state) of a dict",
        lambda: EQX.to_layers({}),
        TypeError,
        "`state` must be an eqx.nn.State",
        "dict",
    ),
    case(
        "Equinox from_layers with fewer states than blocks",
        lambda: stackwise.equinox.Stack.from_layers(EQX.to_layers(), [None]),
        ValueError,
        "3 blocks but 1 states",
    ),
    case(
        "Equinox from_layers states[1] not a State",
        _states_not_states,
        TypeError,
        "`states[1]`",
        "eqx.nn.State",
        "str",
    ),
    case(
        "Equinox from_layers states[1] of another block",
        _states_of_another_block,
        ValueError,
        "`states[1]` holds no values",
        "make_with_state",
    ),
    case(
        "NNX Stack of no make_block",
        lambda: stackwise.nnx.Stack([], 2, rngs=nnx.Rngs(0)),
        ValueError,
        "at least one `make_block`",
    ),
    case(
        "NNX Stack of an int",
        lambda: stackwise.nnx.Stack(3, 2, rngs=nnx.Rngs(0)),
        TypeError,
        "`make_block` must be a function of `rngs`",
    ),
    case(
        "NNX Stack of a built module",
        lambda: stackwise.nnx.Stack(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), 2, rngs=nnx.Rngs(0)),
        TypeError,
        "a built Linear module",
        "Stack.from_layers",
    ),
    case(
        "NNX Stack(nnx.Linear, n)",
        lambda: stackwise.nnx.Stack(nnx.Linear, 2, rngs=nnx.Rngs(0)),
        TypeError,
        "`make_block(rngs)` failed",
        "lambda rngs: nnx.Linear",
    ),
    case(
        "linen Stack of no blocks",
        lambda: stackwise.flax.Stack([], 2),
        ValueError,
        "at least one block",
    ),
    case(
        "linen Stack of a class missing arguments",
        lambda: stackwise.flax.Stack(nn.Dense, 2).init(KEY, X),
        TypeError,
        "building the block failed",
        "features",
    ),
    case(
        "Haiku Stack of no blocks",
        lambda: _in_haiku(lambda: stackwise.haiku.Stack([], 2)),
        ValueError,
        "at least one block",
    ),
    case(
        "Haiku block() returning no module",
        lambda: _in_haiku(lambda: stackwise.haiku.Stack(lambda: 3, 2)),
        TypeError,
        "`block()` must return a callable module",
        "int",
    ),
    case(
        "linen from_loop names giving no str",
        lambda: stackwise.flax.from_loop(LOOP, "blocks", lambda i: i),
        TypeError,
        "`names` must give a non-empty str",
    ),
    case(
        "linen from_loop n=0",
        lambda: stackwise.flax.from_loop(LOOP, "blocks", "layers_{}", n=0),
        ValueError,
        "`n` must be at least 1",
    ),
    case(
        "linen from_loop names list and another n",
        lambda: stackwise.flax.from_loop(LOOP, "blocks", ["layers_0", "layers_1", "layers_2"], n=2),
        ValueError,
        "n=2 but 3 names",
    ),
    case(
        "linen to_loop path []",
        lambda: stackwise.flax.to_loop(LOOP, [], "l_{}"),
        TypeError,
        "`path` lists its k positions",
    ),
    case(
        "linen to_scan variable_axes an int",
        lambda: stackwise.flax.to_scan(LOOP, "blocks", variable_axes=0),
        TypeError,
        "`variable_axes`",
    ),
    case(
        "Haiku to_loop of a list",
        lambda: stackwise.haiku.to_loop([1], "stack", "block_{}"),
        TypeError,
        "`tree` must be a Haiku params or state dict",
    ),
    case(
        "NNX to_loop of a pattern position inside another",
        lambda: stackwise.nnx.to_loop(NNX_TREE, ["blocks", "blocks/layers"], "l_{}"),
        ValueError,
        "position 1 (blocks.layers) lies inside position 0",
    ),
    case(
        "NNX from_loop of a layer inside another",
        lambda: stackwise.nnx.from_loop(
            {"l": {"kernel": jnp.ones((2, 2)), "x": {"kernel": jnp.ones((2, 2))}}},
            "blocks",
            ["l", "l/x"],
        ),
        ValueError,
        "layer 1 (l.x) lies inside layer 0",
    ),
    case(
        "Haiku to_loop of pattern positions no depth gives",
        lambda: stackwise.haiku.to_loop(
            {
                "stack/a/linear": {"w": jnp.ones((1, 2, 2))},
                "stack/c/linear": {"w": jnp.ones((3, 2, 2))},
            },
            ["stack/a", "stack/b", "stack/c"],
            "block_{}",
        ),
        ValueError,
        "position 0: 1, position 2: 3",
        "no depth gives",
    ),
    case(
        "Haiku from_loop pattern deeper than n",
        lambda: stackwise.haiku.from_loop(HK_LOOP, ["stack/a", "stack/b"], "block_{}", n=1),
        ValueError,
        "pattern of 2 blocks needs at least 2 layers",
    ),
    case(
        "NNX to_loop of a list",
        lambda: stackwise.nnx.to_loop([1], "blocks", "l_{}"),
        TypeError,
        "`tree` must be an `nnx.State`",
    ),
    case(
        "NNX to_loop path ''",
        lambda: stackwise.nnx.to_loop({}, "", "l_{}"),
        TypeError,
        "`path` must name a place in the state",
    ),
    case(
        "NNX to_loop path []",
        lambda: stackwise.nnx.to_loop({}, [], "l_{}"),
        TypeError,
        "`path` lists its k positions",
    ),
    case(
        "NNX to_scan variable_axes an int",
        lambda: stackwise.nnx.to_scan(NNX_TREE, "blocks", variable_axes=0),
        TypeError,
        "`variable_axes` maps NNX filters",
    ),
    case(
        "NNX Stack rngs=0",
        lambda: stackwise.nnx.Stack(lambda r: nnx.Linear(2, 2, rngs=r), 2, rngs=0),
        TypeError,
        "`rngs` must be an nnx.Rngs",
        "got int 0",
    ),
    case(
        "NNX to_scan variable_axes past the variable's axes",
        lambda: stackwise.nnx.to_scan(NNX_TREE, "blocks", variable_axes={...: 3}),
        ValueError,
        "blocks.layers.kernel",
        "without axis 3",
    ),
    case(
        "NNX to_loop of a pattern found nowhere",
        lambda: stackwise.nnx.to_loop(NNX_TREE, ["a", "b"], "l_{}"),
        ValueError,
        "nothing at the pattern's positions",
        "blocks.layers",
    ),
    case(
        "NNX convert of a function building no module",
        lambda: stackwise.nnx.convert(nnx.State({}), lambda: 3, lambda: 3),
        TypeError,
        "source model's function did not build a module",
    ),
    case(
        "linen from_scan of a variable without the layer axis",
        lambda: stackwise.flax.from_scan(
            {"params": {"blocks": {"kernel": jnp.ones(())}}}, "blocks"
        ),
        ValueError,
        "params/blocks['kernel']",
        "without the layer axis 0",
    ),
    case(
        "NNX to_scan variable_axes of a str axis",
        lambda: stackwise.nnx.to_scan(NNX_TREE, "blocks", variable_axes={nnx.Param: "x"}),
        TypeError,
        "must be an int axis or None",
    ),
]


@pytest.mark.parametrize("call, error, words", BUILDING)
def test_misuse_building(call, error, words):
    assert_refused(call, error, words)


def test_names_functions_past_the_last_layer_end_the_loop():
    # A function of the index may fail past the last layer (a list's IndexError): that is
    # where the loop ends, in every adapter.
    names = ["layers_0", "layers_1", "layers_2"]
    linen = stackwise.flax.from_loop(LOOP, "blocks", lambda i: names[i])
    assert linen["params"]["blocks"]["kernel"].shape == (3, 2, 2)
    haiku_names = ["block_0", "block_1", "block_2"]
    haiku = stackwise.haiku.from_loop(HK_LOOP, "stack", lambda i: haiku_names[i])
    assert haiku["stack/linear"]["w"].shape == (3, 2, 2)
    nnx_loop = {name: {"kernel": jnp.ones((2, 2))} for name in names}
    stacked = stackwise.nnx.from_loop(nnx_loop, "blocks", lambda i: names[i])
    assert stacked["blocks"]["layers"]["kernel"].shape == (3, 2, 2)
