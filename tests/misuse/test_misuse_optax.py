"""The misuse catalogue of `stackwise.optax`: each bad input, the error type, and what the
message must name (the argument or leaf) and the fix it gives. The errors come when the
wrapper is built where they can (the transform, the layers, the scales), else at ``init`` /
``update``, before any optimizer runs."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stackwise.optax as so

PARAMS = {"blocks": {"w": jnp.ones((4, 3, 3))}, "embed": jnp.ones((5, 3))}
STACKED = {"blocks": True, "embed": False}


def _init(tx, params=PARAMS):
    return lambda: tx().init(params)


def _step(tx, state_of, params=PARAMS):
    def run():
        state = state_of().init(params)
        return tx().update(params, state, params)
    return run


def _module_without_stack():
    from flax import nnx

    return nnx.Linear(2, 2, rngs=nnx.Rngs(0))


PATTERN = ({"w": jnp.ones((3, 2))}, {"v": jnp.ones((2, 2))})  # n=5, k=2: 3 and 2 layers


CASES = {
    # name: (call, error type, what the message names)
    "transform is the factory, not called": (
        lambda: so.layerwise(optax.adam), TypeError, ["`transform`", "optax.adam(1e-3)"]),
    "transform is not a transformation": (
        lambda: so.layerwise({"lr": 1e-3}), TypeError, ["`transform`", "dict"]),
    "stacked is a string": (
        _init(lambda: so.layerwise(optax.adam(1e-3), "blocks")), TypeError,
        ["`stacked`", "['blocks']['w']", "'blocks'"]),
    "stacked is a negative depth": (
        _init(lambda: so.layerwise(optax.adam(1e-3), -1)), TypeError, ["`stacked`", "-1"]),
    "stacked tree does not match the params": (
        _init(lambda: so.layerwise(optax.adam(1e-3), {"blocks": True})), ValueError,
        ["`stacked`", "structure", "embed"]),
    "stacked function returns a string": (
        _init(lambda: so.layerwise(optax.adam(1e-3), lambda path: path)), TypeError,
        ["`stacked`", "['blocks']['w']", "bool"]),
    "a leaf with fewer axes than its layer axes": (
        _init(lambda: so.layerwise(optax.lamb(1e-3), stacked=3)), ValueError,
        ["['embed']", "(5, 3)", "3 leading layer axes"]),
    "state of the unwrapped optimizer (another structure)": (
        _step(lambda: so.layerwise(optax.contrib.muon(1e-3), STACKED),
              lambda: optax.contrib.muon(1e-3)), ValueError, ["optimizer state", "`init`"]),
    "state of the unwrapped optimizer (other shapes)": (
        _step(lambda: so.layerwise(optax.adafactor(1e-3, min_dim_size_to_factor=2), STACKED),
              lambda: optax.adafactor(1e-3, min_dim_size_to_factor=2)), ValueError,
        ["optimizer state leaf", "stacked like its leaf", "wrapped optimizer's `init`"]),
    "freeze names a layer the stack lacks": (
        _step(lambda: so.layerwise(optax.adam(1e-3), STACKED, freeze=[4]),
              lambda: so.layerwise(optax.adam(1e-3), STACKED)), IndexError,
        ["`freeze`", "layer 4", "['blocks']['w']", "4 layers", "-4..3"]),
    "freeze names a layer before the first": (
        _step(lambda: so.layerwise(optax.adam(1e-3), STACKED, freeze=[-5]),
              lambda: so.layerwise(optax.adam(1e-3), STACKED)), IndexError,
        ["`freeze`", "layer -5", "['blocks']['w']", "-4..3"]),
    "freeze is a number": (
        lambda: so.layerwise(optax.adam(1e-3), freeze=1.5), TypeError, ["`freeze`", "range(2)"]),
    "freeze holds strings": (
        lambda: so.layerwise(optax.adam(1e-3), freeze="01"), TypeError, ["`freeze[0]`", "'0'"]),
    "freeze holds a bool": (
        lambda: so.layerwise(optax.adam(1e-3), freeze=[1, True]), TypeError,
        ["`freeze[1]`", "bool"]),
    "freeze holds a float": (
        lambda: so.layerwise(optax.adam(1e-3), freeze=[1.0]), TypeError,
        ["`freeze[0]`", "float"]),
    "lr_scale of the wrong length": (
        _step(lambda: so.layerwise(optax.adam(1e-3), STACKED, lr_scale=[1.0, 0.5, 0.25]),
              lambda: so.layerwise(optax.adam(1e-3), STACKED)), ValueError,
        ["`lr_scale`", "3 values", "['blocks']['w']", "4 layers"]),
    "lr_scale is a matrix": (
        lambda: so.layerwise(optax.adam(1e-3), lr_scale=[[1.0, 2.0]]), TypeError,
        ["`lr_scale`", "layer_decay"]),
    "lr_scale is text": (
        lambda: so.layerwise(optax.adam(1e-3), lr_scale="decay"), TypeError, ["`lr_scale`"]),
    "layer_mask names a layer the stack lacks": (
        _step(lambda: so.layer_mask(optax.add_decayed_weights(1e-4), [7], STACKED),
              lambda: so.layer_mask(optax.add_decayed_weights(1e-4), [7], STACKED)), IndexError,
        ["`layers`", "layer 7", "['blocks']['w']"]),
    "layer_mask layers holds a string": (
        lambda: so.layer_mask(optax.add_decayed_weights(1e-4), [0, "1"]), TypeError,
        ["`layers[1]`", "'1'"]),
    "layer_mask of the factory": (
        lambda: so.layer_mask(optax.add_decayed_weights, [0]), TypeError, ["`transform`"]),
    "layer_mask layers is not a collection": (
        lambda: so.layer_mask(optax.add_decayed_weights(1e-4), None), TypeError, ["`layers`"]),
    "layer_decay above 1": (
        lambda: so.layer_decay(1.5, 4), ValueError, ["`decay`", "(0, 1]", "1.5"]),
    "layer_decay of no layers": (
        lambda: so.layer_decay(0.8, 0), ValueError, ["`n`", "at least 1", "0"]),
    "layer_decay of a bool n": (lambda: so.layer_decay(0.8, True), TypeError, ["`n`", "bool"]),
    "layer_decay of a float n": (lambda: so.layer_decay(0.8, 4.0), TypeError, ["`n`", "4.0"]),
    "stacked is a float depth": (
        _init(lambda: so.layerwise(optax.adam(1e-3), {"blocks": 1.0, "embed": False})),
        TypeError, ["`stacked`", "['blocks']['w']", "1.0"]),
    "a params leaf that is not an array": (
        _init(lambda: so.layerwise(optax.lamb(1e-3), {"blocks": True, "embed": False}),
              {"blocks": PARAMS["blocks"], "embed": "embed"}), TypeError,
        ["leaf ['embed']", "str", "not an array"]),
    "muon_dimensions of a leaf that is not an array": (
        lambda: so.muon_dimensions()({"w": jnp.ones((4, 3, 3)), "name": "w"}), TypeError,
        ["stackwise.optax.muon_dimensions", "leaf ['name']", "not an array"]),
    "pattern of no positions": (lambda: so.pattern(5, 0), ValueError, ["`k`", "at least 1"]),
    "pattern of fewer layers than positions": (
        lambda: so.pattern(1, 2), ValueError, ["`n`", "at least 2"]),
    "pattern of a float n": (lambda: so.pattern(5.0, 2), TypeError, ["`n`", "5.0"]),
    "pattern positions of another n": (
        _init(lambda: so.layerwise(optax.adam(1e-3), so.pattern(6, 2)), PATTERN), ValueError,
        ["leaf [1]['v']", "2 layers", "position 1", "n=6", "pattern(n, k)"]),
    "freeze beyond a pattern's layers": (
        _step(lambda: so.layerwise(optax.adam(1e-3), so.pattern(5, 2), freeze=[5]),
              lambda: so.layerwise(optax.adam(1e-3), so.pattern(5, 2)), PATTERN), IndexError,
        ["`freeze`", "layer 5", "leaf [0]['w']", "pattern of 5 layers"]),
    "lr_scale per row of a pattern position": (
        _step(lambda: so.layerwise(optax.adam(1e-3), so.pattern(5, 2), lr_scale=[1.0] * 3),
              lambda: so.layerwise(optax.adam(1e-3), so.pattern(5, 2)), PATTERN), ValueError,
        ["`lr_scale`", "3 values", "position 0 of a pattern of 5 layers"]),
    "Muon's part given no dimension numbers for a stacked vector": (
        _step(lambda: so.layerwise(optax.contrib.scale_by_muon(), True),
              lambda: so.layerwise(optax.contrib.scale_by_muon(), True),
              {"b": jnp.ones((4, 3))}), ValueError,
        ["Muon's leaf ['b']", "(3,)", "`weight_dimension_numbers`", "contrib.muon"]),
    "freeze with stacked=False": (
        lambda: so.layerwise(optax.adam(1e-3), False, freeze=[0]), ValueError,
        ["`freeze`", "`stacked` (False)", "marks no leaf", "stacked_in(model)", "drop `freeze`"]),
    "freeze with a stacked= tree that marks no leaf": (
        _init(lambda: so.layerwise(optax.adam(1e-3), {"blocks": False, "embed": False},
                                   freeze=[0])), ValueError,
        ["`freeze`", "marks no leaf", "{'blocks': True, 'embed': False}"]),
    "freeze with a stacked= function that matches no path": (
        _step(lambda: so.layerwise(optax.adam(1e-3), lambda path: "layers" in path, freeze=[0]),
              lambda: so.layerwise(optax.adam(1e-3), lambda path: "layers" in path)),
        ValueError, ["`freeze`", "marks no leaf", "lambda path"]),
    "lr_scale with stacked=False": (
        lambda: so.layerwise(optax.adam(1e-3), False, lr_scale=[1.0, 0.5]), ValueError,
        ["`lr_scale`", "`stacked` (False)", "marks no leaf", "drop `lr_scale`"]),
    "lr_scale holding inf": (
        lambda: so.layerwise(optax.adam(1e-3), lr_scale=[1.0, float("inf"), 1.0, 1.0]),
        ValueError, ["`lr_scale[1]`", "inf", "finite"]),
    "lr_scale holding NaN": (
        lambda: so.layerwise(optax.adam(1e-3), lr_scale=np.array([np.nan, 1.0])), ValueError,
        ["`lr_scale[0]`", "nan", "finite"]),
    "lr_scale of complex numbers": (
        lambda: so.layerwise(optax.adam(1e-3), lr_scale=[1j, 1.0]), TypeError,
        ["`lr_scale`", "real numbers", "layer_decay"]),
    "layer_mask with stacked=False": (
        lambda: so.layer_mask(optax.add_decayed_weights(1e-4), [0], False), ValueError,
        ["stackwise.optax.layer_mask", "`layers`", "marks no leaf"]),
    "layer_mask inside a MultiSteps inside layerwise": (
        _init(lambda: so.layerwise(optax.MultiSteps(optax.chain(
            optax.adam(1e-3), so.layer_mask(optax.add_decayed_weights(1e-4), [0], STACKED)),
            every_k_schedule=2).gradient_transformation(), STACKED)), ValueError,
        ["stackwise.optax.layer_mask", "nested inside", "optax.MultiSteps",
         "optax.MultiSteps(stackwise.optax.layerwise(tx, ...), k)"]),
    "layerwise inside an apply_if_finite inside layerwise": (
        _init(lambda: so.layerwise(optax.apply_if_finite(
            so.layerwise(optax.lamb(1e-3), STACKED, freeze=[0]), 2), STACKED)), ValueError,
        ["stackwise.optax.layerwise", "nested inside", "optax.apply_if_finite"]),
    "stacked_in of a params dict": (
        lambda: so.stacked_in(PARAMS), TypeError, ["`model`", "dict", "stacked="]),
    "stacked_in of a module without a Stack": (
        lambda: so.stacked_in(_module_without_stack()), TypeError,
        ["`model`", "Linear", "no stackwise Stack"]),
}


@pytest.mark.every_case
@pytest.mark.parametrize("case", list(CASES))
def test_misuse(case):
    call, error, names = CASES[case]
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert message.startswith("stackwise.optax."), message
    for name in names:
        assert name in message, f"{name!r} not in: {message}"
