"""The suite's float32 tolerance (tests/_tolerance.py) holds a stack to its loop and still fails
a relative error of 1e-3, naming the leaf, the error and the bound."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerance import EPS, assert_close, compare, reassociation_bound, rounding_bound

import stackwise

N, D, ROWS = 8, 8, 16
BOUND = reassociation_bound(depth=N, width=D, summed=ROWS)  # 6 * (2 * 8 * sqrt(8) + 4) = 296


def _init(key):
    return {"w": jax.random.normal(key, (D, D)) / D**0.5, "b": jnp.full((D,), 0.1)}


def _apply(p, x):
    return x + jnp.tanh(x @ p["w"] + p["b"][None, :])


def _step(layers_apply):
    loss = lambda p, x: jnp.sum(jnp.sin(layers_apply(p, x)))  # noqa: E731
    return jax.jit(jax.value_and_grad(loss))


def _loop(params, x):
    for p in stackwise.unstack_layers(params):
        x = _apply(p, x)
    return x


@pytest.fixture(scope="module")
def results():
    layers = stackwise.stack(_init, _apply, N)
    params = jax.jit(layers.init)(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (ROWS, D))
    return _step(layers.apply)(params, x), _step(_loop)(params, x)


def test_the_bound_is_the_derived_count():
    assert BOUND == 296
    assert reassociation_bound(depth=2, width=(4, 9)) == 6 * (2 * 2 * (2 + 3) + 1)
    assert rounding_bound(roundings=28) == 28 * 2**15  # (u = 2**-8 of bfloat16, in 2**-23s)
    assert rounding_bound(roundings=3, dtype=jnp.float16) == 3 * 2**12


def test_a_stack_is_within_the_bound_of_its_loop(results):
    got, want = results
    assert_close(got, want, BOUND)  # measured: a few eps


@pytest.mark.parametrize("leaf", [0, 1, 2])  # the loss, the grads of b and of w
def test_a_relative_error_of_1e_3_fails_naming_the_leaf(results, leaf):
    got, want = results
    leaves, tree = jax.tree.flatten(got)
    leaves[leaf] = leaves[leaf] * np.float32(1 + 1e-3)
    bad = jax.tree.unflatten(tree, leaves)
    path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(want)[0][leaf][0])
    assert compare(bad, want)["in_eps"] > 8 * BOUND  # 1e-3 / eps = 8,389
    with pytest.raises(AssertionError, match=rf"leaf {re.escape(path)} differs by .* over the "
                       rf"bound {BOUND} eps \* scale"):
        assert_close(bad, want, BOUND)


def test_a_zero_leaf_is_compared_with_the_whole_tree():
    want = {"w": np.array([20.0, -3.0]), "b": np.zeros(2)}
    noise = {"w": want["w"], "b": np.array([4 * EPS * 20.0, 0.0])}  # rounding noise of terms ~20
    with pytest.raises(AssertionError, match=r"leaf \['b'\] .* = inf eps"):
        assert_close(noise, want, BOUND)
    assert_close(noise, want, BOUND, zero=("['b']",))
    assert compare(noise, want, zero=("['b']",))["in_eps"] == pytest.approx(4)
