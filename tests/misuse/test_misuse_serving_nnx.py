"""The misuse catalogue of the NNX Stack's serving layout (`Stack.to_serving()` /
`Stack.from_serving()`, in place): one row per bad call, the error it must raise and words its
message must hold (the Stack or variable, and the fix)."""

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
    stack = _stack()
    stack.to_serving()
    return stack


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
    stack.to_serving()


def _state_of_served():
    return nnx.state(_served())


def _quantize_served():
    abstract = nnx.eval_shape(_stack)
    stackwise.nnx.quantize_params(nnx.to_pure_dict(_state_of_served()), abstract)


WHO = "Stack(Linear, n=3)"

NNX = [
    case("nnx to_serving twice", lambda: _served().to_serving(), TypeError,
         f"{WHO}.to_serving", "already in the serving layout", "stack.from_serving()"),
    case("nnx from_serving of a stacked Stack", lambda: _stack().from_serving(), TypeError,
         f"{WHO}.from_serving", "not in the serving layout", "stack.to_serving()"),
    case("nnx to_serving of an fsdp Stack", lambda: _stack(fsdp="data").to_serving(),
         ValueError, "fsdp=", "Build the Stack without `fsdp`", "Stack.from_layers"),
    case("nnx to_serving of a nested-remat Stack", lambda: _stack(nested=True).to_serving(),
         ValueError, "`nested=True`", "Build the Stack without `nested`"),
    case("nnx to_serving of a variable without the layer axis", _unstacked, ValueError,
         WHO, "bias", "Stacked variables come from building the Stack"),
    case("nnx served Stack called with a stacked variable", lambda: _mixed(lambda s: s(X)),
         TypeError, WHO, "`layers['bias']` is one array float32[3, 4]", "not in the serving layout",
         "while `layers['kernel']` is served", "`to_serving`", "`from_serving`"),
    case("nnx from_serving with a stacked variable",
         lambda: _mixed(lambda s: s.from_serving()), TypeError, f"{WHO}.from_serving",
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
         lambda: _reshaped(lambda s: s.from_serving()), TypeError, f"{WHO}.from_serving",
         "holds layers of other shapes"),
    case("nnx to_loop of a served Stack's state",
         lambda: stackwise.nnx.to_loop(_state_of_served(), "layers"), TypeError,
         "stackwise.nnx.to_loop", "`layers.bias` is in the serving layout",
         "stack.from_serving()"),
    case("nnx convert of a served Stack's state",
         lambda: stackwise.nnx.convert(_state_of_served(), _stack, _stack), TypeError,
         "stackwise.nnx.convert", "in the serving layout", "stack.from_serving()"),
    case("nnx convert onto a served Stack",
         lambda: stackwise.nnx.convert(nnx.state(_stack()), _stack, _served()), TypeError,
         "stackwise.nnx.convert", "`layers.bias` is in the serving layout",
         "stack.from_serving()"),
    case("nnx quantize_params of a served Stack's params", _quantize_served, TypeError,
         "stackwise.nnx.quantize_params", "in the serving layout", "stack.from_serving()"),
]  # fmt: skip


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", NNX)
def test_misuse_serving_nnx(call, error, words):
    assert_refused(call, error, words)


def test_a_refused_call_leaves_the_served_stack_as_it_was():
    """from_serving checks every Variable before converting any."""
    stack = _served()
    stack.layers.bias.set_value(jnp.zeros((3, 4)))
    with pytest.raises(TypeError):
        stack.from_serving()
    assert isinstance(stack.layers.kernel.get_value(), stackwise.Serving)
