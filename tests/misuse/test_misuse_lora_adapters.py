"""The misuse catalogue of `stackwise.lora` / `stackwise.quant` on the adapters' Stacks: one
row per bad call, the error it must raise and words its message must hold."""

from __future__ import annotations

from functools import partial

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import pytest
from _misuse import assert_refused, case
from flax import nnx

import stackwise
import stackwise.equinox
import stackwise.flax
import stackwise.haiku
import stackwise.nnx

KEY = jax.random.key(0)
X = jnp.ones((2, 4))
EQX = stackwise.equinox.Stack(partial(eqx.nn.Linear, 4, 4), 3, key=KEY)
HK = hk.transform(lambda x: stackwise.haiku.Stack(lambda x: hk.Linear(4)(x), n=3)(x))
HK_PARAMS = HK.init(KEY, X)


def _batch(base, g=2, targets=None):
    one = stackwise.lora.init(KEY, base, rank=2, targets=targets)
    return stackwise.lora.attach(base, stackwise.lora.stack_adapters([one] * g), per_leaf=True)


WEIGHTS = lambda path, shape: path.endswith("['w']") or "kernel" in path  # noqa: E731
XS = jnp.ones((2, 3, 4))  # (g=2 groups, 3 rows, d)


class LinenNormed(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.BatchNorm(use_running_average=False)(nn.Dense(4)(x))


def _linen_batch_statistics():
    stack = stackwise.flax.Stack(LinenNormed, n=3)
    variables = stack.init(KEY, X)
    params = _batch(variables["params"], targets=WEIGHTS)
    stack.apply({**variables, "params": params}, XS, mutable=["batch_stats"])


def _haiku_batch_statistics():
    def block(x):
        return hk.BatchNorm(True, True, 0.9)(hk.Linear(4)(x), is_training=True)

    forward = hk.transform_with_state(lambda x: stackwise.haiku.Stack(block, n=3)(x))
    params, state = forward.init(KEY, X)
    forward.apply(_batch(params, targets=WEIGHTS), state, None, XS)


class NnxNormed(nnx.Module):
    def __init__(self, rngs):
        self.linear, self.norm = nnx.Linear(4, 4, rngs=rngs), nnx.BatchNorm(4, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.linear(x))


def _nnx_batch_statistics():
    graphdef, params, rest = nnx.split(stackwise.nnx.Stack(NnxNormed, 3, rngs=nnx.Rngs(0)),
                                       nnx.Param, ...)
    nnx.merge(graphdef, _batch(params, targets=WEIGHTS), rest)(XS)


class EqxNormed(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm

    def __init__(self, key):
        self.linear = eqx.nn.Linear(4, 4, key=key)
        self.norm = eqx.nn.BatchNorm(4, "rows", mode="batch")

    def __call__(self, x, state):
        return self.norm(self.linear(x), state)


def _equinox_batch_statistics():
    make = eqx.nn.make_with_state(stackwise.equinox.Stack)
    stack, state = make(EqxNormed, 3, key=KEY, with_state=True)
    arrays, static = eqx.partition(stack, eqx.is_array)
    adapted = _batch(arrays, targets=lambda path, shape: "linear.weight" in path)
    batch = eqx.combine(static, adapted)  # (static first: its None covers an adapted node)
    jax.vmap(batch, in_axes=(1, None), out_axes=(1, None), axis_name="rows")(XS, state)


class LinenTwo(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="up")(x) + nn.Dense(4, name="down")(x)


def _two_batch_sizes_in_a_layer():
    stack = stackwise.flax.Stack(LinenTwo, n=3)
    params = stack.init(KEY, X)["params"]
    two = {"up": _batch(params["up"], 2, WEIGHTS), "down": _batch(params["down"], 3, WEIGHTS)}
    stack.apply({"params": two}, XS)


def _adapters_of_another_depth():
    short = eqx.tree_at(lambda s: s.layers.weight, EQX, EQX.layers.weight[:2])
    stackwise.lora.attach(EQX, stackwise.lora.init(KEY, short, rank=2), per_leaf=True)


def _a_node_without_the_layer_axis():
    lw = stackwise.lora.init(KEY, EQX, rank=2).layers.weight
    node = stackwise.lora.attach(EQX.layers.weight, lw, per_leaf=True)
    bad = eqx.tree_at(lambda s: s.layers.weight, EQX, jax.tree.map(lambda v: v[0], node))
    bad(jnp.ones(4))


CASES = [
    case("a batch of 3 adapters on a Haiku Stack's x of 2 groups",
         lambda: HK.apply(_batch(HK_PARAMS, 3), None, X), ValueError, "stackwise.haiku.Stack",
         "a batch of 3 adapters", "`x` has shape (2, 4)", "g=3", "x.reshape(3, -1", "v[j]"),
    case("a batch of adapters on an Equinox Stack's one example",
         lambda: _batch(EQX)(jnp.ones(4)), ValueError, "stackwise.equinox.Stack",
         "a batch of 2 adapters", "`x` has shape (4,)", "g=2"),
    case("a batch of adapters updating Linen batch statistics", _linen_batch_statistics,
         ValueError, "stackwise.flax.Stack", "batch of 2 adapters",
         "new state['batch_stats']", "different for each group", "use_running_average=True"),
    case("a batch of adapters updating Haiku state", _haiku_batch_statistics, ValueError,
         "stackwise.haiku.Stack", "batch of 2 adapters", "new state", "different for each group"),
    case("a batch of adapters updating NNX batch statistics", _nnx_batch_statistics,
         ValueError, "stackwise.nnx.Stack", "batch of 2 adapters", "new state['norm']['mean']",
         "different for each group"),
    case("a batch of adapters updating an eqx.nn.State", _equinox_batch_statistics,
         ValueError, "stackwise.equinox.Stack", "batch of 2 adapters", "new state",
         "different for each group"),
    case("batches of two sizes in one layer of a Linen Stack", _two_batch_sizes_in_a_layer,
         ValueError, "stackwise.flax.Stack", "batch sizes [2, 3]",
         "the same batch of adapters"),
    case("attach(per_leaf=1)", lambda: stackwise.lora.attach(
        EQX, stackwise.lora.init(KEY, EQX, rank=2), per_leaf=1), TypeError, "`per_leaf`"),
    case("per-leaf adapters of another depth", _adapters_of_another_depth, ValueError,
         "adapters of another depth", "n=3"),
    case("an adapted leaf without the layer axis", _a_node_without_the_layer_axis, ValueError,
         "layers.weight.base", "n=3"),
]


@pytest.mark.every_case
@pytest.mark.parametrize(("call", "error", "words"), CASES)
def test_misuse(call, error, words):
    assert_refused(call, error, words)
