"""`stackwise.stack` against a reference Python loop over per-layer slices."""

from __future__ import annotations

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _programs import barrier_operand_types, on_cpu, temp_bytes
from _tolerance import reassociation_bound
from _trees import assert_trees_close
from hypothesis import given, settings
from hypothesis import strategies as st

import stackwise

D = 4

REMATS = {
    "off": False,
    "on": True,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def init_layer(key, d=D):
    k1, k2 = jax.random.split(key)
    return {
        "w": jax.random.normal(k1, (d, d)) / d**0.5,
        "b": 0.1 * jax.random.normal(k2, (1, d)),
    }


def apply_layer(params, x, scale=1.0):
    return x + scale * jnp.tanh(x @ params["w"] + params["b"])


def layer_slices(stacked):
    return stackwise.unstack_layers(stacked)


def reference(params, x, layer=apply_layer, reverse=False):
    """The loop stackwise replaces: one layer after another, per-layer slices of params."""
    order = reversed(layer_slices(params)) if reverse else layer_slices(params)
    for p in order:
        x = layer(p, x)
    return x


def loss_of(apply):
    return lambda params, x: jnp.sum(jnp.sin(apply(params, x)))


# --------------------------------------------------------------------------
# Outputs and gradients against the loop.


def _cases():
    # Every remat x unroll x reverse at n=5; the edge depths and eager mode on a subset.
    for remat in REMATS:
        for unroll in (1, 2, True):
            for reverse in (False, True):
                yield 5, remat, unroll, reverse, True
    for n in (1, 2):
        for remat, unroll in (("off", 1), ("on", 2), ("dots", True)):
            yield n, remat, unroll, n == 2, True
    yield 2, "on", 1, False, False
    yield 5, "dots", True, True, False
    yield 3, "off", False, False, True  # (False: as lax.scan takes it, no unrolling)


@pytest.mark.parametrize("n,remat,unroll,reverse,jit", list(_cases()))
def test_matches_loop(n, remat, unroll, reverse, jit):
    layers = stackwise.stack(
        init_layer, apply_layer, n, remat=REMATS[remat], unroll=unroll, reverse=reverse
    )
    params = layers.init(jax.random.key(n))
    x = jax.random.normal(jax.random.key(10), (3, D))
    maybe_jit = jax.jit if jit else (lambda f: f)
    y = maybe_jit(layers.apply)(params, x)
    g = maybe_jit(jax.grad(loss_of(layers.apply), argnums=(0, 1)))(params, x)
    ref = lambda p, x: reference(p, x, reverse=reverse)  # noqa: E731
    assert_trees_close(y, ref(params, x))
    assert_trees_close(g, jax.grad(loss_of(ref), argnums=(0, 1))(params, x))


@pytest.mark.parametrize(
    "n,nested,remat,unroll,reverse",
    [
        (1, True, True, 1, False),
        (5, True, True, 1, True),
        (5, 2, False, 1, False),
        (7, 3, True, 1, False),
        (7, 3, True, 2, True),
        (7, 3, False, True, True),
        (9, True, True, True, False),
        (6, 6, False, 1, True),
        (6, 10, True, 1, False),
    ],
)
def test_nested_matches_loop(n, nested, remat, unroll, reverse):
    layers = stackwise.stack(
        init_layer, apply_layer, n, remat=remat, nested=nested, unroll=unroll, reverse=reverse
    )
    params = layers.init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (3, D))
    ref = lambda p, x: reference(p, x, reverse=reverse)  # noqa: E731
    assert_trees_close(jax.jit(layers.apply)(params, x), ref(params, x))
    assert_trees_close(
        jax.jit(jax.grad(loss_of(layers.apply)))(params, x), jax.grad(loss_of(ref))(params, x)
    )


def test_init_is_bitwise_the_stacked_per_layer_inits():
    n = 5
    layers = stackwise.stack(init_layer, apply_layer, n)
    key = jax.random.key(3)
    expected = stackwise.stack_layers([init_layer(k) for k in jax.random.split(key, n)])
    got = layers.init(key)
    jax.tree.map(np.testing.assert_array_equal, got, expected)


def test_init_and_apply_args_reach_every_layer():
    def init(key, d, *, bias):
        return {"w": jax.random.normal(key, (d,)), "b": jnp.full((d,), bias)}

    def apply(p, x, shift, *, mode):
        if mode == "add":  # a static string: would fail if it were traced
            return x + p["w"] + p["b"] + shift
        return x * p["w"]

    layers = stackwise.stack(init, apply, 3)
    params = layers.init(jax.random.key(0), 2, bias=0.5)
    assert params["w"].shape == (3, 2)
    x, shift = jnp.zeros(2), jnp.array([1.0, 2.0])
    y = jax.jit(layers.apply, static_argnames="mode")(params, x, shift, mode="add")
    expected = sum(params["w"]) + 3 * 0.5 + 3 * shift
    assert_trees_close(y, expected)


def test_static_python_values_stay_static():
    def apply(p, x, training, name, nothing):
        assert isinstance(training, bool) and isinstance(name, str) and nothing is None
        return x * 2 if training else x

    layers = stackwise.stack(lambda k: None, apply, 3)
    assert jax.jit(lambda x: layers.apply(None, x, True, "a", None))(1.0) == 8.0
    assert layers.apply(None, 1.0, False, "a", None) == 1.0


# --------------------------------------------------------------------------
# Per-layer inputs, outputs, keys, index, state.


@pytest.mark.parametrize("unroll", [1, True])
@pytest.mark.parametrize("reverse", [False, True])
def test_per_layer_inputs_and_outputs(unroll, reverse):
    n = 4

    def apply(p, x, scale, *, offset):
        y = x * scale["s"] + offset
        return y, {"seen": y, "scale": scale["s"]}

    layers = stackwise.stack(
        lambda k: None, apply, n, has_aux=True, unroll=unroll, reverse=reverse
    )
    scales = {"s": jnp.arange(1.0, n + 1)}
    offsets = jnp.arange(n, dtype=jnp.float32) * 10
    y, aux = layers.apply(
        None, jnp.float32(1.0), stackwise.per_layer(scales), offset=stackwise.per_layer(offsets)
    )
    x, seen = 1.0, [None] * n
    for i in reversed(range(n)) if reverse else range(n):
        x = x * scales["s"][i] + offsets[i]
        seen[i] = x
    assert_trees_close(y, x)
    assert_trees_close(aux, {"seen": jnp.stack(seen), "scale": scales["s"]})


def test_per_layer_inputs_in_init():
    layers = stackwise.stack(lambda k, width: jnp.full((2,), width), lambda p, x: x + p, 3)
    params = layers.init(jax.random.key(0), stackwise.per_layer(jnp.array([1.0, 2.0, 3.0])))
    np.testing.assert_array_equal(params, [[1, 1], [2, 2], [3, 3]])


@pytest.mark.parametrize("unroll", [1, True])
def test_per_layer_keys_are_the_split_keys(unroll):
    n = 5

    def apply(p, x, key):
        noise = jax.random.normal(key, (3,))
        return x, noise

    layers = stackwise.stack(lambda k: None, apply, n, has_aux=True, unroll=unroll)
    key = jax.random.key(7)
    _, noise = jax.jit(layers.apply)(None, jnp.zeros(()), stackwise.per_layer_keys(key))
    expected = jnp.stack([jax.random.normal(k, (3,)) for k in jax.random.split(key, n)])
    np.testing.assert_array_equal(noise, expected)
    assert len({tuple(np.asarray(r)) for r in noise}) == n  # independent per layer


@pytest.mark.parametrize("unroll", [1, 3, True])
@pytest.mark.parametrize("reverse", [False, True])
def test_layer_index(unroll, reverse):
    def apply(p, x, i):
        assert i.dtype == jnp.int32 and i.shape == ()
        # pick a pattern per layer with lax.switch
        return jax.lax.switch(i % 2, [lambda x: x * 2, lambda x: x + 1], x), i

    layers = stackwise.stack(
        lambda k: None, apply, 5, has_aux=True, unroll=unroll, reverse=reverse
    )
    y, seen = jax.jit(layers.apply)(None, jnp.float32(1.0), stackwise.layer_index())
    np.testing.assert_array_equal(seen, np.arange(5))
    x = 1.0
    for i in reversed(range(5)) if reverse else range(5):
        x = x * 2 if i % 2 == 0 else x + 1
    assert float(y) == x


def counter_init(key):
    state = {"count": jnp.zeros((), jnp.int32), "sum": jnp.zeros(D)}
    return {"w": jax.random.normal(key, (1, D))}, state


def counter_apply(params, state, x):
    y = x + params["w"]
    return y, {"count": state["count"] + 1, "sum": state["sum"] + y.sum(0)}


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("unroll", [1, True])
@pytest.mark.parametrize("nested", [False, 2])
def test_state_matches_loop(remat, unroll, nested):
    n = 3
    layers = stackwise.stack(
        counter_init, counter_apply, n, with_state=True, remat=remat, unroll=unroll, nested=nested
    )
    params, state = layers.init(jax.random.key(0))
    expected_params, expected_state = stackwise.unstack_layers((params, state))[0]
    assert state["count"].shape == (n,) and expected_state["count"] == 0
    x = jnp.ones((2, D))

    def loop(params, state, x):
        new_states = []
        for p, s in zip(layer_slices(params), layer_slices(state)):
            x, s = counter_apply(p, s, x)
            new_states.append(s)
        return x, stackwise.stack_layers(new_states)

    apply = jax.jit(layers.apply)
    ref_state = state
    for _ in range(3):  # state threads through several applies
        y, state = apply(params, state, x)
        ref_y, ref_state = loop(params, ref_state, x)
        assert_trees_close((y, state), (ref_y, ref_state))
    np.testing.assert_array_equal(state["count"], [3, 3, 3])
    grad = jax.grad(lambda p: layers.apply(p, state, x)[0].sum())(params)
    ref_grad = jax.grad(lambda p: loop(p, state, x)[0].sum())(params)
    assert_trees_close(grad, ref_grad)


def test_state_with_aux_and_per_layer_inputs():
    def apply(p, s, x, bias):
        y = x + bias
        return (y, y * 2), s + 1

    layers = stackwise.stack(
        lambda k: (None, jnp.zeros(())), apply, 3, has_aux=True, with_state=True
    )
    _, state = layers.init(jax.random.key(0))
    (y, aux), state = layers.apply(None, state, 0.0, stackwise.per_layer(jnp.arange(3.0)))
    assert float(y) == 3.0
    np.testing.assert_array_equal(aux, [0.0, 2.0, 6.0])
    np.testing.assert_array_equal(state, [1, 1, 1])


def test_pytree_carry():
    def apply(p, carry):
        h, c = carry["h"], carry["c"]
        return {"h": jnp.tanh(h @ p["w"] + c), "c": c * 0.5}

    layers = stackwise.stack(init_layer, apply, 4, remat=True)
    params = layers.init(jax.random.key(0))
    carry = {"h": jnp.ones((2, D)), "c": jnp.full((2, D), 0.3)}
    ref = reference(params, carry, layer=apply)
    assert_trees_close(jax.jit(layers.apply)(params, carry), ref)


# --------------------------------------------------------------------------
# Tracing, unroll=True under disable_jit.


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"remat": True},
        {"unroll": 4},
        {"nested": True, "remat": True},
        {"nested": 4, "reverse": True},
        {"with_state": True},
    ],
)
def test_layer_is_traced_at_most_twice(options):
    calls = []

    def apply(p, *args):
        calls.append(1)
        if options.get("with_state"):
            s, x = args
            return apply_layer(p, x), s
        return apply_layer(p, args[0])

    def init(key):
        p = init_layer(key)
        return (p, jnp.zeros(())) if options.get("with_state") else p

    for n in (7, 50):
        calls.clear()
        layers = stackwise.stack(init, apply, n, **options)
        params = layers.init(jax.random.key(0))
        args = params if options.get("with_state") else (params,)
        x = jnp.ones((2, D))

        def loss(a, layers=layers, x=x):
            return jnp.sum(jnp.asarray(jax.tree.leaves(layers.apply(*a, x))[0]))

        jax.jit(jax.grad(loss))(args)
        assert 1 <= len(calls) <= 2, f"n={n}: traced {len(calls)} times"


def test_python_loop_runs_under_disable_jit():
    seen = []

    def apply(p, x):
        seen.append(float(x.sum()))  # concrete values: only possible without tracing
        return apply_layer(p, x)

    layers = stackwise.stack(init_layer, apply, 3, unroll=True, remat=True)
    params = layers.init(jax.random.key(0))
    with jax.disable_jit():
        y = layers.apply(params, jnp.ones((1, D)))
    assert len(seen) == 3
    assert_trees_close(y, reference(params, jnp.ones((1, D))))


# --------------------------------------------------------------------------
# Remat in the lowered program and in compiled memory.

# Shapes chosen so that params, constants and activations are told apart by type.
W_SHAPE, CONST_SHAPE, X_SHAPE = (5, 7), (1, 7), (3, 5)


def _remat_program(remat, unroll, n=3):
    const = jnp.linspace(0.0, 1.0, 7).reshape(CONST_SHAPE)

    def apply(p, x):  # closes over `const`: a constant of the program
        return jnp.tanh(jnp.sin(x @ p["w"]) * const @ p["w"].T)

    layers = stackwise.stack(
        lambda k: {"w": jax.random.normal(k, W_SHAPE)}, apply, n, remat=remat, unroll=unroll
    )
    params = layers.init(jax.random.key(0))
    f = jax.jit(jax.grad(lambda p, x: jnp.sum(layers.apply(p, x))))
    return f.lower(params, jnp.ones(X_SHAPE)).as_text()


@pytest.mark.parametrize("remat", [True, jax.checkpoint_policies.nothing_saveable])
def test_no_barriers_inside_the_scan(remat):
    assert "optimization_barrier" not in _remat_program(remat, unroll=1)
    assert "optimization_barrier" not in _remat_program(remat, unroll=2)


def test_unrolled_remat_barriers_protect_activations_only():
    text = _remat_program(True, unroll=True)
    types = barrier_operand_types(text)
    assert types, "expected optimization barriers around the rematerialised activations"
    assert "3x5xf32" in types  # the carry
    for t in types:
        assert t not in ("5x7xf32", "1x7xf32"), f"a param or constant passes a barrier: {t}"


@pytest.mark.parametrize("remat", [stackwise.DEFAULT_REMAT, True, False])
def test_scanned_program_is_a_plain_checkpointed_scan(remat):
    # The training step's program is exactly `lax.scan` of `jax.checkpoint(body,
    # prevent_cse=False, policy=...)` written by hand: no extra loop, barrier, slice or
    # convert (the stack's compile time is the hand-written scan's; what differs from
    # nn.scan or hk.layer_stack on a TPU is their blocks, not the scan).
    layers = stackwise.stack(init_layer, apply_layer, 4, remat=remat)
    params, x = layers.init(jax.random.key(0)), jnp.ones((2, D))
    body = lambda h, p: (apply_layer(p, h), None)  # noqa: E731
    if remat is not False:
        policy = None if remat is True else remat
        body = jax.checkpoint(body, prevent_cse=False, policy=policy)

    def program(apply):
        step = jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(apply(p, x) ** 2)))
        return step.lower(params, x).as_text(debug_info=False)

    by_hand = program(lambda p, h: jax.lax.scan(body, h, p)[0])
    assert "optimization_barrier" not in by_hand
    assert program(layers.apply) == by_hand


def test_carry_is_named_for_policies():
    # A policy that saves only the named carry behaves like plain remat.
    policy = jax.checkpoint_policies.save_only_these_names(stackwise.CARRY_NAME)
    layers = stackwise.stack(init_layer, apply_layer, 4, remat=policy)
    params = layers.init(jax.random.key(0))
    x = jnp.ones((2, D))
    jaxpr = str(jax.make_jaxpr(layers.apply)(params, x))
    assert stackwise.CARRY_NAME in jaxpr
    assert_trees_close(
        jax.grad(loss_of(layers.apply))(params, x), jax.grad(loss_of(reference))(params, x)
    )


def _grad_program(n, **options):
    def apply(p, x):
        h = jnp.tanh(x * p["a"])
        h = jnp.sin(h * p["b"]) + x
        return jnp.tanh(h)

    layers = stackwise.stack(
        lambda k: {"a": jax.random.normal(k, (1, 256)), "b": jnp.ones((1, 256))},
        apply,
        n,
        **options,
    )
    params = layers.init(jax.random.key(0))
    # (at 128 rows XLA:TPU counts 0 temp bytes in every variant, remat or not: 1024 there)
    x = jnp.ones((128 if on_cpu() else 1024, 256))
    f = jax.jit(jax.grad(lambda p, x: jnp.sum(layers.apply(p, x)), argnums=(0, 1)))
    return f.lower(params, x).compile(), lambda: f(params, x)


def test_remat_and_nested_remat_lower_compiled_temp_memory():
    n = 64
    options = {"plain": {"remat": False}, "default": {}, "flat": {"remat": True},
               "nested": {"remat": True, "nested": True}}
    # What each program keeps per layer: its temp bytes' growth from n/2 to n layers (a
    # backend's fixed buffers cancel; tests/_programs.py). Without remat each layer stores
    # several activations; with it, one carry per layer; nested keeps about 2*sqrt(n) carries.
    programs = {k: _grad_program(n, **o) for k, o in options.items()}
    temps = {k: temp_bytes(compiled) for k, (compiled, _) in programs.items()}
    grows = {k: temps[k] - temp_bytes(_grad_program(n // 2, **o)[0]) for k, o in options.items()}
    assert grows["flat"] < grows["plain"] and grows["default"] < grows["plain"], grows
    assert grows["nested"] <= grows["flat"], grows
    if on_cpu():  # and XLA:CPU's totals, whose fixed part is small (tests/_programs.py)
        # Nested remat's sqrt(n) carries show on XLA:CPU. XLA:TPU (a v5e, libtpu 0.0.42.1,
        # 2026-12-06) counts no temp bytes for the remat'ed programs at all, flat or nested
        # (the program without remat: 100 MB at n=32, 336 MB at 64), so there it is not shown.
        assert grows["nested"] < grows["flat"] / 2, grows
        assert temps["flat"] < temps["plain"] and temps["default"] < temps["plain"]
        assert temps["nested"] < temps["flat"] / 2, temps
    grads = {k: run() for k, (_, run) in programs.items()}
    assert_trees_close(grads["flat"], grads["plain"])
    assert_trees_close(grads["default"], grads["plain"])
    assert_trees_close(grads["nested"], grads["plain"])


# --------------------------------------------------------------------------
# Property-based: random pytrees, shapes and depths.


def _shapes():
    return hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=3)


@pytest.mark.slow
@settings(max_examples=6, deadline=None)
@given(
    n=st.integers(1, 6),
    shapes=st.dictionaries(st.sampled_from("abcde"), _shapes(), min_size=1, max_size=4),
    carry_shape=hnp.array_shapes(min_dims=1, max_dims=2, min_side=1, max_side=4),
    reverse=st.booleans(),
    remat=st.booleans(),
)
def test_random_pytrees_match_loop(n, shapes, carry_shape, reverse, remat):
    def init(key):
        keys = jax.random.split(key, len(shapes))
        return {name: jax.random.normal(k, s) for (name, s), k in zip(sorted(shapes.items()), keys)}

    def apply(p, x):
        total = sum(jnp.sum(jnp.sin(leaf)) for leaf in jax.tree.leaves(p))
        return jnp.tanh(x * total + 0.1)

    layers = stackwise.stack(init, apply, n, reverse=reverse, remat=remat)
    key = jax.random.key(n)
    params = layers.init(key)
    for name, s in shapes.items():
        assert params[name].shape == (n, *s)
    jax.tree.map(
        np.testing.assert_array_equal,
        params,
        stackwise.stack_layers([init(k) for k in jax.random.split(key, n)]),
    )
    x = jnp.linspace(-1.0, 1.0, int(np.prod(carry_shape))).reshape(carry_shape)
    ref = lambda p, x: reference(p, x, layer=apply, reverse=reverse)  # noqa: E731
    assert_trees_close(jax.jit(layers.apply)(params, x), ref(params, x))
    # A layer sums sin over up to 4 leaves of 27 values each and the gradient flows back
    # through every later layer's tanh of that sum: float32 rounding of the sums, taken in
    # another order by the scan and the loop (about 1e-5 absolute, on grads of up to ~10).
    assert_trees_close(
        jax.grad(loss_of(layers.apply))(params, x),
        jax.grad(loss_of(ref))(params, x),
        RANDOM_SUM_BOUND,
    )


# Summed-then-differentiated random pytrees (test_random_pytrees_match_loop): up to 6 layers, each
# summing up to 4 x 27 values, the grads summing over a carry of up to 16 entries:
# 6 * (2 * 6 * sqrt(108) + sqrt(16)) = 773 eps * the leaf's largest magnitude (tests/_tolerance.py).
RANDOM_SUM_BOUND = reassociation_bound(depth=6, width=4 * 27, summed=16)


# --------------------------------------------------------------------------
# Errors.


def test_bad_n():
    with pytest.raises(ValueError, match="`n` must be at least 1, got 0"):
        stackwise.stack(init_layer, apply_layer, 0)
    with pytest.raises(TypeError, match=r"`n` must be a Python int.*float 2.0"):
        stackwise.stack(init_layer, apply_layer, 2.0)
    with pytest.raises(TypeError, match="`n` must be a Python int"):
        stackwise.stack(init_layer, apply_layer, True)


def test_not_callable():
    with pytest.raises(TypeError, match="`apply` must be callable, got dict"):
        stackwise.stack(init_layer, {"w": 1}, 2)
    with pytest.raises(TypeError, match="`init` must be callable"):
        stackwise.stack(3, apply_layer, 2)


def test_apply_only_stack_makes_no_params():
    layers = stackwise.stack(None, apply_layer, 2)
    params = stackwise.stack(init_layer, apply_layer, 2).init(jax.random.key(0))
    assert layers.apply(params, jnp.ones((2, D))).shape == (2, D)
    with pytest.raises(TypeError, match=r"built without `init`.*stack_layers"):
        layers.init(jax.random.key(0))


def test_bad_remat_and_unroll():
    with pytest.raises(TypeError, match=r"`remat` must be False, True or a policy.*'full'"):
        stackwise.stack(init_layer, apply_layer, 2, remat="full")
    with pytest.raises(TypeError, match="`unroll` must be a positive int"):
        stackwise.stack(init_layer, apply_layer, 2, unroll=0)
    with pytest.raises(TypeError, match="`nested` must be a bool or a positive int"):
        stackwise.stack(init_layer, apply_layer, 2, nested=-1)


def test_params_of_the_wrong_depth_list_the_leaves():
    params = stackwise.stack(init_layer, apply_layer, 3).init(jax.random.key(0))
    layers = stackwise.stack(init_layer, apply_layer, 4)
    match = r"(?s)length n=4.*\['b'\]: shape \(3, 1, 4\).*\['w'\]: shape \(3, 4, 4\)"
    with pytest.raises(ValueError, match=match):
        layers.apply(params, jnp.ones((2, D)))


@pytest.mark.parametrize("unroll", [1, True])
def test_layer_changing_the_carry(unroll):
    params = stackwise.stack(init_layer, apply_layer, 2).init(jax.random.key(0))
    x = {"h": jnp.ones((2, D))}

    def grows(p, x):
        return {"h": jnp.concatenate([x["h"], x["h"]], axis=0)}

    def casts(p, x):
        return {"h": x["h"].astype(jnp.bfloat16)}

    def restructures(p, x):
        return {"h": x["h"], "extra": x["h"]}

    for fn, pattern in [
        (grows, r"carry leaf `x\['h'\]` from float32\[2, 4\] to float32\[4, 4\].*reshape"),
        (casts, r"float32\[2, 4\] to bfloat16\[2, 4\].*x\['h'\].astype\(jnp.float32\)"),
        (restructures, r"(?s)same pytree structure.*has_aux=True"),
    ]:
        layers = stackwise.stack(init_layer, fn, 2, unroll=unroll)
        with pytest.raises(TypeError, match=pattern):
            jax.jit(layers.apply)(params, x)


def test_per_layer_input_of_the_wrong_depth():
    layers = stackwise.stack(init_layer, lambda p, x, s: x * s, 3)
    params = layers.init(jax.random.key(0))
    with pytest.raises(
        ValueError, match=r"(?s)argument \*\*kwargs\['s'\].*length n=3.*shape \(2,\)"
    ):
        layers.apply(params, jnp.ones(2), s=stackwise.per_layer(jnp.ones(2)))
    with pytest.raises(ValueError, match=r"argument \*args\[0\]\['a'\]"):
        layers.apply(params, jnp.ones(2), {"a": stackwise.per_layer(jnp.ones((4,)))})


def test_apply_called_without_x():
    layers = stackwise.stack(init_layer, apply_layer, 2)
    with pytest.raises(TypeError, match=r"apply\(params, x"):
        layers.apply({})
    stateful = stackwise.stack(counter_init, counter_apply, 2, with_state=True)
    with pytest.raises(TypeError, match=r"apply\(params, state, x"):
        stateful.apply({}, jnp.ones(2))
