"""The misuse catalogue of `stackwise.lora` / `stackwise.quant` on the adapters' Stacks: one
row per bad call, the error it must raise and words its message must hold."""

from __future__ import annotations

from functools import partial

import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp
import pytest
from _misuse import assert_refused, case

import stackwise
import stackwise.equinox
import stackwise.haiku

KEY = jax.random.key(0)
X = jnp.ones((2, 4))
EQX = stackwise.equinox.Stack(partial(eqx.nn.Linear, 4, 4), 3, key=KEY)
HK = hk.transform(lambda x: stackwise.haiku.Stack(lambda x: hk.Linear(4)(x), n=3)(x))
HK_PARAMS = HK.init(KEY, X)


def _batch(base):
    one = stackwise.lora.init(KEY, base, rank=2)
    return stackwise.lora.attach(base, stackwise.lora.stack_adapters([one, one]), per_leaf=True)


def _adapters_of_another_depth():
    short = eqx.tree_at(lambda s: s.layers.weight, EQX, EQX.layers.weight[:2])
    stackwise.lora.attach(EQX, stackwise.lora.init(KEY, short, rank=2), per_leaf=True)


def _a_node_without_the_layer_axis():
    lw = stackwise.lora.init(KEY, EQX, rank=2).layers.weight
    node = stackwise.lora.attach(EQX.layers.weight, lw, per_leaf=True)
    bad = eqx.tree_at(lambda s: s.layers.weight, EQX, jax.tree.map(lambda v: v[0], node))
    bad(jnp.ones(4))


CASES = [
    case("a batch of adapters on a Haiku Stack", lambda: HK.apply(_batch(HK_PARAMS), None, X),
         ValueError, "stackwise.haiku.Stack", "a batch of 2 adapters", "v[j]",
         "stackwise.lora.stack(apply, n)"),
    case("a batch of adapters on an Equinox Stack", lambda: _batch(EQX)(jnp.ones(4)),
         ValueError, "stackwise.equinox.Stack", "a batch of 2 adapters"),
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
