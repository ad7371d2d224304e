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
