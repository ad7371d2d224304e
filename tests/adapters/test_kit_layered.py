"""The adapter kit's search for a value's layer axes (`stackwise/_kit/layered.py`,
``map_layers``): a function that cannot take the whole value (it raises there) is tried on
each layer, and the result is each layer's own, stacked; no number of axes that fits is named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stackwise._kit.layered import map_layers


def per_layer_square(w, a):
    """A layer's (4,) weight as the (2, 2) that ``a`` says: raises on a stack of them."""
    return w.reshape(2, 2) * jnp.ones(a.shape, w.dtype)


def test_a_function_that_raises_on_the_whole_stack_is_mapped_over_its_layers():
    value = jnp.arange(12.0).reshape(3, 4)
    out = map_layers(per_layer_square, value, jax.ShapeDtypeStruct((3, 2, 2), jnp.float32),
                     "who", "w")
    np.testing.assert_array_equal(out, np.arange(12.0).reshape(3, 2, 2))
    # two layer axes (a nested stack): the same, layer by layer
    nested = map_layers(per_layer_square, value.reshape(1, 3, 4),
                        jax.ShapeDtypeStruct((1, 3, 2, 2), jnp.float32), "who", "w")
    np.testing.assert_array_equal(nested, np.arange(12.0).reshape(1, 3, 2, 2))


def test_no_number_of_layer_axes_that_fits_is_named():
    with pytest.raises(ValueError, match=r"who: `w` of shape \(3, 5\) does not give the "
                                         r"expected shapes .* with 0, 1 or 2 leading layer axes"):
        map_layers(per_layer_square, jnp.zeros((3, 5)),
                   jax.ShapeDtypeStruct((3, 2, 2), jnp.float32), "who", "w")
