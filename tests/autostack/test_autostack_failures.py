"""Loops autostack cannot stack: the message names the first block that differs, its
equation and how; best_effort runs fn unchanged."""

import jax
import jax.numpy as jnp
import pytest
from _models import mlp, mlp_params

import stackwise

KEY = jax.random.key(0)
X = jnp.ones((4, 8))


def branch_model(params, x):
    for i, p in enumerate(params["layers"]):
        if i == 2:
            x = jnp.sin(x)
        x = x + jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]
    return x @ params["head"]


def refused(fn, params, *args, **options):
    with pytest.raises(ValueError) as info:
        stackwise.autostack(fn, params, *args, **options)
    return str(info.value)


def test_a_branch_on_the_layer_index_names_the_block_and_equation():
    message = refused(branch_model, mlp_params(KEY, 6), X)
    assert "the loop is broken at block 2" in message, message
    assert "(`sin`" in message and "test_autostack_failures.py" in message, message
    assert "best_effort=True" in message


def test_a_block_of_another_width_names_its_shapes():
    params = mlp_params(KEY, 5, widths=[8, 8, 16, 8, 8])
    message = refused(mlp, params, X)
    assert "broken at block 2" in message and "equation 0 (`dot_general`" in message, message
    assert "float32[8,16]" in message and "float32[8,8]" in message, message


def test_a_last_block_that_differs_is_left_out_unless_n_is_given():
    params = mlp_params(KEY, 4, widths=[8, 8, 8, 16])
    _, f = stackwise.autostack(mlp, params, X)
    assert f.found.n == 3  # the loop's last block runs after the scan, as traced
    message = refused(mlp, params, X, n=4)
    assert "`n=4` blocks were expected, but 3 were found" in message and "block 3" in message


def second_order(params, x):
    xs = [x, x]
    for p in params["layers"]:
        xs.append(xs[-1] + jnp.tanh(xs[-2] @ p["w"] + p["b"]) @ p["v"])
    return xs[-1]


def test_reading_two_blocks_back_breaks_the_run_of_single_layers():
    from stackwise._autostack.find import follow

    params = mlp_params(KEY, 5)
    jaxpr = jax.make_jaxpr(second_order)(params, X).jaxpr
    readers = {}
    for r, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            readers.setdefault(v, []).append(r)
    plan, failure = follow(jaxpr, 0, 6, 5, 15, readers)
    assert failure.block == 2 and "2 blocks back" in failure.text, failure
    assert plan.count == 2  # the run cut before the block that breaks it
    # ... so autostack takes pairs of layers as its block, each pair reading the one before:
    stacked, f = stackwise.autostack(second_order, params, X)
    assert (f.found.n, f.found.period) == (2, 12)
    assert jnp.allclose(f(stacked, X), second_order(params, X), atol=1e-5)


def test_no_repeated_block():
    message = refused(mlp, mlp_params(KEY, 1), X)
    assert "no two consecutive blocks" in message, message
    message = refused(mlp, mlp_params(KEY, 3, widths=[4, 8, 16]), X)
    assert "no two consecutive blocks" in message, message


def test_effects_are_never_part_of_a_run():
    def model(params, x):
        for p in params["layers"]:
            x = x + jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]
            jax.debug.callback(lambda v: None, x)
        return x

    message = refused(model, mlp_params(KEY, 3), X)
    assert "equations with effects are never part of a run" in message, message
    assert "`debug_callback`" in message, message


def test_best_effort_runs_fn_unchanged():
    params = mlp_params(KEY, 6)
    same, f = stackwise.autostack(branch_model, params, X, best_effort=True)
    assert same is params and f.found.n == 0 and "block 2" in f.found.why
    assert str(f.found).startswith("autostack: nothing stacked: the loop is broken")
    assert (f(params, X) == branch_model(params, X)).all()
    assert f.stack(params) is params and f.unstack(params) is params
