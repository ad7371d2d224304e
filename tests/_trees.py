"""Pytree comparisons shared by the tests, with tolerances named by purpose."""

import jax
import numpy as np
from _tolerance import assert_close, reassociation_bound

#: float32 results of a scan and of a loop of the same ops differ by reassociation only: the
#: suite's stacks on one device are up to 8 layers of matmuls of up to 16 terms (or more layers
#: of fewer: 9 of 8 terms give 330), with grads summing up to 16 rows: 6 * (2 * 8 * sqrt(16) +
#: sqrt(16)) = 408 eps * the leaf's largest magnitude, 4.9e-5 of it (tests/_tolerance.py). The
#: relative 2e-5 (168 eps) this replaces allowed up to 336: 2e-5 of each entry and of the leaf's
#: largest.
STACK_BOUND = reassociation_bound(depth=8, width=16, summed=16)


def assert_trees_close(a, b, bound=STACK_BOUND, zero=()):
    """Leaf by leaf, within ``bound * eps * (the leaf's largest |b|)`` (tests/_tolerance.py).

    A small element computed from large terms (a gradient entry near 0.03 in a leaf of
    entries near 20) carries the rounding of those terms, so the error of each entry is
    relative to its leaf's largest magnitude, not to the entry's own. ``zero``: parts of the
    paths of leaves that are 0 in exact arithmetic, compared with the whole tree's largest
    (``_tolerance.compare``).
    """
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.shape(x) == np.shape(y), (np.shape(x), np.shape(y))
    assert_close(a, b, bound, zero=zero)


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
