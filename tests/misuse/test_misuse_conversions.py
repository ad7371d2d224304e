"""The misuse catalogue of ``convert`` and the conversions by name: the odd models that reach
every error path.

Each case is a model (or tree) of the odd shape a user could pass: a Stack nested in a Stack's
block, a leaf with fewer layers than its Stack, a pattern position's factory that builds a
helper module, fields that ``==`` cannot compare. The table asserts the error type and words
its message must hold (the leaf or argument, and the fix); after it, the odd inputs that are
not errors give the right result.
"""

from __future__ import annotations

import dataclasses
import functools
import operator

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
X = jnp.ones((1, 2))


@dataclasses.dataclass(frozen=True)
class Config:
    """A block's configuration holding an array: its `==` has no single truth value."""

    mask: np.ndarray


# --------------------------------------------------------------------------
# linen.


class Dense2(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(x)


class Nested(nn.Module):
    @nn.compact
    def __call__(self, x):
        inner = functools.partial(stackwise.flax.Stack, nn.Dense(2), 2)
        return stackwise.flax.Stack(inner, 2)(x)


class Normed(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.BatchNorm(use_running_average=False)(nn.Dense(2)(x))


class FreshInit(nn.Module):
    """A field built afresh for every block: a new initializer function each time."""

    kernel_init: object = dataclasses.field(default_factory=lambda: nn.initializers.normal(0.02))

    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(2, kernel_init=self.kernel_init)(x)


def _linen_loop(block, n=4):
    class Loop(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(n):
                x = block()(x)
            return x

    return Loop()


def _linen_pattern(blocks, n=4):
    class Port(nn.Module):
        @nn.compact
        def __call__(self, x):
            return stackwise.flax.Stack(blocks, n)(x)

    return Port()


def _linen_convert(source, target):  # shapes suffice: the error comes before any value moves
    return stackwise.flax.convert(jax.eval_shape(source.init, KEY, X), source, target, X)


LINEN_STACKED = {"params": {"layers": {"w": jnp.ones((3, 2))}, "head": jnp.ones(2)}}
LINEN_TWO_DEPTHS = {
    "params": {"layers": {"w": jnp.ones((3, 2))}},
    "batch_stats": {"layers": {"mean": jnp.ones((2, 2))}},
}


# --------------------------------------------------------------------------
# Haiku.


def _hk_nested(x):
    return stackwise.haiku.Stack(lambda: stackwise.haiku.Stack(lambda: hk.Linear(2), 2), 2)(x)


def _make_with_a_helper():
    hk.Linear(2, name="helper")(jnp.ones((1, 2)))  # built and run outside the position
    return hk.Linear(2)


def _hk_pattern_with_a_helper(x):
    return stackwise.haiku.Stack([_make_with_a_helper, lambda: hk.Linear(2)], 2)(x)


def _hk_with_a_table_of_its_own():
    """A transform whose init adds an entry by hand, not by `hk.get_parameter`."""
    f = hk.transform(lambda x: hk.Linear(2)(x))
    return hk.Transformed(lambda k, x: {**f.init(k, x), "table": {"w": jnp.zeros(2)}}, f.apply)


def _hk_convert(source, target):
    source, target = (
        m if isinstance(m, hk.Transformed) else hk.transform(m) for m in (source, target)
    )
    return stackwise.haiku.convert(jax.eval_shape(source.init, KEY, X), source, target, X)


# --------------------------------------------------------------------------
# NNX.


class Dense(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(2, 2, rngs=rngs)


class Proj(nnx.Module):
    def __init__(self, rngs):
        self.proj = nnx.Linear(2, 2, rngs=rngs)


class NnxLoop(nnx.Module):
    def __init__(self, rngs, n=3):
        self.layers = nnx.List([Dense(rngs) for _ in range(n)])


class NnxStack(nnx.Module):
    def __init__(self, rngs, block=Dense, n=3):
        self.layers = stackwise.nnx.Stack(block, n, rngs=rngs)


def _abstract(shape):
    return nnx.Param(jax.ShapeDtypeStruct(shape, jnp.float32))


class WithInnerStack(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(2, 2, rngs=rngs)
        self.inner = stackwise.nnx.Stack(lambda r: nnx.Linear(2, 2, rngs=r), 2, rngs=rngs)
        self.z = nnx.Linear(2, 2, rngs=rngs)


def _nnx_short_leaf():
    """A Stack of 3 layers whose bias holds 2 (abstract: shapes suffice)."""
    model = nnx.eval_shape(lambda: NnxStack(nnx.Rngs(0)))
    model.layers.layers.dense.bias = _abstract((2, 2))
    return model


@functools.cache
def _nnx_pattern_no_depth_gives():
    """A pattern [Dense, Proj] of 4 layers whose position 0 holds 1 layer, position 1 two."""
    model = nnx.eval_shape(lambda: NnxStack(nnx.Rngs(0), [Dense, Proj], 4))
    dense = model.layers.layers[0].dense
    dense.kernel, dense.bias = _abstract((1, 2, 2)), _abstract((1, 2))
    return model


def _nnx_convert(source, target):
    return stackwise.nnx.convert(nnx.state(source), source, target)  # target: maybe abstract


def _nnx_sharded_state():
    def make(rngs):
        init = nnx.with_partitioning(nnx.initializers.ones, ("embed", "mlp"))
        return nnx.Linear(2, 3, kernel_init=init, rngs=rngs)

    class Sharded(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([make(rngs) for _ in range(2)])

    with nnx.use_eager_sharding(False):
        loop = nnx.state(Sharded(nnx.Rngs(0)))
    return stackwise.nnx.from_loop(loop, "layers", layer_axis_name="stage")


class NnxConfigured(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(2, 2, rngs=rngs)
        self.config = Config(np.ones(2))


# --------------------------------------------------------------------------
# Equinox.


class EqxConfigured(eqx.Module):
    linear: eqx.nn.Linear
    config: Config = eqx.field(static=True)

    def __init__(self, key):
        self.linear = eqx.nn.Linear(2, 2, key=key)
        self.config = Config(np.ones(2))


CASES = [
    case(
        "linen convert of a Stack nested in a Stack's block",
        lambda: _linen_convert(Nested(), Dense2()),
        ValueError,
        "the source model nests a Stack in a Stack's block at Stack_0",
        "`from_loop` / `to_loop`",
    ),
    case(
        "linen convert between models of other collections",
        lambda: _linen_convert(Normed(), Dense2()),
        ValueError,
        "collections ['batch_stats', 'params'] but the target ['params']",
        "the same collections",
    ),
    case(
        "linen convert to a pattern of blocks with fields built afresh",
        lambda: _linen_convert(_linen_loop(FreshInit), _linen_pattern([FreshInit, FreshInit])),
        ValueError,
        "ran a block (FreshInit)",
        "`default_factory`",
        "template instances, `Stack([FreshInit(...), ...], n)`",
    ),
    case(
        "linen to_loop names through a variable",
        lambda: stackwise.flax.to_loop(LINEN_STACKED, "layers", "head/{}"),
        ValueError,
        "params/head exists and is not a module",
        "params/head/0",
        "choose other names",
    ),
    case(
        "linen to_loop of collections of two depths",
        lambda: stackwise.flax.to_loop(LINEN_TWO_DEPTHS, "layers", "layers_{}"),
        ValueError,
        "batch_stats/layers holds 2 layers but another collection holds 3",
        "one layer axis",
    ),
    case(
        "haiku convert of a Stack nested in a Stack's block",
        lambda: _hk_convert(_hk_nested, lambda x: hk.Linear(2)(x)),
        ValueError,
        "stack/stack/linear/b has shape (2, 2, 2)",
        "with shape (2,)",
        "`from_loop` / `to_loop`",
    ),
    case(
        "haiku convert of a pattern whose factory runs a helper module",
        lambda: _hk_convert(_hk_pattern_with_a_helper, _hk_pattern_with_a_helper),
        ValueError,
        "stack/helper/w",
        "none of its positions ['linear', 'linear_1']",
        "build and call other modules inside that module",
    ),
    case(
        "haiku convert of an init adding an entry by hand",
        lambda: _hk_convert(_hk_with_a_table_of_its_own(), lambda x: hk.Linear(2)(x)),
        ValueError,
        "params entry table/w was not created by `hk.get_parameter`",
        "add it back by hand",
    ),
    case(
        "nnx convert of a Stack nested in a Stack's block",
        lambda: _nnx_convert(
            nnx.eval_shape(lambda: NnxStack(nnx.Rngs(0), WithInnerStack, 2)),
            lambda: NnxStack(nnx.Rngs(0), WithInnerStack, 2),
        ),
        ValueError,
        "source model's stack ('layers', 'layers')",
        "at layers.layers.z.bias",
        "`from_loop` / `to_loop`",
    ),
    case(
        "nnx convert to a block of other attribute names",
        lambda: _nnx_convert(NnxLoop(nnx.Rngs(0)), lambda: NnxStack(nnx.Rngs(0), Proj)),
        ValueError,
        "layers.layers.proj.bias takes the source's layers.0.dense.bias",
        "keep the loop's attribute names",
    ),
    case(
        "nnx convert to a Stack whose leaf has fewer layers",
        lambda: _nnx_convert(NnxLoop(nnx.Rngs(0)), _nnx_short_leaf()),
        ValueError,
        "target model's stack ('layers', 'layers')",
        "layers.layers.dense.bias: 2",
        "layers.layers.dense.kernel: 3",
        "build the stack anew",
    ),
    case(
        "nnx convert of a pattern whose positions no depth gives",
        lambda: _nnx_convert(_nnx_pattern_no_depth_gives(), _nnx_pattern_no_depth_gives()),
        ValueError,
        "depths {0: [1], 1: [2]}",
        "layers.layers.0.dense.bias: 1",
        "Stack.from_layers(blocks)",
    ),
    case(
        "nnx to_scan of a layer axis named otherwise",
        lambda: stackwise.nnx.to_scan(_nnx_sharded_state(), "layers"),
        ValueError,
        "layers.layers.kernel has out_sharding ('stage', 'embed', 'mlp')",
        "named None",
        "`layer_axis_name`",
    ),
    case(
        "nnx from_layers of blocks whose configs `==` cannot compare",
        lambda: stackwise.nnx.Stack.from_layers(
            [NnxConfigured(nnx.Rngs(0)), NnxConfigured(nnx.Rngs(1))]
        ),
        TypeError,
        "block 1",
        "at `.config`",
        "`==` cannot compare",
        "share one object",
    ),
    case(
        "equinox from_layers of static configs `==` cannot compare",
        lambda: stackwise.equinox.Stack.from_layers([EqxConfigured(KEY), EqxConfigured(KEY)]),
        TypeError,
        "block 1",
        "at `.config`",
        "a static field, which `==` cannot compare",
        "one shared object",
    ),
    case(
        "equinox Stack of a partial inspect cannot bind",
        lambda: stackwise.equinox.Stack(
            functools.partial(eqx.nn.Linear, 2, 2, bogus=1), 2, key=KEY
        ),
        TypeError,
        "'bogus'",
    ),
]


@pytest.mark.parametrize("call, error, words", CASES)
def test_misuse_conversions(call, error, words):
    assert_refused(call, error, words)


# --------------------------------------------------------------------------
# Odd but right: no error, the right result.


def test_haiku_block_without_a_signature_runs_as_a_function_of_x():
    # `operator.methodcaller` has no signature to inspect: the block is a function of x.
    clip = operator.methodcaller("clip", -1.0, 1.0)
    f = hk.transform(lambda x: stackwise.haiku.Stack(clip, 2)(x))
    x = jnp.array([-3.0, 0.5, 3.0])
    assert f.init(KEY, x) == {}
    np.testing.assert_array_equal(f.apply({}, None, x), clip(clip(x)))


def test_linen_pattern_of_blocks_whose_fields_hold_arrays_converts():
    # Fields that `==` cannot compare: each position is told apart on its own.
    class Masked(nn.Module):
        config: Config

        @nn.compact
        def __call__(self, x):
            return x + nn.Dense(2)(x) * self.config.mask

    def block():
        return Masked(Config(np.ones((1, 2))))

    loop, port = _linen_loop(block), _linen_pattern([block(), block()])
    loop_vars = loop.init(KEY, X)
    variables = stackwise.flax.convert(loop_vars, loop, port, X)
    kernels = [loop_vars["params"][f"Masked_{i}"]["Dense_0"]["kernel"] for i in range(4)]
    np.testing.assert_array_equal(
        variables["params"]["Stack_0"]["Masked_1"]["Dense_0"]["kernel"], jnp.stack(kernels[1::2])
    )
    np.testing.assert_array_equal(port.apply(variables, X), loop.apply(loop_vars, X))
