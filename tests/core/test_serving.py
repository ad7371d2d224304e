"""The serving layout (`stackwise.to_serving`): per-layer buffers run as a Python loop by the
same `Stacked.apply`, against the scanned apply and a loop over per-layer slices.

Serving and the loop do the same arithmetic layer by layer, so their outputs are compared
bitwise; the scan is compared within the shared bound (tests/_trees.py). The donated cache
is shown written in place (the compiled program's aliases and temp memory, not timed).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _attention import attention_layer, decode
from _programs import (
    aliased_inputs,
    assert_aliases_exactly,
    assert_no_copy_per_layer,
    nbytes,
    on_cpu,
)
from _tiers import examples
from _trees import assert_trees_bitwise, assert_trees_close
from hypothesis import given, settings
from hypothesis import strategies as st

import stackwise

B, T, D, HEADS = 2, 16, 8, 2  # batch, cache length, width, heads
KEY = jax.random.key(0)
init, attend = attention_layer(B, T, D, HEADS)


def _loop(apply, per_layer, states, x, *args, reverse=False):
    """The reference: a Python loop over per-layer slices, each state returned whole."""
    order = range(len(per_layer))
    new = list(states)
    for i in reversed(order) if reverse else order:
        x, new[i] = apply(per_layer[i], states[i], x, *args)
    return x, new


def _decode(step, params, cache, prompt):
    return decode(step, params, cache, prompt, steps=4)


@pytest.mark.parametrize(
    "options",
    [{"remat": False}, {}, {"reverse": True}, {"unroll": 2}],
    ids=["no-remat", "default", "reverse", "unroll-2"],
)
def test_prefill_and_decode_equal_the_loop_and_the_scan(options):
    n = 4
    layers = stackwise.stack(init, attend, n, with_state=True, **options)
    params, cache = layers.init(KEY)
    prompt = jax.random.normal(jax.random.key(1), (B, 5, D))
    step = jax.jit(layers.apply, donate_argnums=1)
    served = stackwise.to_serving(params)
    ys, served_cache = _decode(step, served, stackwise.to_serving(cache), prompt)
    assert isinstance(served_cache, stackwise.Serving) and len(served_cache) == n

    reverse = options.get("reverse", False)
    loop = jax.jit(lambda p, c, x, pos: _loop(attend, p, c, x, pos, reverse=reverse))
    ys_loop, caches = _decode(loop, served.layers, stackwise.unstack_layers(cache), prompt)
    for y, y_loop in zip(ys, ys_loop):
        assert_trees_bitwise(y, y_loop)  # the same arithmetic, layer by layer
    assert_trees_bitwise(served_cache.layers, tuple(caches))

    ys_scan, scan_cache = _decode(step, params, cache, prompt)
    for y, y_scan in zip(ys, ys_scan):
        assert_trees_close(y, y_scan)
    assert_trees_close(stackwise.from_serving(served_cache), scan_cache)


def _program(n, serving):
    """The compiled decode step with the cache donated: stackwise's, in the serving layout or
    stacked, or (``serving=None``) the hand-written loop over per-layer buffers."""
    layers = stackwise.stack(init, attend, n, with_state=True)
    params, cache = jax.eval_shape(layers.init, KEY)
    step = jax.jit(layers.apply, donate_argnums=1)
    if serving is not False:
        params, cache = stackwise.to_serving(params), stackwise.to_serving(cache)
    if serving is None:
        params, cache = params.layers, cache.layers
        step = jax.jit(lambda p, c, x, pos: _loop(attend, p, c, x, pos), donate_argnums=1)
    x = jax.ShapeDtypeStruct((B, 1, D), jnp.float32)
    return step.lower(params, cache, x, jnp.int32(3)).compile(), cache


@pytest.mark.parametrize("n", [8, 24])
def test_decode_writes_each_donated_cache_buffer_in_place(n):
    compiled, cache = _program(n, serving=True)
    leaves = jax.tree.leaves(cache)
    # Every layer's key and value buffer is its own output's: 2n aliases...
    assert len(leaves) == 2 * n
    assert_aliases_exactly(compiled, leaves)
    # ...and no copy: the temporaries grow with the depth by less than half the cache.
    shallow, shallow_cache = _program(n // 2, serving=True)
    assert_no_copy_per_layer(shallow, compiled, jax.tree.leaves(shallow_cache), leaves)
    if on_cpu():  # XLA:CPU's bytes are the arrays' own, and its scheduler lays out the serving
        # program and the hand-written loop alike (tests/_programs.py); a TPU tiles and
        # schedules buffers of its own, so the figures below are XLA:CPU's.
        memory = compiled.memory_analysis()
        assert memory.alias_size_in_bytes == nbytes(leaves)
        # The temporaries are the hand-written loop's, byte for byte (the scanned decode's are
        # larger: it slices each layer's weights and writes the stacked cache).
        loop_temp = _program(n, serving=None)[0].memory_analysis().temp_size_in_bytes
        assert memory.temp_size_in_bytes == loop_temp
        assert _program(n, serving=False)[0].memory_analysis().temp_size_in_bytes > loop_temp


def test_a_cache_not_donated_is_copied():
    """The check above can fail: without donation the new cache is a fresh buffer."""
    layers = stackwise.stack(init, attend, 8, with_state=True)
    params, cache = jax.eval_shape(layers.init, KEY)
    params, cache = stackwise.to_serving(params), stackwise.to_serving(cache)
    x = jax.ShapeDtypeStruct((B, 1, D), jnp.float32)
    compiled = jax.jit(layers.apply).lower(params, cache, x, jnp.int32(3)).compile()
    assert aliased_inputs(compiled) == []
    assert compiled.memory_analysis().alias_size_in_bytes == 0


def test_the_serving_program_slices_no_stacked_weight():
    """The scanned decode slices each stacked weight per layer; the serving one has no
    dynamic slice of a weight at all (each layer's weights are whole arguments)."""

    def slices(params, cache):
        layers = stackwise.stack(None, attend, 6, with_state=True, remat=False)
        x = jnp.ones((B, 1, D))
        text = jax.jit(layers.apply).lower(params, cache, x, jnp.int32(3)).as_text()
        return text.count(f"tensor<1x{D}x{3 * D}xf32>")  # one layer's qkv slice

    layers = stackwise.stack(init, attend, 6, with_state=True)
    params, cache = layers.init(KEY)
    assert slices(params, cache) > 0
    assert slices(stackwise.to_serving(params), stackwise.to_serving(cache)) == 0


def _mlp_init(key, d=D):
    return {"w": jax.random.normal(key, (d, d)) / d**0.5, "b": jnp.zeros((1, d))}


def _mlp(p, x, scale=1.0):
    return x + scale * jnp.tanh(x @ p["w"] + p["b"])


def _gate(p, x, scale=1.0):
    return x * jax.nn.sigmoid(scale * x @ p["w"])


@settings(max_examples=examples(12, 3), deadline=None)
@given(
    n=st.integers(1, 7),
    k=st.integers(1, 3),
    reverse=st.booleans(),
    has_aux=st.booleans(),
)
def test_stateless_patterns_aux_and_per_layer_inputs(n, k, reverse, has_aux):
    """A pattern of k layers (k=1: one layer, no tuple) with a per-layer input and the layer
    index, with and without aux: serving = loop (bitwise) = scan (within the bound)."""
    k = min(k, n)
    applies = [_mlp, _gate, _mlp][:k]

    def with_aux(f):
        def layer(p, x, s, i):
            y = f(p, x, scale=s)
            return (y, {"i": i, "m": y.mean()}) if has_aux else y

        return layer

    fns = [with_aux(f) for f in applies]
    pattern = k > 1
    layers = stackwise.stack(
        [_mlp_init] * k if pattern else _mlp_init,
        fns if pattern else fns[0],
        n,
        reverse=reverse,
        has_aux=has_aux,
    )
    params = layers.init(KEY)
    scales = jnp.linspace(0.5, 1.5, n)
    x = jnp.ones((3, D))
    args = (stackwise.per_layer(scales), stackwise.layer_index())
    served = stackwise.to_serving(params, pattern=k if pattern else None)
    out = jax.jit(layers.apply)(served, x, *args)
    scanned = jax.jit(layers.apply)(params, x, *args)

    def loop(per_layer, x):
        auxes = [None] * n
        for i in reversed(range(n)) if reverse else range(n):
            y = fns[i % k](per_layer[i], x, scales[i], jnp.int32(i))
            x, auxes[i] = y if has_aux else (y, None)
        if not has_aux:
            return x
        per_position = tuple(stackwise.stack_layers(auxes[p::k]) for p in range(k))
        return x, per_position if pattern else per_position[0]

    assert_trees_bitwise(out, jax.jit(loop)(served.layers, x))
    assert_trees_close(out, scanned)


def test_grads_through_the_serving_layout_equal_the_loops():
    """The loop is differentiable (remat per layer, as `unroll=True`), though meant for
    inference."""
    n = 3
    layers = stackwise.stack(_mlp_init, _mlp, n)
    served = stackwise.to_serving(layers.init(KEY))
    x = jnp.ones((2, D))

    def loss(params):
        return jnp.sum(layers.apply(params, x) ** 2)

    def loss_loop(per_layer):
        y = x
        for p in per_layer:
            y = _mlp(p, y)
        return jnp.sum(y**2)

    grads = jax.jit(jax.grad(loss))(served)
    assert isinstance(grads, stackwise.Serving)
    assert_trees_close(grads.layers, jax.grad(loss_loop)(served.layers))


def test_round_trip_is_exact_with_and_without_a_pattern():
    stacked = {"w": jnp.arange(12.0).reshape(3, 4), "i": jnp.arange(3, dtype=jnp.int8)}
    served = stackwise.to_serving(stacked)
    assert served.layers[1]["w"].tolist() == [4.0, 5.0, 6.0, 7.0]
    assert_trees_bitwise(stackwise.from_serving(served), stacked)
    a, b = {"w": jnp.arange(3.0)}, {"v": jnp.arange(2, dtype=jnp.bfloat16)}  # a b a b a
    served = stackwise.to_serving((a, b), pattern=2)
    assert [sorted(layer) for layer in served.layers] == [["w"], ["v"], ["w"], ["v"], ["w"]]
    assert repr(served) == "Serving(5 layers, pattern=2)"
    assert_trees_bitwise(stackwise.from_serving(served), (a, b))


class Model(NamedTuple):
    embed: jax.Array
    parts: tuple


def test_a_path_reaches_the_stacked_part_through_dicts_lists_and_named_tuples():
    """`to_serving(tree, path)` converts the part at `path` (with `pattern=k`, the k-tuple
    there) and copies only the containers on the way, keeping their types; `from_serving`
    at the same path gives the tree back bit for bit; the given tree is not changed."""
    a, b = {"w": jnp.arange(3.0)}, {"v": jnp.arange(4.0).reshape(2, 2)}  # a b a b a
    tree = {"model": Model(jnp.ones(2), ([{"blocks": (a, b)}], {"other": a}))}
    path = ("model", "parts", 0, 0, "blocks")
    for written in (path, "model/parts/0/0/blocks"):
        served = stackwise.to_serving(tree, written, pattern=2)
        inside = served["model"].parts[0][0]["blocks"]
        assert repr(inside) == "Serving(5 layers, pattern=2)"
        assert type(served["model"]) is Model and type(served["model"].parts[0]) is list
        assert served["model"].embed is tree["model"].embed  # the rest shared, not copied
        assert served["model"].parts[1] is tree["model"].parts[1]
        assert tree["model"].parts[0][0]["blocks"] == (a, b)  # the given tree: unchanged
        back = stackwise.from_serving(served, written)
        assert jax.tree.structure(back) == jax.tree.structure(tree)
        assert_trees_bitwise(back, tree)
    named = stackwise.to_serving(Model(jnp.ones(2), (a,)), ("parts", 0))  # a field's name
    assert isinstance(named.parts[0], stackwise.Serving)
    frozen = stackwise.to_serving(MappingProxy({"blocks": a}), "blocks")  # immutable
    assert type(frozen) is MappingProxy and isinstance(frozen["blocks"], stackwise.Serving)


class MappingProxy(Mapping):
    """An immutable mapping (as flax's FrozenDict), built from a dict."""

    def __init__(self, items):
        self._items = dict(items)

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)


def test_eager_under_disable_jit():
    layers = stackwise.stack(init, attend, 2, with_state=True)
    params, cache = layers.init(KEY)
    x = jnp.ones((B, 1, D))
    y, _ = layers.apply(params, cache, x, 0)
    with jax.disable_jit():
        y_eager, new = layers.apply(stackwise.to_serving(params), stackwise.to_serving(cache), x, 0)
    np.testing.assert_allclose(y_eager, y, rtol=1e-5, atol=1e-6)
    assert isinstance(new, stackwise.Serving)


def test_state_with_a_pattern_aux_and_the_layer_index():
    """A pattern of 2 layers with state (attention, then a counter), has_aux and the layer
    index: served = loop (bitwise), state back in the serving layout, = scan."""

    def count_init(key):
        del key
        return {"s": jnp.full((1, 1, D), 0.5)}, {"count": jnp.zeros((), jnp.int32)}

    def attend_aux(p, cache, x, pos, i):
        y, cache = attend(p, cache, x, pos)
        return (y, {"i": i}), cache

    def count(p, state, x, pos, i):
        del pos
        return (x * p["s"], {"i": i}), {"count": state["count"] + i}

    n = 5
    layers = stackwise.stack(
        [init, count_init], [attend_aux, count], n, with_state=True, has_aux=True
    )
    params, state = layers.init(KEY)
    x = jax.random.normal(jax.random.key(1), (B, 3, D))
    args = (jnp.int32(0), stackwise.layer_index())
    served = stackwise.to_serving(params, pattern=2)
    step = jax.jit(layers.apply)
    (y, aux), new = step(served, stackwise.to_serving(state, pattern=2), x, *args)
    assert isinstance(new, stackwise.Serving) and new.pattern == 2
    assert [int(a) for a in aux[0]["i"]] == [0, 2, 4] and [int(a) for a in aux[1]["i"]] == [1, 3]

    @jax.jit
    def loop(per_layer, states, x):
        new = list(states)
        for i, (p, s) in enumerate(zip(per_layer, states)):
            (x, _), new[i] = (attend_aux, count)[i % 2](p, s, x, jnp.int32(0), jnp.int32(i))
        return x, new

    y_loop, states = loop(served.layers, stackwise.unstack_layers(state, pattern=2), x)
    assert_trees_bitwise(y, y_loop)
    assert_trees_bitwise(new.layers, tuple(states))
    (y_scan, aux_scan), new_scan = step(params, state, x, *args)
    assert_trees_close(y, y_scan)
    assert_trees_bitwise(aux, aux_scan)
    assert_trees_close(stackwise.from_serving(new), new_scan)
