"""Blocks with effects: a loop whose layers each call `jax.debug.callback`, `jax.debug.print`
or `io_callback` is stacked with the call inside the scan's body, once per layer, in layer
order, with the loop's per-layer values (a literal layer index in the arguments becomes a
scanned input). Any other effect, and callbacks that differ from layer to layer, are refused
by name."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import mlp_params
from _trees import assert_trees_close
from jax.experimental import checkify, io_callback

import stackwise
from stackwise._autostack.signature import Signatures, difference, unkept

KEY = jax.random.key(0)
X = jnp.ones((4, 8))
BOUND = 8  # (float32 eps of the largest magnitude: the same sums, in another order)


def layer(p, x):
    return x + jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]


def logged(calls, ordered=False):
    """A loop model whose every layer reports its index and its output's norm to ``calls``."""

    def model(params, x):
        for i, p in enumerate(params["layers"]):
            x = layer(p, x)
            jax.debug.callback(lambda i, n: calls.append((int(i), float(n))), i,
                               jnp.linalg.norm(x), ordered=ordered)
        return x @ params["head"]

    return model


def run(fn, *args, calls):
    """``fn(*args)`` and the calls it made, then ``calls`` emptied."""
    out = fn(*args)
    jax.effects_barrier()
    made = list(calls)
    calls.clear()
    return out, made


def assert_calls(got, want):
    assert [i for i, _ in got] == [i for i, _ in want], (got, want)
    assert np.allclose([n for _, n in got], [n for _, n in want], rtol=1e-5), (got, want)


def test_each_layers_callback_runs_in_the_scan_once_per_layer_in_order():
    calls = []
    model, params = logged(calls), mlp_params(KEY, 5)
    stacked, f = stackwise.autostack(model, params, X)
    assert f.found.n == 5 and not calls  # (traced: nothing called)
    # The callback is in the scan's body, once, not once per layer.
    assert jax.jit(f).lower(stacked, X).as_text().count("callback") == 1
    out, got = run(jax.jit(f), stacked, X, calls=calls)
    want_out, want = run(jax.jit(model), params, X, calls=calls)
    assert [i for i, _ in want] == [0, 1, 2, 3, 4]
    assert_calls(got, want)
    assert_trees_close(out, want_out, BOUND)

    def loss(g, p):
        return jnp.sum(jnp.sin(g(p, X)))

    grads, got = run(jax.jit(jax.grad(lambda p: loss(f, p))), stacked, calls=calls)
    want_grads, want = run(jax.jit(jax.grad(lambda p: loss(model, p))), params, calls=calls)
    assert_calls(got, want)
    assert_trees_close(f.unstack(grads), want_grads, BOUND)


@pytest.mark.slow
def test_jax_debug_print_prints_the_loops_lines(capfd):
    def model(params, x):
        for i, p in enumerate(params["layers"]):
            x = layer(p, x)
            jax.debug.print("layer {i} norm {n:.4f}", i=i, n=jnp.linalg.norm(x))
        return x @ params["head"]

    params = mlp_params(KEY, 4)
    stacked, f = stackwise.autostack(model, params, X)
    assert f.found.n == 4
    capfd.readouterr()
    jax.block_until_ready(jax.jit(model)(params, X))
    jax.effects_barrier()
    want = capfd.readouterr().out
    jax.block_until_ready(jax.jit(f)(stacked, X))
    jax.effects_barrier()
    got = capfd.readouterr().out
    assert [line.split()[1] for line in want.splitlines()] == ["0", "1", "2", "3"], want
    assert got == want


@pytest.mark.slow
def test_ordered_callbacks_and_io_callbacks_keep_the_loops_order_and_values():
    calls = []

    def model(params, x):
        for i, p in enumerate(params["layers"]):
            x = layer(p, x)
            x = io_callback(lambda i, v: (calls.append((int(i), float(np.abs(v).sum()))),
                                          np.tanh(v))[1],
                            jax.ShapeDtypeStruct(x.shape, x.dtype), i, x, ordered=True)
        return x @ params["head"]

    params = mlp_params(KEY, 4)
    stacked, f = stackwise.autostack(model, params, X)
    assert f.found.n == 4
    out, got = run(jax.jit(f), stacked, X, calls=calls)
    want_out, want = run(jax.jit(model), params, X, calls=calls)
    assert [i for i, _ in want] == [0, 1, 2, 3]
    assert_calls(got, want)
    assert_trees_close(out, want_out, BOUND)
    ordered = logged(calls, ordered=True)
    stacked, f = stackwise.autostack(ordered, params, X)
    assert_calls(run(jax.jit(f), stacked, X, calls=calls)[1],
                 run(jax.jit(ordered), params, X, calls=calls)[1])


@pytest.mark.slow
def test_with_remat_the_backward_pass_calls_again_as_a_checkpointed_loop_does():
    calls = []
    model, params = logged(calls), mlp_params(KEY, 3)

    def checkpointed(params, x):
        for i, p in enumerate(params["layers"]):
            def step(p, x, i=i):
                x = layer(p, x)
                jax.debug.callback(lambda i, n: calls.append((int(i), float(n))), i,
                                   jnp.linalg.norm(x))
                return x
            x = jax.checkpoint(step)(p, x)
        return x @ params["head"]

    stacked, f = stackwise.autostack(model, params, X, remat=True)
    _, got = run(jax.jit(jax.grad(lambda p: f(p, X).sum())), stacked, calls=calls)
    _, want = run(jax.jit(jax.grad(lambda p: checkpointed(p, X).sum())), params, calls=calls)
    # Each layer's callback runs twice, with the same values: in the forward pass and when
    # the backward pass recomputes the layer. The loop's order is XLA's choice (its
    # callbacks are unordered); the scan's is its steps', forward then in reverse.
    assert sorted(i for i, _ in want) == [0, 0, 1, 1, 2, 2], want
    assert [i for i, _ in got] == [0, 1, 2, 2, 1, 0], got
    assert_calls(sorted(got), sorted(want))


def refused(fn, params):
    with pytest.raises(ValueError) as info:
        stackwise.autostack(fn, params, X)
    return str(info.value)


def test_an_effect_other_than_a_callbacks_is_named_where_a_block_differs():
    # (where one layer checks what the others log; a loop whose every layer checks is a
    # row of tests/misuse/test_misuse_autostack.py)
    def logs(x):
        jax.debug.callback(lambda v: None, x)

    def checks(x):
        checkify.check(jnp.all(x > 0), "not positive")

    def last(fn):
        return jax.make_jaxpr(fn)(jnp.ones(3)).jaxpr.eqns[-1]

    template, other = last(logs), last(checks)
    assert not unkept(template) and unkept(other)
    how = difference(Signatures(), template, other)
    assert how.startswith("it has the effect `ErrorEffect`, which autostack never puts in a scan")
    assert "only callbacks' effects" in how and "`jax.debug.print`" in how, how
    model = logged([])
    same, f = stackwise.autostack(lambda p, x: (checks(x), model(p, x))[1], mlp_params(KEY, 3),
                                  X, best_effort=True)
    assert f.found.n == 3  # (an effect outside the run does not stop it)


@pytest.mark.slow
def test_callbacks_that_differ_from_layer_to_layer_are_other_blocks():
    calls = []

    def by_format(params, x):  # the layer index in the format string, not an argument
        for i, p in enumerate(params["layers"]):
            x = layer(p, x)
            jax.debug.print(f"layer {i}: {{}}", jnp.sum(x))
        return x

    message = refused(by_format, mlp_params(KEY, 3))
    assert "breaks at block 1" in message and "its param `fmt` is 'layer 1: {}'" in message, message
    assert "i=i)`" in message, message

    def by_static_argument(params, x):  # a string is passed to the callback as is
        for i, p in enumerate(params["layers"]):
            x = layer(p, x)
            jax.debug.callback(lambda name, n: calls.append((name, float(n))), f"layer {i}",
                               jnp.sum(x))
        return x

    message = refused(by_static_argument, mlp_params(KEY, 3))
    assert "breaks at block 1" in message and "`callback`" in message, message
    assert "'layer 1'" in message, message


class _Reporter:
    def __init__(self, calls, tag):
        self.calls, self.tag = calls, tag

    def report(self, n):
        self.calls.append((self.tag, float(n)))


def test_callbacks_given_as_partials_or_bound_methods_are_keyed_by_what_they_hold():
    """A `functools.partial` is the same callback where its function and arguments are; a
    bound method where its function and object are: shared by every layer, the loop stacks
    and reports as the loop does; one per layer (another argument or object), refused."""
    calls = []

    def report(tag, n):
        calls.append((tag, float(n)))

    shared = _Reporter(calls, "m")
    params = mlp_params(KEY, 3)
    for callback_of, stacks in (
        (lambda i: functools.partial(report, "p"), True),
        (lambda i: shared.report, True),
        (lambda i: functools.partial(report, i), False),
        (lambda i: _Reporter(calls, i).report, False),
    ):
        def model(params, x, callback_of=callback_of):
            for i, p in enumerate(params["layers"]):
                x = layer(p, x)
                jax.debug.callback(callback_of(i), jnp.linalg.norm(x))
            return x

        if not stacks:
            message = refused(model, params)
            assert "breaks at block 1" in message and "`callback`" in message, message
            continue
        stacked, f = stackwise.autostack(model, params, X)
        assert f.found.n == 3
        out, got = run(jax.jit(f), stacked, X, calls=calls)
        want_out, want = run(jax.jit(model), params, X, calls=calls)
        assert len(want) == 3
        assert_calls(got, want)
        assert_trees_close(out, want_out, BOUND)


def test_with_the_effects_tie_broken_no_block_with_effects_is_stacked(monkeypatch):
    from stackwise._upstream import jax_functions

    monkeypatch.setattr(jax_functions, "holds", lambda tie: tie != jax_functions.EFFECTS)
    message = refused(logged([]), mlp_params(KEY, 3))
    assert "the effect `DebugEffect`" in message, message


@pytest.mark.slow
def test_callbacks_inside_jitted_and_checkpointed_blocks():
    calls = []

    @jax.jit
    def logged_layer(p, x, i):
        x = layer(p, x)
        jax.debug.callback(lambda i, n: calls.append((int(i), float(n))), i, jnp.sum(x))
        return x

    @jax.checkpoint
    def logged_norm(x):
        jax.debug.callback(lambda n: calls.append((-1, float(n))), jnp.linalg.norm(x))
        return x / jnp.linalg.norm(x)

    def model(params, x):
        for i, p in enumerate(params["layers"]):
            x = logged_norm(logged_layer(p, x, i))
        return x

    params = mlp_params(KEY, 4)
    stacked, f = stackwise.autostack(model, params, X)
    assert f.found.n == 4 and f.found.period == 2
    out, got = run(jax.jit(f), stacked, X, calls=calls)
    want_out, want = run(jax.jit(model), params, X, calls=calls)
    assert [i for i, _ in want] == [0, -1, 1, -1, 2, -1, 3, -1], want
    assert_calls(got, want)
    assert_trees_close(out, want_out, BOUND)
