"""stackwise.autostack on loops whose blocks differ only in a static index of one array from
before the loop: ``keys[i]`` of keys split once (dropout per layer), ``xs[i]`` of a per-layer
array. The scan slices that array per layer: the same values as the loop's, in one while loop
whose program does not grow with depth."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _trees import assert_trees_bitwise, assert_trees_close
from hypothesis import given, settings
from hypothesis import strategies as st

import stackwise

D = 8
X = jax.random.normal(jax.random.key(1), (3, D))


def layers(n: int, seed: int = 0) -> list:
    keys = jax.random.split(jax.random.key(seed), n)
    return [{"w": jax.random.normal(k, (D, D)) / D, "b": jnp.zeros((1, D))} for k in keys]


def dropout_loop(params, x, key):
    """Dropout after each layer, each layer with its own key of one `split`; the masks are
    returned too, so that they compare bitwise."""
    keys = jax.random.split(key, len(params))
    masks = []
    for i, p in enumerate(params):
        h = jnp.tanh(x @ p["w"] + p["b"])
        keep = jax.random.bernoulli(keys[i], 0.75, h.shape)
        masks.append(keep)
        x = x + jnp.where(keep, h / 0.75, 0.0)
    return x, masks


def per_layer_loop(params, x, xs):
    """Each layer adds its row of a per-layer input `xs` and of a per-layer scale the user
    stacked in the params (``params["scale"][i]``)."""
    for i, p in enumerate(params["layers"]):
        x = jnp.tanh(x @ p["w"] + p["b"] + xs[i]) * params["scale"][i]
    return x


def loss(out):
    return sum(jnp.sum(jnp.sin(leaf.astype(jnp.float32))) for leaf in jax.tree.leaves(out))


def test_split_keys_dropout_matches_the_loop():
    params, key = layers(4), jax.random.key(7)
    stacked, f = stackwise.autostack(dropout_loop, params, X, key, n=4)
    assert f.found.params == 2, f.found  # (the keys are sliced, not stacked params)
    (x, masks), (want_x, want_masks) = jax.jit(f)(stacked, X, key), dropout_loop(params, X, key)
    assert_trees_bitwise(masks, want_masks)  # each layer drew from its own key
    assert not all(bool((m == masks[0]).all()) for m in masks[1:])
    assert_trees_close(x, want_x)
    got = jax.jit(jax.grad(lambda p, x: loss(f(p, x, key)), argnums=(0, 1)))(stacked, X)
    want = jax.grad(lambda p, x: loss(dropout_loop(p, x, key)), argnums=(0, 1))(params, X)
    assert_trees_close((f.unstack(got[0]), got[1]), want)


@pytest.mark.slow  # (the fast tier's: the two tests around it)
def test_per_layer_array_rows_match_the_loop():
    n = 5
    params = {"layers": layers(n), "scale": 1.0 + jax.random.uniform(jax.random.key(3), (n, 1, D))}
    xs = jax.random.normal(jax.random.key(4), (n, 3, D))
    stacked, f = stackwise.autostack(per_layer_loop, params, X, xs, n=n)
    assert set(stacked["blocks"]) == {"['layers'][0]['w']", "['layers'][0]['b']"}
    assert stacked["rest"]["scale"] is params["scale"]  # read whole, sliced per layer
    assert_trees_close(jax.jit(f)(stacked, X, xs), per_layer_loop(params, X, xs))
    got = jax.jit(jax.grad(lambda p, x, xs: loss(f(p, x, xs)), argnums=(0, 1, 2)))(stacked, X, xs)
    want = jax.grad(lambda p, x, xs: loss(per_layer_loop(p, x, xs)), argnums=(0, 1, 2))(
        params, X, xs)
    assert_trees_close((f.unstack(got[0]), *got[1:]), want)


def test_rows_stepping_backwards_and_by_two():
    """``xs[n - 1 - i]`` and ``xs[2 * i + 1]``: any one step along one axis."""
    n = 4
    xs = jax.random.normal(jax.random.key(5), (2 * n, 3, D))

    def loop(params, x, xs):
        for i, p in enumerate(params):
            x = jnp.tanh(x @ p["w"] + xs[n - 1 - i] * xs[2 * i + 1])
        return x

    params = layers(n)
    stacked, f = stackwise.autostack(loop, params, X, xs, n=n)
    assert_trees_close(jax.jit(f)(stacked, X, xs), loop(params, X, xs))


@pytest.mark.slow  # (8 examples, each compiling a loop and its scan)
@settings(max_examples=8, deadline=None)
@given(n=st.integers(2, 6), step=st.sampled_from([-2, -1, 1, 3]), offset=st.integers(0, 2),
       axis=st.sampled_from([0, 1]))
def test_any_start_and_step_along_either_axis(n, step, offset, axis):
    """Rows ``offset + step * i`` (counted from the end where ``step < 0``) of a per-layer
    array, along its first or second axis: the rows the loop reads, bitwise."""
    rows = offset + abs(step) * (n - 1) + 1
    shape = (rows, 3, D) if axis == 0 else (3, rows, D)
    xs = jax.random.normal(jax.random.key(n * 7 + offset), shape)

    def loop(params, x, xs):
        seen = []
        for i, p in enumerate(params):
            r = offset + step * i if step > 0 else rows - 1 - offset + step * i
            row = xs[r] if axis == 0 else xs[:, r]
            seen.append(row)
            x = jnp.tanh(x @ p["w"] + row)
        return x, seen

    params = layers(n, seed=n)
    stacked, f = stackwise.autostack(loop, params, X, xs, n=n)
    (x, seen), (want_x, want_seen) = jax.jit(f)(stacked, X, xs), loop(params, X, xs)
    assert_trees_bitwise(seen, want_seen)
    assert_trees_close(x, want_x)


@pytest.mark.slow  # (lowers jit(grad) of the loop and of its scan at 4 and 16 layers)
def test_the_program_has_one_loop_and_is_flat_in_depth():
    """The lowered autostacked dropout loop holds one while loop more than the loop's own
    (the random bits' rolled loops on CPU, one function however many layers), and its
    ``jit(grad(loss))`` does not grow from 4 to 16 layers; the loop's does."""
    key, sizes = jax.random.key(7), {}
    for n in (4, 16):
        params = layers(n)
        stacked, f = stackwise.autostack(dropout_loop, params, X, key, n=n)
        auto = jax.jit(f).lower(stacked, X, key).as_text()
        loop = jax.jit(dropout_loop).lower(params, X, key).as_text()
        assert auto.count("stablehlo.while") == loop.count("stablehlo.while") + 1, n
        auto = jax.jit(jax.grad(lambda p, f=f: loss(f(p, X, key)))).lower(stacked).as_text()
        loop = jax.jit(jax.grad(lambda p: loss(dropout_loop(p, X, key)))).lower(params).as_text()
        sizes[n] = (len(auto), len(loop))
    (auto4, loop4), (auto16, loop16) = sizes[4], sizes[16]
    assert abs(auto16 - auto4) <= 0.03 * auto4, sizes  # flat in depth
    assert loop16 > 2 * loop4, sizes  # (what the scan spares)
