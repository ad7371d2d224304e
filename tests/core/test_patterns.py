"""Layer patterns: `stackwise.stack([init_a, ...], [apply_a, ...], n)` against a Python loop.

Layer i runs kind ``i % k``; the reference is the loop
``[init[i % k](keys[i]) for i in range(n)]`` then ``x = apply[i % k](params_i, x)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _tolerance import reassociation_bound
from _trees import assert_trees_close, assert_trees_equal
from hypothesis import given, settings
from hypothesis import strategies as st

import stackwise

D, H, T = 4, 6, 5  # width, hidden width, buffer length of the stateful layers


def _dense_init(key):
    return {"w": jax.random.normal(key, (D, D)) / D**0.5}


def _dense(p, x):
    return x + jnp.tanh(x @ p["w"])


def _gate_init(key):
    return {"s": jax.random.normal(key, (1, D))}


def _gate(p, x):
    return x * jax.nn.sigmoid(p["s"])


def _mlp_init(key):
    k1, k2 = jax.random.split(key)
    return {"u": jax.random.normal(k1, (D, H)) / D**0.5, "v": jax.random.normal(k2, (H, D)) / H}


def _mlp(p, x):
    return x + jax.nn.gelu(x @ p["u"]) @ p["v"]


KINDS = [(_dense_init, _dense), (_gate_init, _gate), (_mlp_init, _mlp)]


def pattern(k, *, state=False, aux=False, inputs=False):
    """k kinds of layers (cycling through KINDS), with optional state, aux and inputs.

    A stateful layer counts its calls and writes its input's first row into a
    buffer at ``pos`` (the in-place path), then reads the buffer back.
    """
    inits, applies = [], []
    for p in range(k):
        make, run = KINDS[p % len(KINDS)]

        def init(key, make=make):
            params = make(key)
            if state:
                return params, {"calls": jnp.zeros((), jnp.int32), "buf": jnp.zeros((T, D))}
            return params

        def apply(params, *args, run=run, p=p):
            if state:
                s, x, *args = args
            else:
                x, *args = args
            if inputs:
                scale, index, key = args[:3]
                x = x * scale + 0.01 * index + 0.1 * jax.random.normal(key, x.shape)
            y = run(params, x)
            if state:
                buf = jax.lax.dynamic_update_slice(s["buf"], y[:1], (args[-1], 0))
                y = y + 0.1 * jnp.mean(buf)
                s = {"calls": s["calls"] + 1, "buf": buf}
            out = (y, {"p": jnp.float32(p), "sum": jnp.sum(y)}) if aux else y
            return (out, s) if state else out

        inits.append(init)
        applies.append(apply)
    return inits, applies


def loop(inits, applies, n, key, x, *, reverse=False, state=None, args_of=lambda i: ()):
    """The reference: per-layer params from the split keys, one layer after another."""
    k = len(inits)
    keys = jax.random.split(key, n)
    made = [inits[i % k](keys[i]) for i in range(n)]
    params = [m[0] if state is not None else m for m in made]
    states = [m[1] for m in made] if state is not None else None
    auxes = [None] * n
    for i in reversed(range(n)) if reverse else range(n):
        a = args_of(i)
        if state is not None:
            out, states[i] = applies[i % k](params[i], states[i], x, *a)
        else:
            out = applies[i % k](params[i], x, *a)
        x, auxes[i] = out if isinstance(out, tuple) else (out, None)
    return params, states, x, auxes


def regroup(per_layer, k):
    """n per-layer trees -> a tuple of k stacked trees (position p: layers p, p+k, ...)."""
    return tuple(stackwise.stack_layers(per_layer[p::k]) for p in range(k))


CASES = [
    # k, n, options
    (1, 5, {}),
    (2, 5, {"reverse": True}),
    (2, 2, {"remat": False}),
    (3, 7, {"remat": True, "unroll": 2}),
    (3, 8, {"nested": True, "reverse": True}),
    (3, 4, {"unroll": True}),
    (6, 13, {"nested": 1}),
    (6, 14, {"remat": False, "reverse": True, "unroll": True}),
]


@pytest.mark.parametrize("k,n,options", CASES)
def test_outputs_and_grads_match_the_loop(k, n, options):
    inits, applies = pattern(k)
    layers = stackwise.stack(inits, applies, n, **options)
    key, x = jax.random.key(k * 100 + n), jax.random.normal(jax.random.key(1), (3, D))
    params = layers.init(key)
    loop_params, _, y_loop, _ = loop(
        inits, applies, n, key, x, reverse=options.get("reverse", False)
    )
    assert isinstance(params, tuple) and len(params) == k
    assert_trees_equal(params, regroup(loop_params, k))  # bitwise: the same keys

    def loss_stack(params, x):
        return jnp.sum(jnp.sin(layers.apply(params, x)))

    def loss_loop(per_layer, x):
        reverse = options.get("reverse", False)
        for i in reversed(range(n)) if reverse else range(n):
            x = applies[i % k](per_layer[i], x)
        return jnp.sum(jnp.sin(x))

    y = jax.jit(layers.apply)(params, x)
    assert_trees_close(y, y_loop)
    grads = jax.jit(jax.grad(loss_stack, argnums=(0, 1)))(params, x)
    g_loop, gx_loop = jax.grad(loss_loop, argnums=(0, 1))(loop_params, x)
    assert_trees_close(grads, (regroup(g_loop, k), gx_loop))


@pytest.mark.parametrize(
    "k,n,reverse,unroll", [(1, 4, False, 1), (2, 5, True, 1), (3, 7, False, True)]
)
def test_state_aux_and_per_layer_inputs_match_the_loop(k, n, reverse, unroll):
    inits, applies = pattern(k, state=True, aux=True, inputs=True)
    layers = stackwise.stack(
        inits, applies, n, with_state=True, has_aux=True, reverse=reverse, unroll=unroll
    )
    key, x = jax.random.key(3), jax.random.normal(jax.random.key(4), (2, D))
    scales, rng, pos = jnp.linspace(0.5, 1.5, n), jax.random.key(5), jnp.int32(2)
    params, state = layers.init(key)
    keys = jax.random.split(rng, n)
    loop_params, loop_states, y_loop, aux_loop = loop(
        inits,
        applies,
        n,
        key,
        x,
        reverse=reverse,
        state=True,
        args_of=lambda i: (scales[i], jnp.int32(i), keys[i], pos),
    )
    (y, aux), new_state = jax.jit(layers.apply)(
        params,
        state,
        x,
        stackwise.per_layer(scales),
        stackwise.layer_index(),
        stackwise.per_layer_keys(rng),
        pos,
    )
    assert_trees_close(y, y_loop)
    assert_trees_close(new_state, regroup(loop_states, k))
    assert_trees_close(aux, regroup(aux_loop, k))
    # Each position's aux says which kind ran: position p holds kind p's layers.
    for p in range(k):
        assert aux[p]["p"].tolist() == [float(p)] * len(range(p, n, k))


def test_a_list_of_one_is_a_pattern_of_one():
    inits, applies = pattern(1)
    layers = stackwise.stack(inits, applies, 3)
    params = layers.init(jax.random.key(0))
    assert isinstance(params, tuple) and len(params) == 1
    single = stackwise.stack(inits[0], applies[0], 3)
    assert_trees_equal(params[0], single.init(jax.random.key(0)))
    x = jnp.ones((2, D))
    assert_trees_equal(layers.apply(params, x), single.apply(params[0], x))


def test_each_position_is_traced_at_most_twice_and_the_program_does_not_grow():
    calls = {p: 0 for p in range(3)}
    inits, applies = pattern(3)

    def counted(p):
        def apply(params, x):
            calls[p] += 1
            return applies[p](params, x)

        return apply

    sizes = {}
    for n in (6, 8, 60, 62):
        for p in calls:
            calls[p] = 0
        layers = stackwise.stack(inits, [counted(p) for p in range(3)], n)
        params = jax.eval_shape(layers.init, jax.random.key(0))
        grad = jax.grad(lambda params, x, layers=layers: jnp.sum(layers.apply(params, x)))
        text = jax.jit(grad).lower(params, jnp.ones((2, D))).as_text()
        assert all(1 <= c <= 2 for c in calls.values()), (n, calls)
        sizes[n] = len([line for line in text.splitlines() if "=" in line])
    # Whole repeats only (6, 60) and with a remainder (8, 62): the same program size.
    assert sizes[60] == sizes[6]
    assert sizes[62] == sizes[8]


@pytest.mark.slow
@settings(deadline=None, max_examples=12)
@given(k=st.integers(1, 4), extra=st.integers(0, 5), reverse=st.booleans())
def test_random_patterns_match_the_loop(k, extra, reverse):
    n = k + extra
    inits, applies = pattern(k)
    layers = stackwise.stack(inits, applies, n, reverse=reverse, remat=False)
    key, x = jax.random.key(n), jnp.linspace(-1, 1, 2 * D).reshape(2, D)
    _, _, y_loop, _ = loop(inits, applies, n, key, x, reverse=reverse)
    # Up to 9 layers of sums of up to H terms: 6 * (2 * 9 * sqrt(6) + 1) = 271 eps * the largest
    # magnitude (tests/_tolerance.py).
    bound = reassociation_bound(depth=9, width=H)
    assert_trees_close(layers.apply(layers.init(key), x), y_loop, bound)


def test_pattern_errors():
    inits, applies = pattern(3)
    with pytest.raises(ValueError, match=r"3 `init` functions but 2 `apply`"):
        stackwise.stack(inits, applies[:2], 5)
    with pytest.raises(TypeError, match=r"`init` and `apply` are both sequences"):
        stackwise.stack(inits[0], applies, 5)
    with pytest.raises(ValueError, match=r"pattern of 3 layers needs n >= 3"):
        stackwise.stack(inits, applies, 2)
    with pytest.raises(TypeError, match=r"`apply\[1\]` must be callable"):
        stackwise.stack(inits, [applies[0], 3, applies[2]], 5)
    layers = stackwise.stack(inits, applies, 5)
    params = layers.init(jax.random.key(0))
    with pytest.raises(TypeError, match=r"tuple of 3 stacked trees"):
        layers.apply(params[0], jnp.ones((2, D)))
    wrong = (params[0], params[1], jax.tree.map(lambda a: jnp.concatenate([a, a]), params[2]))
    with pytest.raises(ValueError, match=r"pattern position 2.*length n=1"):
        layers.apply(wrong, jnp.ones((2, D)))
