"""Pytree comparisons shared by the tests, with tolerances named by purpose."""

import jax
import numpy as np

# float32 results of a scan and of a loop of the same ops differ by reassociation only.
RTOL = 2e-5
ATOL = 2e-6


def assert_trees_close(a, b, rtol=RTOL, atol=ATOL):
    """Leaf by leaf; a reassociation error is relative to the leaf's largest magnitude.

    A small element computed from large terms (a gradient entry near 0.03 in a leaf of
    entries near 20) carries the rounding of those terms, so each leaf's absolute
    tolerance is at least ``rtol`` times its largest magnitude.
    """
    assert jax.tree.structure(a) == jax.tree.structure(b)

    def close(u, v):
        scale = float(np.max(np.abs(v))) if np.size(v) else 0.0
        np.testing.assert_allclose(u, v, rtol=rtol, atol=max(atol, rtol * scale))

    jax.tree.map(close, a, b)


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)


def assert_trees_bitwise(a, b):
    """Same structure, and every leaf of the same dtype, shape and bits (what a conversion
    promises; `assert_trees_equal` compares values only, so float32 1.0 equals bfloat16 1.0)."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and np.shape(x) == np.shape(y), (x.dtype, y.dtype)
        if jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
