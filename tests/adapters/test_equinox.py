"""What is Equinox's own in `stackwise.equinox.Stack`, against a Python loop of the same
blocks: construction from keys, per-layer keys, eqx.nn.State (BatchNorm, patterns,
eqx.nn.Sequential), filter_jit/optax, an explicit cache, conversions and errors.

The properties every adapter holds (outputs and gradients over the option matrix, traces,
remat barriers, the program of the hand-written `eqx.filter_vmap` + `lax.scan`, fsdp,
decoding with an eqx.nn.State cache) are tests/adapters/test_contract.py's."""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _trees import assert_trees_close, assert_trees_equal
from hypothesis import given, settings
from hypothesis import strategies as st

import stackwise
import stackwise.equinox as swe

D, B = 8, 3  # features and batch: distinct, so params and activations differ in type
KEY = jax.random.key(0)
XS = jax.random.normal(jax.random.key(1), (B, D))


class Block(eqx.Module):
    """A pre-norm residual MLP with dropout when given a key; `scale` reaches every layer."""

    norm: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    drop: eqx.nn.Dropout

    def __init__(self, d: int = D, *, key):
        k_up, k_down = jax.random.split(key)
        self.norm = eqx.nn.LayerNorm(d)
        self.up = eqx.nn.Linear(d, 2 * d, key=k_up)
        self.down = eqx.nn.Linear(2 * d, d, key=k_down)
        self.drop = eqx.nn.Dropout(0.3)

    def __call__(self, x, scale=1.0, *, key=None):
        h = jax.nn.gelu(self.up(self.norm(x)))
        h = self.drop(h, key=key, inference=key is None)
        return x + scale * self.down(h)


class Loop(eqx.Module):
    """The reference: a Python loop over separately held blocks (keys split as
    `eqx.nn.Sequential` splits them)."""

    blocks: list
    reverse: bool = eqx.field(static=True, default=False)

    def __call__(self, x, *args, key=None, **kwargs):
        n = len(self.blocks)
        keys = [None] * n if key is None else list(jax.random.split(key, n))
        for i in reversed(range(n)) if self.reverse else range(n):
            x = self.blocks[i](x, *args, key=keys[i], **kwargs)
        return x


def identical(a, b):
    """Same structure, statics and array values, shapes and dtypes."""
    return bool(eqx.tree_equal(a, b, typematch=True))


def values(tree):
    """The array leaves, in order (blocks whose StateIndex markers differ compare equal)."""
    return [a for a in jax.tree.leaves(tree) if eqx.is_array(a)]


def arrays(tree):
    return eqx.filter(tree, eqx.is_array)


def stacked(trees):
    """Per-layer trees stacked leaf by leaf (arrays only; the rest from the first)."""
    return jax.tree.map(lambda *a: jnp.stack(a), *[arrays(t) for t in trees])


def loss_fn(model, xs, key=None):
    ys = jax.vmap(lambda x: model(x, 0.5, key=key))(xs)
    return jnp.sum(jnp.sin(ys) ** 2)


value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))


# --------------------------------------------------------------------------
# Creation.


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 3, 5])
def test_init_is_bitwise_a_loop_of_blocks_and_filter_vmap(n):
    s = swe.Stack(Block, n, key=KEY)
    keys = jax.random.split(KEY, n)
    assert s.layers.up.weight.shape == (n, 2 * D, D)
    assert_trees_equal(arrays(s.layers), stacked([Block(key=k) for k in keys]))
    # ... and what the hand-written pattern builds, statics included.
    assert identical(s.layers, eqx.filter_vmap(lambda k: Block(key=k))(keys))
    # Factories of any Equinox form: a partial, a lambda, a class taking `key` by name.
    assert identical(swe.Stack(lambda k: Block(D, key=k), n, key=KEY), s)
    linear = swe.Stack(functools.partial(eqx.nn.Linear, D, 2), n, key=KEY)
    assert_trees_equal(arrays(linear.layers), stacked([eqx.nn.Linear(D, 2, key=k) for k in keys]))


@pytest.mark.slow
def test_a_stack_is_an_equinox_module():
    s = swe.Stack(Block, 3, key=KEY, remat=True)
    assert isinstance(s, eqx.Module)
    leaves = jax.tree.leaves(s)
    assert len(leaves) == len(jax.tree.leaves(s.layers))  # the options are static fields
    assert identical(jax.tree.unflatten(jax.tree.structure(s), leaves), s)
    assert "Stack(" in eqx.tree_pformat(s)


# --------------------------------------------------------------------------
# Per-layer keys: split as eqx.nn.Sequential splits them (the option matrix without keys
# is the contract's, tests/adapters/test_contract.py).

CASES = {
    "n1": dict(n=1),
    "default-remat": dict(n=4),
    "python-loop-remat-reverse": dict(n=3, unroll=True, remat=True, reverse=True),
    "nested-reverse-policy": dict(
        n=5, nested=2, reverse=True, remat=jax.checkpoint_policies.dots_saveable
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_dropout_keys_forward_and_grad_match_a_python_loop(case):
    s = swe.Stack(Block, key=KEY, **case)
    loop = Loop(s.to_layers(), reverse=case.get("reverse", False))
    key = jax.random.key(7)
    value, grads = value_and_grad(s, XS, key)
    value_loop, grads_loop = value_and_grad(loop, XS, key)
    assert_trees_close(value, value_loop)
    assert_trees_close(arrays(grads.layers), stacked(grads_loop.blocks))


@pytest.mark.slow
def test_per_layer_keys_marker_equals_a_key():
    s = swe.Stack(Block, 4, key=KEY)
    key = jax.random.key(3)
    y = s(XS[0], key=key)
    assert_trees_equal(y, s(XS[0], key=stackwise.per_layer_keys(key)))
    assert not jnp.allclose(y, s(XS[0], key=jax.random.key(4)))
    assert not jnp.allclose(y, s(XS[0]))  # no key: dropout off


class Indexed(eqx.Module):
    w: jax.Array

    def __init__(self, key):
        self.w = jax.random.normal(key, (2,))

    def __call__(self, x, scale, offset=0.0):
        i = swe.layer_index()
        return x * scale + self.w.sum() + offset + i, i


@pytest.mark.parametrize("reverse", [False, True])
def test_per_layer_inputs_aux_and_layer_index(reverse):
    n = 4
    s = swe.Stack(Indexed, n, key=KEY, has_aux=True, reverse=reverse)
    scales = jnp.arange(1.0, n + 1)
    y, idx = s(jnp.float32(1.0), stackwise.per_layer(scales), offset=0.5)
    assert idx.tolist() == list(range(n))
    want = 1.0
    for i in reversed(range(n)) if reverse else range(n):
        want = want * scales[i] + s[i].w.sum() + 0.5 + i
    assert_trees_close(y, want)


class Outer(eqx.Module):
    inner: swe.Stack

    def __init__(self, key):
        self.inner = swe.Stack(Indexed, 2, key=key, has_aux=True)

    def __call__(self, x, outer_index=None):
        x, inner_index = self.inner(x, 1.0)
        if outer_index is None:  # the index is read after the inner stack ran
            outer_index = swe.layer_index()
        return x + 100 * outer_index + 10 * inner_index.sum()


def test_nested_stacks():
    s = swe.Stack(Outer, 3, key=KEY)
    assert s.layers.inner.layers.w.shape == (3, 2, 2)
    blocks = s.to_layers()
    assert blocks[1].inner.layers.w.shape == (2, 2)
    y_loop = jnp.float32(0.0)
    for i, block in enumerate(blocks):
        y_loop = block(y_loop, outer_index=i)
    assert_trees_close(s(jnp.float32(0.0)), y_loop)


# --------------------------------------------------------------------------
# Training with eqx.filter_jit, eqx.filter_grad and optax.


class Model(eqx.Module):
    embed: eqx.nn.Linear
    blocks: eqx.Module
    head: eqx.nn.Linear

    def __init__(self, blocks, key):
        k_embed, k_head = jax.random.split(key)
        self.embed = eqx.nn.Linear(D, D, key=k_embed)
        self.blocks = blocks
        self.head = eqx.nn.Linear(D, 1, key=k_head)

    def __call__(self, x, scale=1.0, *, key=None):
        return self.head(self.blocks(self.embed(x), scale, key=key))


@pytest.mark.slow
def test_optax_steps_match_the_loop_and_the_loss_falls():
    s = swe.Stack(Block, 3, key=KEY, remat=True)
    model, loop = Model(s, KEY), Model(Loop(s.to_layers()), KEY)
    target = jnp.cos(XS.sum(-1, keepdims=True))
    opt = optax.adam(1e-2)

    def loss(model, key):
        return jnp.mean((jax.vmap(lambda x: model(x, key=key))(XS) - target) ** 2)

    @eqx.filter_jit
    def step(model, opt_state, key):
        value, grads = eqx.filter_value_and_grad(loss)(model, key)
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, value

    state, state_loop = opt.init(arrays(model)), opt.init(arrays(loop))
    key = jax.random.key(5)
    model, state, value = step(model, state, key)
    loop, state_loop, value_loop = step(loop, state_loop, key)
    assert_trees_close(value, value_loop)
    assert_trees_close(arrays(model.blocks.layers), stacked(loop.blocks.blocks))
    losses = [step(model, state, None)[2]]
    for _ in range(10):
        model, state, value = step(model, state, None)
        losses.append(value)
    assert losses[-1] < 0.5 * losses[0]


def test_serialisation_round_trip(tmp_path):
    s = swe.Stack(Block, 3, key=KEY)
    eqx.tree_serialise_leaves(tmp_path / "stack.eqx", s)
    like = swe.Stack(Block, 3, key=jax.random.key(9))
    assert identical(eqx.tree_deserialise_leaves(tmp_path / "stack.eqx", like), s)


# --------------------------------------------------------------------------
# State: eqx.nn.BatchNorm (eqx.nn.State) per layer, stacked.


class Normed(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm

    def __init__(self, key):
        self.linear = eqx.nn.Linear(D, D, key=key)
        self.norm = eqx.nn.BatchNorm(D, axis_name="batch", mode="ema", momentum=0.5)

    def __call__(self, x, state):
        h, state = self.norm(self.linear(x), state)
        return x + jnp.tanh(h), state


def batched(f):
    return jax.vmap(f, axis_name="batch", in_axes=(0, None), out_axes=(0, None))


def loop_with_state(blocks, states, x):
    new = []
    for block, state in zip(blocks, states):
        x, state = block(x, state)
        new.append(state)
    return x, new


def state_values(states):
    return [s.tree_flatten()[0] for s in states]


@pytest.mark.parametrize(
    "case",
    [dict(), dict(remat=True, reverse=True), dict(unroll=True)],
    ids=["default", "remat-reverse", "python-loop"],
)
def test_batch_norm_state_matches_a_loop(case):
    n = 3
    s, state = eqx.nn.make_with_state(swe.Stack)(Normed, n, key=KEY, **case)
    assert s.is_stateful()
    blocks, states = s.to_layers(state)
    # The layers and their state are those of n separately built blocks.
    for i, k in enumerate(jax.random.split(KEY, n)):
        block, block_state = eqx.nn.make_with_state(Normed)(k)
        assert_trees_equal(values(blocks[i]), values(block))
        assert_trees_equal(state_values([states[i]]), state_values([block_state]))
    if case.get("reverse"):
        blocks, states = blocks[::-1], states[::-1]

    step = eqx.filter_jit(lambda s, state, xs: batched(s)(xs, state))
    loop_step = eqx.filter_jit(
        lambda b, states, xs: batched(lambda x, states: loop_with_state(b, states, x))(xs, states)
    )
    for t in range(2):  # the first step sets the running averages, the second updates them
        xs = XS + t
        y, state = step(s, state, xs)
        y_loop, states = loop_step(blocks, states, xs)
        assert_trees_close(y, y_loop)
        per_layer = s.to_layers(state)[1]
        if case.get("reverse"):
            per_layer = per_layer[::-1]
        assert_trees_close(state_values(per_layer), state_values(states))
    mean = state.get(s.layers.norm.ema_state_index)[0]
    assert mean.shape == (n, D) and not jnp.allclose(mean, 0.0)

    # Gradients, with the state as the loss's aux.
    def loss(model, state, xs):
        y, state = batched(model)(xs, state)
        return jnp.sum(y**2), state

    def loop_loss(blocks, states, xs):
        y, states = batched(lambda x, states: loop_with_state(blocks, states, x))(xs, states)
        return jnp.sum(y**2), states

    # (Jitted: one program each, not one per op and shape of the loop's batch norms.)
    (_, _), grads = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))(s, state, XS)
    (_, _), grads_loop = eqx.filter_jit(eqx.filter_value_and_grad(loop_loss, has_aux=True))(
        blocks, states, XS)
    if case.get("reverse"):
        grads_loop = grads_loop[::-1]
    assert_trees_close(arrays(grads.layers), stacked(grads_loop))

    # Inference mode: running statistics are used and left alone.
    s_eval, blocks_eval = eqx.nn.inference_mode(s), eqx.nn.inference_mode(blocks)
    y, new_state = step(s_eval, state, XS)
    y_loop, _ = loop_step(blocks_eval, states, XS)
    assert_trees_close(y, y_loop)
    assert_trees_equal(new_state.tree_flatten()[0], state.tree_flatten()[0])


def test_stateful_stack_in_sequential_and_in_a_model():
    # eqx.nn.Sequential passes `state=` (and `key=`) by keyword to stateful layers.
    def make(key):
        k1, k2 = jax.random.split(key)
        return eqx.nn.Sequential([eqx.nn.Linear(D, D, key=k1), swe.Stack(Normed, 2, key=k2)])

    seq, state = eqx.nn.make_with_state(make)(KEY)
    y, state2 = batched(seq)(XS, state)
    lin, stack = seq.layers
    y_ref, _ = batched(lambda x, st: stack(lin(x), st))(XS, state)
    assert_trees_close(y, y_ref)
    assert y.shape == (B, D)


# --------------------------------------------------------------------------
# Patterns: layer i built by and run as block[i % k].


class Plain(eqx.Module):
    linear: eqx.nn.Linear

    def __init__(self, key):
        self.linear = eqx.nn.Linear(D, D, key=key)

    def __call__(self, x, scale):
        return x + scale * jnp.tanh(self.linear(x)), jnp.sum(x)


class Summing(eqx.Module):
    """Stateful: keeps the running sum of its inputs."""

    w: jax.Array
    total: eqx.nn.StateIndex

    def __init__(self, key):
        self.w = jax.random.normal(key, (D,))
        self.total = eqx.nn.StateIndex(jnp.zeros(D))

    def __call__(self, x, state, scale):
        total = state.get(self.total) + x
        return (x * jnp.cos(self.w) * scale, jnp.sum(total)), state.set(self.total, total)


class Parts(eqx.Module):
    b: jax.Array
    parts: object  # (a dict, tuple or other pytree, for the messages of blocks that differ)


class Shift(eqx.Module):
    b: jax.Array

    def __init__(self, key):
        self.b = jax.random.uniform(key, (D,))

    def __call__(self, x, scale):
        return jnp.sin(x + self.b * scale), jnp.max(x)


PATTERNS = {1: [Summing], 2: [Plain, Summing], 3: [Plain, Summing, Shift]}


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize(
    "case",
    [dict(n=5), dict(n=7, reverse=True, remat=True), dict(n=7, unroll=True, nested=1)],
    ids=["n5", "n7-reverse-remat", "n7-python-loop-nested"],
)
def test_patterns_match_a_loop(k, case):
    factories, n = PATTERNS[k], case["n"]
    s, state = eqx.nn.make_with_state(swe.Stack)(factories, key=KEY, has_aux=True, **case)
    assert isinstance(s.layers, tuple) and len(s.layers) == k
    blocks, states = s.to_layers(state)
    for i, key in enumerate(jax.random.split(KEY, n)):
        block, block_state = eqx.nn.make_with_state(factories[i % k])(key)
        assert type(blocks[i]) is factories[i % k]
        assert_trees_equal(values(blocks[i]), values(block))
        assert_trees_equal(state_values([states[i]]), state_values([block_state]))
    scales = jnp.linspace(0.5, 1.5, n)

    def run(s, state, x):
        return s(x, state, stackwise.per_layer(scales))

    def run_loop(blocks, states, x):
        aux, states = [None] * n, list(states)
        for i in reversed(range(n)) if case.get("reverse") else range(n):
            if isinstance(blocks[i], Summing):
                (x, aux[i]), states[i] = blocks[i](x, states[i], scales[i])
            else:
                x, aux[i] = blocks[i](x, scales[i])
        return (x, tuple(jnp.stack(aux[p::k]) for p in range(k))), states

    x = XS[0]
    for _ in range(2):
        (y, aux), state = eqx.filter_jit(run)(s, state, x)
        (y_loop, aux_loop), states = eqx.filter_jit(run_loop)(blocks, states, x)
        assert_trees_close(y, y_loop)
        assert_trees_close(aux, aux_loop)
        assert_trees_close(state_values(s.to_layers(state)[1]), state_values(states))

    def loss(s, state):
        (y, aux), _ = run(s, state, x)
        return jnp.sum(y**2) + sum(jnp.sum(a) for a in aux)

    def loop_loss(blocks, states):
        (y, aux), _ = run_loop(blocks, states, x)
        return jnp.sum(y**2) + sum(jnp.sum(a) for a in aux)

    grads = eqx.filter_grad(loss)(s, state)
    grads_loop = eqx.filter_grad(loop_loss)(blocks, states)
    for p in range(k):
        assert_trees_close(arrays(grads.layers[p]), stacked(grads_loop[p::k]))


def test_pattern_without_state_and_from_layers_with_a_pattern():
    s = swe.Stack([Plain, Shift], 5, key=KEY, has_aux=True)
    assert not s.is_stateful()
    blocks = s.to_layers()
    assert [type(b) for b in blocks] == [Plain, Shift, Plain, Shift, Plain]
    again = swe.Stack.from_layers(blocks, pattern=2, has_aux=True)
    assert identical(again, s)
    y, aux = s(XS[0], 0.5)
    x = XS[0]
    for b in blocks:
        x, _ = b(x, 0.5)
    assert_trees_close(y, x)
    assert [a.shape for a in aux] == [(3,), (2,)]


# --------------------------------------------------------------------------
# Decoding with a stacked KV cache as an explicit argument (`with_state=True`).

T = 6  # cache slots


def attend(w, cache, x, pos):
    """Writes this token's key into the cache and attends to the cached keys."""
    cache = jax.lax.dynamic_update_slice(cache, (x @ w)[None], (pos, 0))
    scores = jnp.where(jnp.arange(T) <= pos, cache @ x, -1e30)
    return x + jnp.tanh(jax.nn.softmax(scores) @ cache), cache


class ExplicitAttention(eqx.Module):
    """The cache as an explicit argument: `x, cache = block(x, cache, pos)`."""

    w: jax.Array

    def __init__(self, key):
        self.w = jax.random.normal(key, (D, D)) / D**0.5

    def __call__(self, x, cache, pos):
        x, k = attend(self.w, cache["k"], x, pos)
        return x, {"k": k}


def scans_in(f, *args):
    """The shapes of the per-layer outputs (`ys`) of every scan in ``f`` 's jaxpr."""
    eqns = jax.make_jaxpr(f)(*args).eqns
    return [
        [v.aval.shape for v in e.outvars[e.params["num_carry"] :]]
        for e in eqns
        if e.primitive.name == "scan"
    ]


def test_decoding_with_an_explicit_stacked_cache_matches_a_loop():
    # (An eqx.nn.State cache is the contract's, tests/adapters/test_contract.py.)
    n = 3
    s = swe.Stack(ExplicitAttention, n, key=KEY, with_state=True)
    cache = {"k": jnp.zeros((n, T, D))}
    blocks, caches = s.to_layers(), [{"k": jnp.zeros((T, D))} for _ in range(n)]
    step = eqx.filter_jit(lambda s, cache, x, pos: s(x, cache, pos), donate="all-except-first")

    @eqx.filter_jit
    def loop_step(blocks, caches, x, pos):
        new = []
        for block, c in zip(blocks, caches):
            x, c = block(x, c, pos)
            new.append(c)
        return x, new

    x, x_loop = XS[0] + 0, XS[0] + 0  # separate buffers: `step` donates its arguments
    for pos in range(4):
        x, cache = step(s, cache, x, jnp.int32(pos))
        x_loop, caches = loop_step(blocks, caches, x_loop, jnp.int32(pos))
        assert_trees_close(x, x_loop)
    assert_trees_close(cache, stacked(caches))
    # The stacked cache is written in place: the layers' scan returns the written rows
    # and their positions, never a whole per-layer cache.
    ys = scans_in(lambda c, x: s(x, c, jnp.int32(0)), cache, XS[0])
    assert ys and all((n, T, D) not in shapes for shapes in ys), ys


# --------------------------------------------------------------------------
# Conversion: to_layers / from_layers / stack[i], exact, and clear errors.


@pytest.mark.slow
def test_conversion_round_trips_are_exact():
    keys = jax.random.split(KEY, 4)
    blocks = [Block(key=k) for k in keys]
    s = swe.Stack.from_layers(blocks, remat=True)
    assert s.n == 4 and s.remat is True
    assert identical(s, swe.Stack(Block, 4, key=KEY, remat=True))
    back = s.to_layers()
    for a, b in zip(back, blocks):
        assert type(a) is Block and identical(a, b)
    assert identical(swe.Stack.from_layers(back, remat=True), s)
    assert identical(s[2], blocks[2]) and identical(s[-1], blocks[3])
    # dtypes are kept, bit for bit.
    half = [eqx.nn.Linear(D, D, dtype=jnp.bfloat16, key=k) for k in keys]
    s16 = swe.Stack.from_layers(half)
    assert s16.layers.weight.dtype == jnp.bfloat16
    assert all(identical(a, b) for a, b in zip(s16.to_layers(), half))


def test_state_round_trips_are_exact():
    made = [eqx.nn.make_with_state(Normed)(k) for k in jax.random.split(KEY, 3)]
    blocks, states = [m for m, _ in made], [st for _, st in made]
    s, state = swe.Stack.from_layers(blocks, states)
    ref, ref_state = eqx.nn.make_with_state(swe.Stack)(Normed, 3, key=KEY)
    assert_trees_equal(values(s), values(ref))
    assert_trees_equal(state.tree_flatten()[0], ref_state.tree_flatten()[0])
    back, back_states = s.to_layers(state)
    for a, b in zip(back, blocks):
        assert_trees_equal(values(a), values(b))
    assert_trees_equal(state_values(back_states), state_values(states))
    again, again_state = swe.Stack.from_layers(back, back_states)
    assert identical(again, s)
    assert_trees_equal(again_state.tree_flatten()[0], state.tree_flatten()[0])
    # A pattern whose positions share markers (every block made by make_with_state(Summing)).
    made = [eqx.nn.make_with_state(Summing)(k) for k in jax.random.split(KEY, 4)]
    blocks, states = [m for m, _ in made], [st for _, st in made]
    s, state = swe.Stack.from_layers(blocks, states, pattern=2, has_aux=True)
    assert len(state.tree_flatten()[0]) == 2  # one entry per position
    (y, _), state = s(XS[0], state, 1.0)
    x = XS[0]
    for block, block_state in zip(blocks, states):
        (x, _), _ = block(x, block_state, 1.0)
    assert_trees_close(y, x)


@pytest.mark.slow
def test_conversion_errors_name_the_block_and_leaf():
    keys = jax.random.split(KEY, 3)
    with pytest.raises(ValueError, match="needs at least one block, got none"):
        swe.Stack.from_layers([])
    with pytest.raises(TypeError, match="block 1 must be an eqx.Module, got dict"):
        swe.Stack.from_layers([Block(key=keys[0]), {"w": 1}])
    with pytest.raises(
        TypeError,
        match=r"block 1 \(Linear\) differs from block 0 at "
        r"`.out_features`: 3 vs 4 \(a static field\)",
    ):
        swe.Stack.from_layers([eqx.nn.Linear(D, 3, key=keys[0]), eqx.nn.Linear(D, 4, key=keys[1])])
    with pytest.raises(
        TypeError,
        match=r"block 2 \(Linear\) differs from block 0 at "
        r"`.weight`: float32\[3, 8\] vs bfloat16\[3, 8\]",
    ):
        swe.Stack.from_layers(
            [
                eqx.nn.Linear(D, 3, key=keys[0]),
                eqx.nn.Linear(D, 3, key=keys[1]),
                eqx.nn.Linear(D, 3, dtype=jnp.bfloat16, key=keys[2]),
            ]
        )
    other = eqx.tree_at(lambda b: b.up.weight, Block(key=keys[1]), jnp.zeros((2 * D, D + 1)))
    with pytest.raises(
        TypeError,
        match=r"block 1 \(Block\) differs from block 0 at "
        r"`.up.weight`: float32\[16, 8\] vs float32\[16, 9\]",
    ):
        swe.Stack.from_layers([Block(key=keys[0]), other])
    with pytest.raises(
        TypeError,
        match=r"block 1 \(MLP\) differs from block 0 at "
        r"`.final_activation`.*fresh lambda",
    ):
        swe.Stack.from_layers(
            [eqx.nn.MLP(2, 2, 4, 1, final_activation=lambda x: x, key=k) for k in keys[:2]]
        )
    with pytest.raises(
        TypeError,
        match=r"block 1 \(Shift\) differs from block 0 at `<root>`: "
        "Plain vs Shift",
    ):
        swe.Stack.from_layers([Plain(keys[0]), Shift(keys[1])])
    # Containers that differ: a dict's keys, a tuple's length, another pytree's structure.
    for parts, other, how in (
        ({"a": 1.0}, {"b": 1.0}, r"`.parts`: keys \['a'\] vs \['b'\]"),
        ((1.0,), (1.0, 2.0), r"`.parts`: 1 vs 2 entries"),
        (jax.tree_util.Partial(jnp.add, 1.0), jax.tree_util.Partial(jnp.add, 1.0, 2.0),
         r"`.parts`: PyTreeDef\(.*\) vs PyTreeDef"),
    ):
        blocks = [Parts(jnp.ones(D), parts), Parts(jnp.ones(D), other)]
        with pytest.raises(TypeError, match=r"block 1 \(Parts\) differs from block 0 at " + how):
            swe.Stack.from_layers(blocks)
    bn = [eqx.nn.make_with_state(Normed)(k)[0] for k in keys]
    with pytest.raises(
        ValueError,
        match=r"block 0 holds eqx.nn.StateIndex es.*"
        r"Stack.from_layers\(blocks, states\)",
    ):
        swe.Stack.from_layers(bn)
    with pytest.raises(IndexError, match="layer 3 is out of range for n=3"):
        swe.Stack(Block, 3, key=KEY)[3]
    with pytest.raises(TypeError, match="`pattern` must be a positive int, got 0"):
        swe.Stack.from_layers([Block(key=keys[0])], pattern=0)
    with pytest.raises(ValueError, match="a pattern of 2 kinds needs at least 2 blocks, got 1"):
        swe.Stack.from_layers([Block(key=keys[0])], pattern=2)


# --------------------------------------------------------------------------
# Errors when building and calling.


def test_errors_name_the_block_and_argument():
    with pytest.raises(
        TypeError,
        match=r"Stack\(.*<lambda>, n=2\): `block` \(.*<lambda>\) "
        r"must return an eqx.Module, but it returned an array float32\[3\]",
    ):
        swe.Stack(lambda key: jnp.zeros(3), 2, key=KEY)
    with pytest.raises(TypeError, match=r"got a built Linear module.*lambda key: Linear"):
        swe.Stack(eqx.nn.Linear(D, D, key=KEY), 2, key=KEY)
    with pytest.raises(TypeError, match=r"returned `\(module, state\)`.*make_with_state"):
        swe.Stack(eqx.nn.make_with_state(Normed), 2, key=KEY)
    with pytest.raises(TypeError, match=r"`key` must be one PRNG key.*got int 0.*jax\.random\.key"):
        swe.Stack(Block, 2, key=0)
    with pytest.raises(ValueError, match=r"Stack\(Block, n=0\): `n` must be at least 1"):
        swe.Stack(Block, 0, key=KEY)
    with pytest.raises(TypeError, match="`n` must be a Python int"):
        swe.Stack(Block, 2.0, key=KEY)
    with pytest.raises(TypeError, match="`remat` must be"):
        swe.Stack(Block, 2, key=KEY, remat="yes")
    with pytest.raises(TypeError, match="`with_state` must be True or False"):
        swe.Stack(Block, 2, key=KEY, with_state=1)
    with pytest.raises(TypeError, match="`fsdp` must be a mesh axis name"):
        swe.Stack(Block, 2, key=KEY, fsdp=3)
    with pytest.raises(ValueError, match="a pattern of 3 layers needs n >= 3"):
        swe.Stack([Plain, Plain, Shift], 2, key=KEY)

    s = swe.Stack(functools.partial(eqx.nn.Linear, D, 2 * D), 2, key=KEY)
    with pytest.raises(
        TypeError,
        match=r"Stack\(Linear, n=2\): a layer changed carry leaf `x` "
        r"from float32\[8\] to float32\[16\].*project it back",
    ):
        s(XS[0])
    s = swe.Stack(Block, 3, key=KEY)
    cut = eqx.tree_at(lambda s: s.layers.up.weight, s, s.layers.up.weight[:2])
    with pytest.raises(
        ValueError,
        match=r"(?s)Stack\(Block, n=3\): every leaf of the stacked "
        r"block's arrays needs a leading layer axis of length n=3.*"
        r"layers\.up\.weight: shape \(2, 16, 8\)",
    ):
        cut(XS[0])
    with pytest.raises(TypeError, match="`key` must be one PRNG key"):
        s(XS[0], key=3)
    # A per-layer marker of the user's own is named as the user wrote it.
    two_keys = stackwise.per_layer(jax.random.split(KEY, 2))
    with pytest.raises(
        ValueError, match=r"(?s)Stack\(Block, n=3\).*argument \*\*kwargs\['key'\].*length n=3"
    ):
        s(XS[0], key=two_keys)

    s, state = eqx.nn.make_with_state(swe.Stack)(Summing, 2, key=KEY)
    with pytest.raises(
        TypeError,
        match=r"called with the model's eqx.nn.State.*"
        r"x, state = stack\(x, state, \.\.\.\)",
    ):
        s(XS[0])
    with pytest.raises(TypeError, match="`state` must be the model's eqx.nn.State"):
        s(XS[0], {"total": jnp.zeros((2, D))}, 1.0)
    with pytest.raises(ValueError, match="holds no values for the stack's eqx.nn.StateIndex"):
        s(XS[0], eqx.nn.make_with_state(Normed)(KEY)[1], 1.0)

    class Forgets(Summing):
        def __call__(self, x, state, scale):
            return x, None

    explicit = swe.Stack(ExplicitAttention, 2, key=KEY, with_state=True)
    with pytest.raises(
        TypeError,
        match="got an eqx.nn.State, but no block holds an "
        "eqx.nn.StateIndex: with `with_state=True`",
    ):
        explicit(XS[0], state, jnp.int32(0))
    with pytest.raises(TypeError, match=r"the stacked per-layer state \(`with_state=True`\)"):
        explicit(XS[0])

    forgets, state = eqx.nn.make_with_state(swe.Stack)(Forgets, 2, key=KEY)
    with pytest.raises(TypeError, match=r"returns `\(x, state\)`.*returned NoneType"):
        forgets(XS[0], state, 1.0)


def test_missing_equinox_gives_an_install_hint():
    code = textwrap.dedent("""
        import sys
        sys.modules["equinox"] = None
        try:
            import stackwise.equinox
        except ImportError as e:
            print(e)
        """)
    # -P: the package that the tests import, never a `stackwise/` source folder in the working
    # directory (`-c` puts it first on the path; run from a checkout whose package is installed
    # from a wheel, as on the TPU host, that folder has no `stackwise.equinox`).
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == (
        "`stackwise.equinox` needs equinox: pip install 'stackwise[equinox]'"
    ), out.stderr


# --------------------------------------------------------------------------
# Varying shapes.


@pytest.mark.slow
@settings(max_examples=5, deadline=None)
@given(n=st.integers(1, 5), d=st.integers(2, 4), batch=st.integers(1, 3), reverse=st.booleans())
def test_shapes_vary(n, d, batch, reverse):
    s = swe.Stack(functools.partial(Block, d), n, key=KEY, reverse=reverse)
    loop = Loop(s.to_layers(), reverse=reverse)
    xs = jax.random.normal(jax.random.key(n), (batch, d))
    value, grads = value_and_grad(s, xs)
    value_loop, grads_loop = value_and_grad(loop, xs)
    assert_trees_close(value, value_loop)
    assert_trees_close(arrays(grads.layers), stacked(grads_loop.blocks))
    assert np.shape(s(xs[0])) == (d,)
