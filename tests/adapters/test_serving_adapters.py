"""The serving layout on the Equinox Stack (`stackwise.equinox.to_serving`): the per-layer blocks
run by the core's serving loop, against the loop of `Stack.to_layers()`' blocks (bitwise: the
same arithmetic, layer by layer) and the scanned Stack (within tests/_tolerance.py's bound),
for prefill and decode with a donated KV cache, with and without a pattern."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import pytest
from _attention import attention_layer, decode
from _programs import (
    aliased_inputs,
    assert_aliases_exactly,
    assert_no_copy_per_layer,
    nbytes,
    on_cpu,
)
from _trees import assert_trees_bitwise, assert_trees_close

import stackwise
from stackwise import _kit

eqx = pytest.importorskip("equinox")
import stackwise.equinox  # noqa: E402

B, T, D, HEADS = 2, 16, 8, 2
INIT, ATTEND = attention_layer(B, T, D, HEADS)


class Attend(eqx.Module):
    """One attention layer with a KV cache (the state tests' layer, as an eqx.Module)."""

    qkv: jax.Array
    out: jax.Array
    scale: float = eqx.field(static=True)

    def __init__(self, scale=1.0, *, key):
        params, _ = INIT(key)
        self.qkv, self.out, self.scale = params["qkv"] * scale, params["out"], scale

    def __call__(self, x, cache, pos):
        return ATTEND({"qkv": self.qkv, "out": self.out}, cache, x, pos)


def _cache(count):
    _, cache = INIT(jax.random.key(0))
    return jax.tree.map(lambda a: jnp.zeros((count, *a.shape), a.dtype), cache)


def _model(n, k, **options):
    """``(stack, stacked cache, per-layer caches)``; ``k`` blocks kinds (a pattern if > 1)."""
    kinds = [partial(Attend, 1.0 + p / 4) for p in range(k)]
    block = kinds if k > 1 else kinds[0]
    stack = stackwise.equinox.Stack(block, n, with_state=True, key=jax.random.key(1), **options)
    counts = [len(range(p, n, k)) for p in range(k)]
    cache = tuple(_cache(c) for c in counts) if k > 1 else _cache(n)
    return stack, cache, [jax.tree.map(lambda a: a[0], _cache(1)) for _ in range(n)]


def _step(model, cache, x, pos):
    return model(x, cache, pos)


def _loop(blocks, caches, x, pos):
    caches = list(caches)
    for i, block in enumerate(blocks):
        x, caches[i] = block(x, caches[i], pos)
    return x, caches


def _decode(step, params, cache, prompt):
    return decode(step, params, cache, prompt, steps=3)


def _assert_decoded(ys, ys_loop, ys_scan):
    """The served outputs: bitwise the loop's, within the shared bound of the scan's."""
    for y, y_loop, y_scan in zip(ys, ys_loop, ys_scan, strict=True):
        assert_trees_bitwise(y, y_loop)
        assert_trees_close(y, y_scan)


@pytest.mark.parametrize(
    "n, k, options",
    [(4, 1, {}), (3, 1, {"remat": False, "reverse": True}), (5, 2, {}), (6, 3, {"unroll": 2})],
    ids=["plain", "reverse", "pattern-2", "pattern-3"],
)
def test_served_stack_equals_the_loop_of_its_blocks_and_the_scan(n, k, options):
    stack, cache, caches = _model(n, k, **options)
    served = stackwise.equinox.to_serving(stack)
    assert isinstance(served.layers, stackwise.Serving) and len(served.layers) == n
    prompt = jax.random.normal(jax.random.key(2), (B, 5, D))
    step = jax.jit(_step, donate_argnums=1)
    pattern = k if k > 1 else None
    ys, served_cache = _decode(step, served, stackwise.to_serving(cache, pattern=pattern), prompt)
    assert isinstance(served_cache, stackwise.Serving)

    blocks = stack.to_layers()
    if options.get("reverse"):
        blocks, caches = blocks[::-1], caches[::-1]
    ys_loop, caches = _decode(jax.jit(_loop), blocks, caches, prompt)
    if options.get("reverse"):
        caches = caches[::-1]
    assert_trees_bitwise(served_cache.layers, tuple(caches))
    ys_scan, scan_cache = _decode(jax.jit(_step), stack, cache, prompt)
    _assert_decoded(ys, ys_loop, ys_scan)
    assert_trees_close(stackwise.from_serving(served_cache), scan_cache)


@pytest.mark.parametrize("k", [1, 2])
def test_round_trip_is_exact(k):
    stack, _, _ = _model(5, k)
    served = stackwise.equinox.to_serving(stack)
    for i, block in enumerate(stack.to_layers()):
        assert_trees_bitwise(served[i], block)
        assert_trees_bitwise(served.layers.layers[i], block)
    back = stackwise.equinox.from_serving(served)
    assert jax.tree.structure(back) == jax.tree.structure(stack)
    assert_trees_bitwise(back, stack)
    assert (back.remat, back.with_state, back.n) == (stack.remat, stack.with_state, stack.n)


@pytest.mark.parametrize("n", [4, 8])
def test_decode_writes_each_donated_cache_buffer_in_place(n):
    x = jax.ShapeDtypeStruct((B, 1, D), jnp.float32)

    def program(n, donate=True):
        stack, cache, _ = _model(n, 1)
        served, cache = stackwise.equinox.to_serving(stack), stackwise.to_serving(cache)
        step = jax.jit(_step, donate_argnums=1 if donate else ())
        return step.lower(served, cache, x, jnp.int32(3)).compile(), stack, cache

    compiled, stack, cache = program(n)
    leaves = jax.tree.leaves(cache)
    assert len(leaves) == 2 * n
    assert_aliases_exactly(compiled, leaves)
    undonated = program(n, donate=False)[0]
    assert aliased_inputs(undonated) == []
    assert undonated.memory_analysis().alias_size_in_bytes == 0
    shallow, _, shallow_cache = program(n // 2)
    assert_no_copy_per_layer(shallow, compiled, jax.tree.leaves(shallow_cache), leaves)
    if on_cpu():  # XLA:CPU's figures: unpadded bytes, the loop's schedule (tests/_programs.py)
        assert compiled.memory_analysis().alias_size_in_bytes == nbytes(leaves)
        # The temporaries are the loop of `to_layers()`' blocks', byte for byte; the scanned
        # Stack's are larger (a per-layer slice of each weight, the stacked cache written back).
        loop = jax.jit(_loop, donate_argnums=1).lower(stack.to_layers(), cache.layers, x, 3)
        temp = compiled.memory_analysis().temp_size_in_bytes
        assert temp == loop.compile().memory_analysis().temp_size_in_bytes
        stacked = stackwise.from_serving(cache)
        scan = jax.jit(_step, donate_argnums=1).lower(stack, stacked, x, jnp.int32(3)).compile()
        assert scan.memory_analysis().temp_size_in_bytes > temp


def test_stateless_stack_with_per_layer_inputs_and_keys():
    class Noisy(eqx.Module):
        w: jax.Array

        def __init__(self, *, key):
            self.w = jax.random.normal(key, (D, D)) / D**0.5

        def __call__(self, x, scale, *, key):
            return jnp.tanh(x @ self.w) * scale + jax.random.normal(key, x.shape) * 1e-2

    stack = stackwise.equinox.Stack(Noisy, 4, key=jax.random.key(3))
    scales = jnp.arange(1.0, 5.0)
    x, key = jnp.ones((B, D)), jax.random.key(4)
    served = stackwise.equinox.to_serving(stack)
    got = jax.jit(lambda m: m(x, stackwise.per_layer(scales), key=key))(served)

    def loop(blocks):
        y = x
        for i, (block, k) in enumerate(zip(blocks, jax.random.split(key, 4))):
            y = block(y, scales[i], key=k)
        return y

    assert_trees_bitwise(got, jax.jit(loop)(stack.to_layers()))
    assert_trees_close(got, stack(x, stackwise.per_layer(scales), key=key))


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_quantized_base_with_adapters_serves_one_layer_at_a_time(kind):
    """QLoRA weights on the served Stack: each layer's block holds its own codes (nf4 still
    packed) and adapters; the loop of `to_layers()`' blocks, each block's float weights
    built as the Stack builds them (`_kit.run_layer`), is the same arithmetic."""
    stack, cache, caches = _model(4, 1)
    base = stackwise.quant.quantize(stack, kind)
    adapters = stackwise.lora.init(jax.random.key(5), base, rank=2)
    adapters = jax.tree.map(lambda v: v + 0.05, adapters)
    model = stackwise.lora.attach(base, adapters, per_leaf=True)
    served = stackwise.equinox.to_serving(model)
    prompt = jax.random.normal(jax.random.key(6), (B, 5, D))
    ys, served_cache = _decode(jax.jit(_step), served, stackwise.to_serving(cache), prompt)
    if kind == "nf4":  # one layer's codes, still packed in the served block
        assert served[0].qkv.base.codes.shape == (D // 2, 3 * D)

    def loop(blocks, caches, x, pos):
        def floats(block):  # the block as run_layer hands it to the layer
            return _kit.run_layer(lambda b, x: (b, ()), block, None, who="loop")[0]

        return _loop([floats(block) for block in blocks], caches, x, pos)

    ys_loop, caches = _decode(jax.jit(loop), model.to_layers(), caches, prompt)
    assert_trees_bitwise(served_cache.layers, tuple(caches))
    ys_scan, _ = _decode(jax.jit(_step), model, cache, prompt)
    _assert_decoded(ys, ys_loop, ys_scan)
    assert_trees_bitwise(stackwise.equinox.from_serving(served), model)


class Indexed(eqx.Module):
    """The attention layer with its cache behind an eqx.nn.StateIndex (Equinox's own way)."""

    attend: Attend
    cache: eqx.nn.StateIndex

    def __init__(self, *, key):
        self.attend = Attend(key=key)
        self.cache = eqx.nn.StateIndex(jax.tree.map(lambda a: a[0], _cache(1)))

    def __call__(self, x, state, pos):
        x, cache = self.attend(x, state.get(self.cache), pos)
        return x, state.set(self.cache, cache)


class Mix(eqx.Module):
    """A stateless position of a pattern."""

    w: jax.Array

    def __init__(self, *, key):
        self.w = jax.random.normal(key, (D, D)) / D**0.5

    def __call__(self, x, pos):
        return x + jnp.tanh(x @ self.w)


@pytest.mark.parametrize("k", [1, 2], ids=["plain", "pattern-with-a-stateless-position"])
def test_eqx_state_cache_serves_as_the_loop_of_its_blocks(k):
    n = 5
    make = eqx.nn.make_with_state(stackwise.equinox.Stack)
    stack, state = make([Indexed, Mix] if k > 1 else Indexed, n, key=jax.random.key(7))
    blocks, states = stack.to_layers(state)
    _, fresh = make([Indexed, Mix] if k > 1 else Indexed, n, key=jax.random.key(7))
    served, served_state = stackwise.equinox.to_serving(stack, state=fresh)
    assert isinstance(served.layers, stackwise.Serving)
    prompt = jax.random.normal(jax.random.key(8), (B, 5, D))

    def loop(blocks, states, x, pos):
        states = list(states)
        for i, block in enumerate(blocks):
            if i % k == 0:
                x, states[i] = block(x, states[i], pos)
            else:
                x = block(x, pos)
        return x, states

    ys, served_state = _decode(jax.jit(_step, donate_argnums=1), served, served_state, prompt)
    ys_loop, states = _decode(jax.jit(loop), blocks, states, prompt)
    back, stacked_state = stackwise.equinox.from_serving(served, state=served_state)
    assert_trees_bitwise(back, stack)
    _, per_layer = back.to_layers(stacked_state)
    for i in range(0, n, k):
        assert_trees_bitwise(per_layer[i], states[i])

    ys_scan, scan_state = _decode(jax.jit(_step), stack, state, prompt)
    _assert_decoded(ys, ys_loop, ys_scan)
    assert_trees_close(jax.tree.leaves(stacked_state), jax.tree.leaves(scan_state))


def test_a_donated_eqx_state_cache_is_written_in_place():
    make = eqx.nn.make_with_state(stackwise.equinox.Stack)
    stack, state = make(Indexed, 6, key=jax.random.key(7))
    served, state = stackwise.equinox.to_serving(stack, state=state)
    leaves = jax.tree.leaves(state)
    assert len(leaves) == 2 * 6  # each layer's keys and values, buffers of their own
    x = jax.ShapeDtypeStruct((B, 1, D), jnp.float32)
    compiled = jax.jit(_step, donate_argnums=1).lower(served, state, x, jnp.int32(3)).compile()
    assert_aliases_exactly(compiled, leaves)
    if on_cpu():  # XLA:CPU's bytes are the arrays' own (tests/_programs.py)
        assert compiled.memory_analysis().alias_size_in_bytes == nbytes(leaves)
