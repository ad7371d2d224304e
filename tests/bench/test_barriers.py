"""stackwise.bench.barriers: the barrier analysis on programs with a known answer."""

import jax
import jax.numpy as jnp
import pytest

import stackwise
from stackwise.bench import optimization_barrier_bytes

N, D, H = 3, 4, 8
F32 = 4
PARAM_BYTES = N * 2 * D * H * F32  # w1 [D, H] and w2 [H, D] per layer
X = jnp.ones((2, D))


def _layer(p, h):
    return h + jnp.tanh(h @ p["w1"]) @ p["w2"]


def _stacked(n=N):
    return {"w1": jnp.full((n, D, H), 0.1), "w2": jnp.full((n, H, D), 0.1)}


def _barriers(loss, params, x=X):
    text = jax.jit(jax.grad(loss)).lower(params, x).as_text()
    return optimization_barrier_bytes(text, n_params=len(jax.tree.leaves(params)))


def test_direct_barrier_on_params_and_on_an_activation():
    def f(w, x):
        w2, y = jax.lax.optimization_barrier((w, x @ w))
        return w2.sum() + y.sum()

    w = jnp.ones((D, H))
    text = jax.jit(f).lower(w, X).as_text()
    got = optimization_barrier_bytes(text, n_params=1)
    assert got.params == D * H * F32  # w itself
    assert got.total == D * H * F32 + 2 * H * F32  # w and the activation x @ w
    assert got.consts == 0 and got.count == 1 and got.exact


def test_python_loop_with_checkpoint_puts_every_layer_params_through_a_barrier():
    def loss(layers, h):
        for p in layers:
            h = jax.checkpoint(_layer)(p, h)  # default prevent_cse=True
        return jnp.mean(h**2)

    got = _barriers(loss, stackwise.unstack_layers(_stacked()))
    assert got.params == PARAM_BYTES
    assert got.count == N and got.exact


def test_scan_with_checkpoint_counts_each_iteration():
    # Forward and backward are two whiles in one function that both bind `%iterArg...`:
    # the names must be resolved per region.
    def loss(params, h):
        body = jax.checkpoint(lambda h, p: (_layer(p, h), None))
        return jnp.mean(jax.lax.scan(body, h, params)[0] ** 2)

    got = _barriers(loss, _stacked())
    assert got.count == 1  # one barrier in the program text ...
    assert got.params == PARAM_BYTES  # ... that runs once per layer
    assert got.exact


def test_nested_scans_multiply_trip_counts():
    n, groups = 6, 2

    def loss(params, h):
        inner = jax.checkpoint(lambda h, p: (_layer(p, h), None))
        grouped = jax.tree.map(lambda a: a.reshape(groups, n // groups, *a.shape[1:]), params)
        outer = lambda h, g: (jax.lax.scan(inner, h, g)[0], None)  # noqa: E731
        return jnp.mean(jax.lax.scan(outer, h, grouped)[0] ** 2)

    assert _barriers(loss, _stacked(n)).params == PARAM_BYTES // N * n


def test_closed_over_constant_counts_as_constant():
    mask = jnp.arange(2 * D, dtype=jnp.float32).reshape(2, D)

    def loss(layers, h):
        for p in layers:
            h = jax.checkpoint(lambda p, h: _layer(p, h) * mask)(p, h)
        return jnp.mean(h**2)

    got = _barriers(loss, stackwise.unstack_layers(_stacked()))
    assert got.consts == N * mask.size * F32
    assert got.params == PARAM_BYTES


@pytest.mark.parametrize("unroll", [1, True])
def test_stackwise_remat_passes_no_params_or_constants(unroll):
    layers = stackwise.stack(lambda k: None, _layer, N, remat=True, unroll=unroll)
    got = _barriers(lambda p, h: jnp.mean(layers.apply(p, h) ** 2), _stacked())
    assert got.params == 0 and got.consts == 0
    if unroll is True:  # straight-line code: the carry is protected, so barriers exist
        assert got.count == N and got.total > 0


def test_missing_entry_function_is_named():
    with pytest.raises(ValueError, match="no function @main"):
        optimization_barrier_bytes("module {\n}\n", n_params=1)
