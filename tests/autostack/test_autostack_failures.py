"""Loops autostack cannot stack: the message names the first block that differs, its
equation and how; best_effort runs fn unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import mlp, mlp_params
from jax.experimental import checkify

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


def test_effects_other_than_callbacks_are_never_part_of_a_run():
    def model(params, x):
        for p in params["layers"]:
            x = x + jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]
            checkify.check(jnp.all(x < 1e6), "too large")
        return x

    message = refused(model, mlp_params(KEY, 3), X)
    assert "equations with effects other than callbacks' are never part of a run" in message
    assert "(`check`" in message and "`ErrorEffect`" in message, message


def test_best_effort_runs_fn_unchanged():
    params = mlp_params(KEY, 6)
    same, f = stackwise.autostack(branch_model, params, X, best_effort=True)
    assert same is params and f.found.n == 0 and "block 2" in f.found.why
    assert str(f.found).startswith("autostack: nothing stacked: the loop is broken")
    assert (f(params, X) == branch_model(params, X)).all()
    assert f.stack(params) is params and f.unstack(params) is params


# --------------------------------------------------------------------------
# Functions in equation params (a custom_vjp's backward, a custom_jvp's rule) are compared by
# their code and the values they close over: blocks whose backward passes differ are not the
# same computation, though their forward passes are.


class Box:
    """An object closed over, compared by identity."""

    def __init__(self, value):
        self.value = value


def scaled_grad(c):
    @jax.custom_vjp
    def f(x):
        return x

    f.defvjp(lambda x: (x, None), lambda _, g: (g * c,))
    return f


def scaled_grad_by_default(c):
    @jax.custom_vjp
    def f(x):
        return x

    f.defvjp(lambda x: (x, None), lambda _, g, c=c: (g * c,))  # the loop's usual idiom
    return f


def negated_grad(c):
    @jax.custom_vjp
    def f(x):
        return x

    f.defvjp(lambda x: (x, None), lambda _, g: (-g * c,))
    return f


def _box_grad(box):
    @jax.custom_vjp
    def f(x):
        return x

    f.defvjp(lambda x: (x, None), lambda _, g: (g * box.value,))
    return f


def nested_scale(c):
    def scale(g):
        return g * c

    @jax.custom_vjp
    def f(x):
        return x

    f.defvjp(lambda x: (x, None), lambda _, g: (scale(g),))
    return f


def tangent_scaled(c):
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    f.defjvp(lambda primals, tangents: (jnp.sin(primals[0]), tangents[0] * c))
    return f


ONE = Box(1.0)

# Per layer, the wrapper each block's output passes through: layer 2's differs from the others
# only in what its derivative rule closes over (or in the rule's code).
WRAPPERS = {
    "a Python scalar": (lambda i: scaled_grad(0.5 if i == 2 else 1.0),
                        ["`bwd` differs", "closes over `c` = 0.5 where block 0's closes over 1.0"]),
    "an array": (lambda i: scaled_grad(np.full(3, 0.5 if i == 2 else 1.0, np.float32)),
                 ["`bwd` differs", "closes over `c`, an array float32[3] whose values differ"]),
    "an object": (lambda i: _box_grad(Box(1.0) if i == 2 else ONE),
                  ["`bwd` differs", "closes over `box` = a `Box` object (compared by identity)"]),
    "a default argument": (lambda i: scaled_grad_by_default(0.5 if i == 2 else 1.0),
                           ["`bwd` differs", "has other default arguments"]),
    "another rule": (lambda i: negated_grad(1.0) if i == 2 else scaled_grad(1.0),
                     ["`bwd` differs", "`negated_grad.<locals>.<lambda>`",
                      "where block 0's is `scaled_grad.<locals>.<lambda>`"]),
    "a nested function": (lambda i: nested_scale(0.5 if i == 2 else 1.0),
                          ["closes over `scale`, which differs: `nested_scale.<locals>.scale`",
                           "closes over `c` = 0.5"]),
    "a custom_jvp rule": (lambda i: tangent_scaled(0.5 if i == 2 else 1.0),
                          ["(`custom_jvp_call`", "`jvp_jaxpr_fun` differs",
                           "closes over `c` = 0.5 where block 0's closes over 1.0"]),
}


def wrapped_model(wrapper, checkpointed=False):
    def model(params, x):
        for i, p in enumerate(params["layers"]):
            def block(p, x, i=i):
                return wrapper(i)(x + jnp.tanh(x @ p["w"] + p["b"]) @ p["v"])

            x = (jax.checkpoint(block) if checkpointed else block)(p, x)
        return x @ params["head"]

    return model


@pytest.mark.every_case
@pytest.mark.parametrize("closure", list(WRAPPERS))
def test_a_derivative_rule_closing_over_other_values_breaks_the_loop(closure):
    wrapper, words = WRAPPERS[closure]
    message = refused(wrapped_model(wrapper), mlp_params(KEY, 4), X)
    assert "the loop is broken at block 2" in message, message
    for word in words:
        assert word in message, (word, message)
    assert "test_autostack_failures.py" in message, message  # the rule's source line


def test_a_rule_inside_a_checkpointed_block_is_compared_too():
    wrapper = WRAPPERS["a Python scalar"][0]
    message = refused(wrapped_model(wrapper, checkpointed=True), mlp_params(KEY, 4), X)
    assert "the loop is broken at block 2" in message and "(`remat" in message, message
    assert "its sub-jaxpr `jaxpr` holds a function that differs from block 0's" in message
    assert "closes over `c` = 0.5 where block 0's closes over 1.0" in message, message


@pytest.mark.parametrize("checkpointed", [False, True])
def test_rules_made_per_layer_closing_over_equal_values_are_stacked(checkpointed):
    from test_autostack import check_loop

    model = wrapped_model(lambda i: scaled_grad_by_default(0.5), checkpointed)
    f = check_loop(model, mlp_params(KEY, 4), X, n=4)
    assert f.found.params == 3


def test_params_or_args_of_another_structure_name_the_leaves_that_differ():
    from _models import llama, llama_params

    tokens = jnp.array([[1, 2, 3]])
    stacked, f = stackwise.autostack(llama, llama_params(KEY, 3), tokens)
    with pytest.raises(TypeError) as info:
        f.stack(llama_params(KEY, 4))
    message = str(info.value)
    assert "`params` is not the structure `fn` was traced with" in message, message
    assert "it lacks 0 leaves" in message and "has 9 others (['layers'][3]['down']" in message
    with pytest.raises(TypeError, match=r"`args` .* lacks 1 leaves .*\(\[0\]\) and has 1 "
                                        r"others \(\[0\]\['a'\]\)"):
        f(stacked, {"a": tokens})


def test_a_rule_closing_over_a_container_that_holds_itself_is_keyed():
    table = {"scale": 1.0}
    table["self"] = table  # (a closure reaching itself again: keyed, not recursed forever)

    def wrapper(i):
        @jax.custom_vjp
        def f(x):
            return x

        f.defvjp(lambda x: (x, None), lambda _, g: (g * table["scale"],))
        return f

    from test_autostack import check_loop

    check_loop(wrapped_model(wrapper), mlp_params(KEY, 3), X, n=3)


def test_blocks_differing_in_every_rule_name_the_first_block_and_how():
    """Every layer's backward closes over its own object: no two blocks are alike, and the
    message still names block 1, its equation and the closure that differs."""
    message = refused(wrapped_model(lambda i: _box_grad(Box(1.0))), mlp_params(KEY, 4), X)
    assert "found no run of 2 or more blocks" in message and "breaks at block 1" in message
    assert "(`custom_vjp_call`" in message and "`bwd` differs" in message, message
    assert "closes over `box` = a `Box` object (compared by identity)" in message, message
