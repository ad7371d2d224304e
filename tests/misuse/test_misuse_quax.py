"""The misuse catalogue of quax on `stackwise.equinox.Stack`: one row per bad call, the error it
must raise and words its message must hold (the leaf, and the fix)."""

from __future__ import annotations

from functools import partial

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from _misuse import assert_refused, case

import stackwise.equinox

quax = pytest.importorskip("quax")

KEY = jax.random.key(0)
STACK = stackwise.equinox.Stack(partial(eqx.nn.Linear, 4, 4), 3, key=KEY)
LORA = quax.examples.lora.loraify(STACK, rank=2, key=KEY)


def _outer_quaxify_under_remat():
    quax.quaxify(LORA)(jnp.ones(4))


def _outer_quaxify_of_a_pattern():
    pattern = stackwise.equinox.Stack.from_layers(LORA.to_layers(), pattern=2)
    quax.quaxify(pattern)(jnp.ones(4))


def _adapter_without_the_layer_axis():
    one = quax.examples.lora.loraify(STACK[0], rank=2, key=KEY).weight
    eqx.tree_at(lambda s: s.layers.weight, STACK, one)(jnp.ones(4))


CASES = [
    case("quax.quaxify(stack) under remat", _outer_quaxify_under_remat, TypeError,
         "`layers.weight`", "LoraArray", "jax.checkpoint",
         "stackwise.equinox.quaxify(model)(x)"),
    case("quax.quaxify(pattern stack)", _outer_quaxify_of_a_pattern, TypeError,
         "`layers[0].weight`", "stackwise.equinox.quaxify"),
    case("a LoraArray without the layer axis", _adapter_without_the_layer_axis, ValueError,
         "layers.weight._w"),
    case("stackwise.equinox.quaxify(3)", lambda: stackwise.equinox.quaxify(3), TypeError,
         "`fn`", "stackwise.equinox.quaxify(model)(x)"),
]


@pytest.mark.every_case
@pytest.mark.parametrize(("call", "error", "words"), CASES)
def test_misuse(call, error, words):
    assert_refused(call, error, words)
