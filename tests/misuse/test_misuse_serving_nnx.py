"""The misuse catalogue of the NNX Stack's serving layout (`stackwise.nnx.to_serving` /
`from_serving`, each giving a new model; the Stack's old in-place methods refused): one row per
bad call, the error it must raise and words its message must hold (the Stack or variable, and
the fix)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from _misuse import assert_refused, case
from flax import nnx

import stackwise
import stackwise.nnx

X = jnp.ones((1, 4))


def _stack(**options):
    return stackwise.nnx.Stack(
        lambda rngs: nnx.Linear(4, 4, rngs=rngs), 3, rngs=nnx.Rngs(0), **options
    )


def _served():
    return stackwise.nnx.to_serving(_stack())


class Model(nnx.Module):
    def __init__(self):
        self.embed = nnx.Linear(4, 4, rngs=nnx.Rngs(1))
        self.blocks = _stack()


def _mixed(call):
    """A served Stack with one Variable set back to a stacked array."""
    stack = _served()
    stack.layers.bias.set_value(jnp.zeros((3, 4)))
    call(stack)


def _shallow(call):
    """A served Stack with one Variable serving 2 layers of the Stack's 3."""
    stack = _served()
    kernel = stack.layers.kernel
    kernel.set_value(stackwise.Serving(kernel.get_value().layers[:2]))
    call(stack)


def _reshaped(call):
    """A served Stack with one layer's buffer of a Variable set to another shape."""
    stack = _served()
    layers = list(stack.layers.kernel.get_value().layers)
    layers[2] = jnp.ones((4, 5))
    stack.layers.kernel.set_value(stackwise.Serving(layers))
    call(stack)


def _unstacked():
    stack = _stack()
    stack.layers.bias.set_value(jnp.zeros((4,)))  # the layer axis lost
    stackwise.nnx.to_serving(stack)


def _state_of_served():
    return nnx.state(_served())


def _quantize_served():
    abstract = nnx.eval_shape(_stack)
    stackwise.nnx.quantize_params(nnx.to_pure_dict(_state_of_served()), abstract)


WHO = "stackwise.nnx.Stack(Linear, n=3)"
TO, FROM = stackwise.nnx.to_serving, stackwise.nnx.from_serving

NNX = [
    case("nnx to_serving twice", lambda: TO(_served()), TypeError,
         f"stackwise.nnx.to_serving: {WHO}", "already in the serving layout",
         "`stackwise.nnx.from_serving(module, path)`"),
    case("nnx from_serving of a stacked Stack", lambda: FROM(_stack()), TypeError,
         f"stackwise.nnx.from_serving: {WHO}", "not in the serving layout",
         "`stackwise.nnx.to_serving(module, path)`"),
    case("nnx to_serving at a model's Stack served already",
         lambda: TO(TO(Model(), "blocks"), "blocks"), TypeError, "already in the serving layout"),
    case("nnx to_serving of an fsdp Stack", lambda: TO(_stack(fsdp="data")),
         ValueError, "fsdp=", "Build the Stack without `fsdp`", "Stack.from_layers"),
    case("nnx to_serving of a nested-remat Stack", lambda: TO(_stack(nested=True)),
         ValueError, "`nested=True`", "Build the Stack without `nested`"),
    case("nnx to_serving of a model, without path", lambda: TO(Model()), TypeError,
         "stackwise.nnx.to_serving", "`module` is a Model, not a `stackwise.nnx.Stack`",
         "give `path`", "its Stacks: 'blocks'", "to_serving(model, 'blocks')"),
    case("nnx to_serving at a path with no Stack", lambda: TO(Model(), "embed"), ValueError,
         "holds no `stackwise.nnx.Stack` at 'embed'", "its Stacks are at: 'blocks'"),
    case("nnx from_serving at a path not in the model", lambda: FROM(Model(), "decoder.blocks"),
         ValueError, "stackwise.nnx.from_serving", "at 'decoder/blocks'",
         "its Stacks are at: 'blocks'"),
    case("nnx to_serving with a list of paths", lambda: TO(Model(), ["blocks"]), TypeError,
         "`path` is one place", "an NNX or Equinox Stack knows its own"),
    case("nnx to_serving with a path that names no place", lambda: TO(Model(), ""), TypeError,
         "`path` must name a place", "Leave `path` out"),
    case("nnx to_serving of a state, not a module", lambda: TO(nnx.state(_stack())), TypeError,
         "`module` must be an `nnx.Module`", "got State", "`nnx.merge` it"),
    case("nnx Stack.to_serving(), the old in-place method", lambda: _stack().to_serving(),
         TypeError, f"{WHO}.to_serving()", "no longer converted", "in place",
         "every module sharing its Variables", "`stackwise.nnx.to_serving(stack)`"),
    case("nnx Stack.from_serving(), the old in-place method", lambda: _served().from_serving(),
         TypeError, f"{WHO}.from_serving()", "`stackwise.nnx.from_serving(stack)`"),
    case("nnx to_serving of a variable without the layer axis", _unstacked, ValueError,
         WHO, "bias", "Stacked variables come from building the Stack"),
    case("nnx served Stack called with a stacked variable", lambda: _mixed(lambda s: s(X)),
         TypeError, WHO, "`layers['bias']` is one array float32[3, 4]", "not in the serving layout",
         "while `layers['kernel']` is served", "`to_serving`", "`from_serving`"),
    case("nnx from_serving with a stacked variable",
         lambda: _mixed(FROM), TypeError, f"stackwise.nnx.from_serving: {WHO}",
         "`layers['bias']`", "not in the serving layout"),
    case("nnx served variable of another depth", lambda: _shallow(lambda s: s(X)), ValueError,
         "`layers['kernel']` holds 2 layers", "the Stack (n=3) runs 3",
         "convert this Stack's own stacked variables"),
    case("nnx layer of a served variable of another depth",
         lambda: _shallow(lambda s: s[0]), ValueError, "`layers['kernel']` holds 2 layers"),
    case("nnx served layer of another shape", lambda: _reshaped(lambda s: s(X)), TypeError,
         "the served `layers['kernel']` holds layers of other shapes", "float32[4, 5] in its "
         "layer 2", "float32[4, 4] in its layer 0", "rebuild the Stack"),
    case("nnx from_serving of a layer of another shape",
         lambda: _reshaped(FROM), TypeError, f"stackwise.nnx.from_serving: {WHO}",
         "holds layers of other shapes"),
    case("nnx to_loop of a served Stack's state",
         lambda: stackwise.nnx.to_loop(_state_of_served(), "layers"), TypeError,
         "stackwise.nnx.to_loop", "`layers.bias` is in the serving layout",
         "`model = stackwise.nnx.from_serving(model, path)`"),
    case("nnx convert of a served Stack's state",
         lambda: stackwise.nnx.convert(_state_of_served(), _stack, _stack), TypeError,
         "stackwise.nnx.convert", "in the serving layout", "stackwise.nnx.from_serving"),
    case("nnx convert onto a served Stack",
         lambda: stackwise.nnx.convert(nnx.state(_stack()), _stack, _served()), TypeError,
         "stackwise.nnx.convert", "`layers.bias` is in the serving layout",
         "stackwise.nnx.from_serving"),
    case("nnx quantize_params of a served Stack's params", _quantize_served, TypeError,
         "stackwise.nnx.quantize_params", "in the serving layout", "stackwise.nnx.from_serving"),
]  # fmt: skip


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", NNX)
def test_misuse_serving_nnx(call, error, words):
    assert_refused(call, error, words)


def test_a_refused_call_leaves_the_served_stack_as_it_was():
    """from_serving converts a clone, after checking every Variable: the given Stack keeps
    its Variables and values whatever happens."""
    stack = _served()
    stack.layers.bias.set_value(jnp.zeros((3, 4)))
    kernel = stack.layers.kernel
    with pytest.raises(TypeError):
        stackwise.nnx.from_serving(stack)
    assert stack.layers.kernel is kernel and isinstance(kernel.get_value(), stackwise.Serving)
