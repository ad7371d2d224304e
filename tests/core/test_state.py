"""Per-layer state written in place: decoding with a stacked KV cache, against a loop.

A layer that writes its cache with `lax.dynamic_update_slice` gets the cache
updated in place in the stacked state; the compiled decode step reads and writes
the donated cache without a copy (checked in the compiled module's aliases and in
`memory_analysis`, not timed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _attention import attention_layer
from _programs import assert_aliases_exactly, assert_no_copy_per_layer, nbytes, on_cpu
from _trees import assert_trees_close

import stackwise

B, T, D, HEADS = 2, 64, 16, 2  # batch, cache length, width, heads
init, attend = attention_layer(B, T, D, HEADS)


def _loop_step(per_layer, caches, x, pos):
    new = []
    for p, c in zip(per_layer, caches):
        x, c = attend(p, c, x, pos)
        new.append(c)
    return x, new


@pytest.mark.parametrize(
    "options",
    [{"remat": False}, {}, {"reverse": True, "unroll": True}, {"nested": True, "unroll": 2}],
    ids=["no-remat", "default", "reverse-python-loop", "nested"],
)
def test_prefill_and_decode_match_the_loop(options):
    n = 4
    layers = stackwise.stack(init, attend, n, with_state=True, **options)
    params, cache = layers.init(jax.random.key(0))
    per_layer = stackwise.unstack_layers(params)
    caches = stackwise.unstack_layers(cache)
    loop_step = jax.jit(_loop_step, donate_argnums=1)
    reverse = options.get("reverse", False)
    if reverse:  # the loop runs the layers in the same order as the stack
        per_layer, caches = per_layer[::-1], caches[::-1]
    step = jax.jit(layers.apply, donate_argnums=1)
    prompt = jax.random.normal(jax.random.key(1), (B, 5, D))
    y, cache = step(params, cache, prompt, jnp.int32(0))
    y_loop, caches = loop_step(per_layer, caches, prompt, jnp.int32(0))
    assert_trees_close(y, y_loop)
    x = y[:, -1:]
    for pos in range(5, 12):  # token by token
        y, cache = step(params, cache, x, jnp.int32(pos))
        y_loop, caches = loop_step(per_layer, caches, x, jnp.int32(pos))
        assert_trees_close(y, y_loop)
        x = jnp.tanh(y)
    expected = stackwise.stack_layers(caches[::-1] if reverse else caches)
    assert_trees_close(cache, expected)


def _decode_program(n):
    layers = stackwise.stack(init, attend, n, with_state=True)
    params, cache = jax.eval_shape(layers.init, jax.random.key(0))
    x = jax.ShapeDtypeStruct((B, 1, D), jnp.float32)
    step = jax.jit(layers.apply, donate_argnums=1)
    return step.lower(params, cache, x, jnp.int32(3)).compile(), cache


@pytest.mark.parametrize("n", [24, 48])
def test_decode_step_updates_the_donated_cache_without_a_copy(n):
    compiled, cache = _decode_program(n)
    leaves = jax.tree.leaves(cache)
    # The new cache is the donated input's buffer (the compiled module's aliases)...
    assert_aliases_exactly(compiled, leaves)
    # ...and nothing of the cache's size is allocated on the way: the temporaries do not grow
    # with the cache (a copy of it would grow them by its bytes).
    shallow, shallow_cache = _decode_program(n // 2)
    assert_no_copy_per_layer(shallow, compiled, jax.tree.leaves(shallow_cache), leaves)
    if on_cpu():  # XLA:CPU's bytes are the arrays' own (tests/_programs.py): exact figures
        memory = compiled.memory_analysis()
        assert memory.alias_size_in_bytes == nbytes(leaves)
        # about one layer's slices (what the attention reads), not a copy of the cache
        assert memory.temp_size_in_bytes <= 0.1 * nbytes(leaves)


def test_the_old_arrangement_would_fail_the_memory_check():
    """The check above can fail: on XLA:CPU a cache returned whole from every layer is
    copied."""

    def rewrite(params, cache, x, pos):  # the same values, but not a dynamic_update_slice
        y, new = attend(params, cache, x, pos)
        return y, jax.tree.map(lambda a: a * 1.0 + 0.0 * jnp.sum(x), new)

    def program(n):
        layers = stackwise.stack(init, rewrite, n, with_state=True)
        params, cache = jax.eval_shape(layers.init, jax.random.key(0))
        x = jax.ShapeDtypeStruct((B, 1, D), jnp.float32)
        compiled = jax.jit(layers.apply, donate_argnums=1).lower(params, cache, x, 3).compile()
        return compiled, jax.tree.leaves(cache)

    if jax.default_backend() not in ("cpu", "tpu"):
        pytest.skip("what XLA makes of this arrangement is known for XLA:CPU and XLA:TPU only")
    (shallow, shallow_leaves), (compiled, leaves) = program(4), program(8)
    if not on_cpu():
        # XLA:TPU (a v5e, libtpu 0.0.42.1, 2026-12-06) writes even this arrangement's new
        # cache into the donated buffer: no copy for the check to catch, and it passes.
        assert_no_copy_per_layer(shallow, compiled, shallow_leaves, leaves)
        return
    with pytest.raises(AssertionError):
        assert_no_copy_per_layer(shallow, compiled, shallow_leaves, leaves)
    assert compiled.memory_analysis().temp_size_in_bytes > 0.5 * nbytes(leaves)


def test_writes_inside_jitted_helpers_chains_and_untouched_leaves():
    """Two writes to one leaf, one through `dynamic_update_index_in_dim` (a jitted
    helper), a leaf returned unchanged, and a counter computed afresh."""

    def init2(key):
        return {"w": jax.random.normal(key, (D,))}, {
            "buf": jnp.zeros((T, D)),
            "fixed": jnp.arange(3.0),
            "count": jnp.zeros((), jnp.int32),
        }

    def apply2(params, state, x, pos):
        buf = jax.lax.dynamic_update_index_in_dim(state["buf"], x * params["w"], pos, 0)
        buf = jax.lax.dynamic_update_slice(buf, (x + 1.0)[None], (pos + 1, 0))
        y = x + buf.sum(0) * 0.01
        return y, {"buf": buf, "fixed": state["fixed"], "count": state["count"] + 1}

    n = 3
    layers = stackwise.stack(init2, apply2, n, with_state=True)
    params, state = layers.init(jax.random.key(0))
    x = jnp.ones(D)
    y, new = jax.jit(layers.apply, donate_argnums=1)(params, state, x, jnp.int32(4))
    params_l = stackwise.unstack_layers(params)
    states_l = stackwise.unstack_layers(jax.tree.map(jnp.zeros_like, new))
    for i in range(n):
        states_l[i] = {"buf": jnp.zeros((T, D)), "fixed": jnp.arange(3.0), "count": jnp.int32(0)}
        x, states_l[i] = apply2(params_l[i], states_l[i], x, jnp.int32(4))
    assert_trees_close(y, x)
    assert_trees_close(new, stackwise.stack_layers(states_l))
    np.testing.assert_array_equal(new["count"], np.ones(n))


def test_a_layer_without_state_is_run_directly_not_from_its_jaxpr(monkeypatch):
    """A stateful Stack's layer with no state leaves (every adapter's training step: Haiku's
    Stack always runs with state) has nothing to update in place: it runs as a stateless
    layer does, and its jaxpr is not evaluated a second time to find updates."""
    from stackwise._core import inplace

    evaluated = []
    evaluate = inplace._evaluate
    monkeypatch.setattr(inplace, "_evaluate", lambda *a: evaluated.append(1) or evaluate(*a))

    def init(key):
        return {"w": jax.random.normal(key, (D, D)) / D**0.5}

    def plain(params, x):
        return jnp.tanh(x @ params["w"])

    def counting(params, state, x):
        return plain(params, x), jax.tree.map(lambda c: c + 1, state)

    x = jnp.ones((2, D))
    without = stackwise.stack(init, plain, 3)
    params = without.init(jax.random.key(0))
    expected = jax.jit(jax.grad(lambda p: without.apply(p, x).sum()))(params)
    for state, runs in (({}, False), ({"count": jnp.zeros(3, jnp.int32)}, True)):
        stateful = stackwise.stack(lambda k, s=state: (init(k), s), counting, 3, with_state=True)

        def loss(p, s=state, layers=stateful):
            return layers.apply(p, s, x)[0].sum()

        grads = jax.jit(jax.grad(loss))(params)
        assert bool(evaluated) == runs, state  # (a layer with state is evaluated from its jaxpr)
        assert_trees_close(grads, expected)


@pytest.mark.slow
def test_state_under_grad_matches_the_loop():
    """Differentiating through a stateful decode step: the in-place path is differentiable."""
    n = 3
    layers = stackwise.stack(init, attend, n, with_state=True)
    params, cache = layers.init(jax.random.key(0))
    cache = jax.tree.map(lambda a: jax.random.normal(jax.random.key(2), a.shape), cache)
    x = jax.random.normal(jax.random.key(1), (B, 1, D))

    def loss(params, cache):
        y, new = layers.apply(params, cache, x, jnp.int32(2))
        return jnp.sum(y**2) + sum(jnp.sum(jnp.sin(a)) for a in jax.tree.leaves(new))

    def loss_loop(params, cache):
        y, new = _loop_step(
            stackwise.unstack_layers(params), stackwise.unstack_layers(cache), x, jnp.int32(2)
        )
        return jnp.sum(y**2) + sum(jnp.sum(jnp.sin(a)) for a in jax.tree.leaves(new))

    g = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, cache)
    g_loop = jax.grad(loss_loop, argnums=(0, 1))(params, cache)
    assert_trees_close(g, g_loop)


# --------------------------------------------------------------------------
# unroll=True: each layer's state written through into its row of the stacked state.


def _unrolled_program(n, how):
    if how == "unroll=True":
        layers = stackwise.stack(init, attend, n, with_state=True, unroll=True)
        fn = layers.apply
    else:  # Stacked.decode of a scanned (and nested) stack
        fn = (layers := stackwise.stack(init, attend, n, with_state=True, nested=True)).decode
    params, cache = jax.eval_shape(layers.init, jax.random.key(0))
    x = jax.ShapeDtypeStruct((B, 1, D), jnp.float32)
    step = jax.jit(fn, donate_argnums=1)
    return step.lower(params, cache, x, jnp.int32(3)).compile(), cache


@pytest.mark.parametrize("how", ["unroll=True", "Stacked.decode"])
def test_an_unrolled_decode_writes_each_layers_row_of_the_donated_cache_in_place(how):
    """The Python loop of layers reads and writes row i of the stacked cache (on a TPU v5e,
    compiled, no copy of a layer's cache at all: benchmarks/results/tpu_decode_hlo.md), where
    setting back an updated slice would copy every layer's cache."""
    compiled, cache = _unrolled_program(16, how)
    leaves = jax.tree.leaves(cache)
    assert_aliases_exactly(compiled, leaves)
    if how == "Stacked.decode":  # the loop's program: no while loop
        assert " while(" not in compiled.as_text()
    shallow, shallow_cache = _unrolled_program(8, how)
    assert_no_copy_per_layer(shallow, compiled, jax.tree.leaves(shallow_cache), leaves)


def _counting(params, state, x):
    """A layer whose state is computed afresh (no update of a slice): the same layout."""
    return x + state["seen"][:, None] * params, {"seen": state["seen"] + x.sum(-1)}


def _growing(params, state, x):
    """A layer whose new state has another layout than the state it was given."""
    return x * params, {"seen": state["seen"], "sum": x.sum(-1)}


def _returns_its_cache(params, cache, x, pos):
    """Writes its cache, then also returns it in its output (read after the write)."""
    y, cache = attend(params, cache, x, pos)
    return y + cache["k"][:, :1].reshape(y.shape[0], 1, -1)[..., : y.shape[-1]], cache


@pytest.mark.parametrize("layer", ["afresh", "new layout", "cache in the output", "pattern"])
def test_unrolled_state_equals_the_scans(layer):
    n, key, x = 5, jax.random.key(1), jax.random.normal(jax.random.key(2), (B, 1, D))
    if layer in ("afresh", "new layout"):
        fn = _counting if layer == "afresh" else _growing
        params, state = jnp.linspace(0.5, 1.5, n), {"seen": jnp.ones((n, B))}
        args = (x[:, 0],)
        scanned = stackwise.stack(None, fn, n, with_state=True)
        unrolled = stackwise.stack(None, fn, n, with_state=True, unroll=True)
    else:
        fn = _returns_its_cache if layer == "cache in the output" else attend
        inits = init if layer != "pattern" else [init, init]
        applies = fn if layer != "pattern" else [fn, _returns_its_cache]
        scanned = stackwise.stack(inits, applies, n, with_state=True)
        unrolled = stackwise.stack(inits, applies, n, with_state=True, unroll=True)
        params, state = scanned.init(key)
        state = jax.tree.map(lambda a: jax.random.normal(key, a.shape, a.dtype), state)
        args = (x, jnp.int32(3))
    expected = scanned.apply(params, state, *args)
    assert_trees_close(jax.jit(unrolled.apply)(params, state, *args), expected)
    assert_trees_close(jax.jit(scanned.decode)(params, state, *args), expected)
    grads = [jax.grad(lambda p, f=f: f(p, state, *args)[0].sum())(params)
             for f in (scanned.apply, unrolled.apply, scanned.decode)]
    assert_trees_close(grads[1], grads[0])
    assert_trees_close(grads[2], grads[0])


def test_unrolled_state_without_the_jaxpr_ties_is_stacked_as_before(monkeypatch):
    """Where stackwise's ties to JAX's evaluation loop do not hold (a newer JAX), no row is
    written through: each layer's new state is stacked, as a scan's: the same values."""
    from stackwise._core import through

    monkeypatch.setattr(through, "_ties_hold", lambda: False)
    layers = stackwise.stack(init, attend, 3, with_state=True, unroll=True)
    params, cache = layers.init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(2), (B, 1, D))
    expected = stackwise.stack(init, attend, 3, with_state=True).apply(params, cache, x, 3)
    assert_trees_close(layers.apply(params, cache, x, 3), expected)


def test_unrolled_state_computed_afresh_is_not_written_through():
    """State computed afresh (running statistics) is stacked, not written through: written
    through, under jax.grad each layer's residuals would hold the whole stacked state, and the
    backward pass's memory would grow as n**2 (written through, this program's temp grew by
    40 MB from n=8 to 32 on the CPU; stacked, as a scan's, by nothing)."""

    def temp(n, unroll):
        layers = stackwise.stack(None, _counting, n, with_state=True, unroll=unroll)
        params, state = jnp.ones((n,)), {"seen": jnp.zeros((n, 4096))}
        x = jnp.ones((4096, 8))
        grad = jax.jit(jax.grad(lambda p: layers.apply(p, state, x)[0].sum()))
        return grad.lower(params).compile().memory_analysis().temp_size_in_bytes

    grown = temp(32, True) - temp(8, True)
    linear = (32 - 8) * 4096 * 4  # the stacked state's own growth: a few of it at most
    assert grown - (temp(32, 1) - temp(8, 1)) <= 2 * linear
