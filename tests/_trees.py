"""Pytree comparisons shared by the tests, with tolerances named by purpose."""

import jax
import numpy as np

# float32 results of a scan and of a loop of the same ops differ by reassociation only.
RTOL = 2e-5
ATOL = 2e-6


def assert_trees_close(a, b, rtol=RTOL, atol=ATOL):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=rtol, atol=atol), a, b)


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)
