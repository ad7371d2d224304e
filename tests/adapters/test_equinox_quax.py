"""quax LoRA (`quax.examples.lora.loraify`) on `stackwise.equinox.Stack`, against a Python loop
of the same blocks, each loraified on its own and called through `quax.quaxify`: outputs and
the LoRA params' gradients (`eqx.filter_grad`) under every remat, with an eqx.nn.State and with
a pattern; per-layer adapters kept stacked. (That quax loads only when used:
tests/package/test_import.py.)"""

from __future__ import annotations

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
from stackwise.equinox import _quax

quax = pytest.importorskip("quax")
from quax.examples.lora import LoraArray, loraify  # noqa: E402

D, N, R = 8, 4, 2
KEY = jax.random.key(0)
X = jax.random.normal(jax.random.key(1), (D,))
REMATS = {"default": stackwise.DEFAULT_REMAT, "none": False, "full": True}
is_lora = lambda v: isinstance(v, LoraArray)  # noqa: E731


class Block(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, d: int = D, *, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(d, 2 * d, key=k1)
        self.down = eqx.nn.Linear(2 * d, d, key=k2)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))


class Counted(eqx.Module):
    """A block with an eqx.nn.State entry: the sum of the inputs it has seen."""

    linear: eqx.nn.Linear
    seen: eqx.nn.StateIndex

    def __init__(self, *, key):
        self.linear = eqx.nn.Linear(D, D, key=key)
        self.seen = eqx.nn.StateIndex(jnp.zeros(D))

    def __call__(self, x, state):
        state = state.set(self.seen, state.get(self.seen) + x)
        return jnp.tanh(self.linear(x)) + x, state


class Scale(eqx.Module):
    s: jax.Array

    def __init__(self, *, key):
        self.s = 1.0 + jax.random.normal(key, (D,)) / 10

    def __call__(self, x):
        return x * self.s


def _trained(tree):
    """LoRA arrays as if trained: `b` (zero from loraify) made nonzero, so they matter."""
    def bump(v):
        if not is_lora(v):
            return v
        nudge = 0.1 * jnp.cos(jnp.arange(v.b.size)).reshape(v.b.shape)
        return eqx.tree_at(lambda lora: lora.b, v, v.b + nudge)
    return jax.tree.map(bump, tree, is_leaf=is_lora)


def _lora_blocks(make, n=N, **options):
    """n blocks, each loraified on its own (its own key)."""
    keys = jax.random.split(KEY, n)
    lora_keys = jax.random.split(jax.random.key(7), n)
    return [_trained(loraify(make(key=k), rank=R, key=lk, **options))
            for k, lk in zip(keys, lora_keys)]


def _loop(blocks, x):
    for block in blocks:
        x = quax.quaxify(block)(x)
    return x


def _lora_grads(tree):
    """Each LoraArray's `a` and `b` (the LoRA params, or their gradients), in tree order."""
    return [(v.a, v.b) for v in jax.tree.leaves(tree, is_leaf=is_lora) if is_lora(v)]


_stack_lora_grads = _lora_grads


def _loss(model, x):
    return jnp.sum(jnp.sin(model(x)))


# --------------------------------------------------------------------------
# Shapes: loraify of the stacked module gives stacked per-layer adapters.


def test_loraify_of_a_stack_gives_each_layer_its_own_adapter():
    stack = swe.Stack(Block, n=N, key=KEY)
    lora = loraify(stack, rank=R, key=jax.random.key(3))
    weight = lora.layers.up.weight
    assert is_lora(weight)
    shapes = (weight.a.shape, weight.b.shape, weight.w.shape)
    assert shapes == ((N, 2 * D, R), (N, R, D), (N, 2 * D, D))
    assert not any(np.allclose(weight.a[0], weight.a[i]) for i in range(1, N))
    # Layer i of the stack is the block with layer i's adapter: to_layers slices it.
    layer = lora.to_layers()[2]
    assert_trees_equal((layer.up.weight.a, layer.up.weight.b), (weight.a[2], weight.b[2]))


# --------------------------------------------------------------------------
# Outputs and LoRA gradients against the loop, under every remat.


@pytest.mark.parametrize("remat", list(REMATS.values()), ids=list(REMATS))
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_stack_of_loraified_blocks_equals_the_loop(remat, jit):
    blocks = _lora_blocks(Block)
    stack = swe.Stack.from_layers(blocks, remat=remat)
    assert stack.layers.up.weight.a.shape == (N, 2 * D, R)
    wrap = eqx.filter_jit if jit else (lambda f: f)
    y = wrap(lambda m, x: m(x))(stack, X)
    assert_trees_close(y, _loop(blocks, X))
    grads = wrap(eqx.filter_grad(_loss))(stack, X)
    loop_grads = eqx.filter_grad(lambda bs, x: jnp.sum(jnp.sin(_loop(bs, x))))(blocks, X)
    want = [tuple(jnp.stack(g) for g in zip(*pair)) for pair in zip(
        *[_lora_grads(g) for g in loop_grads])]
    got = _stack_lora_grads(grads)
    assert len(got) == 2
    assert_trees_close(got, want)
    assert float(jnp.abs(got[0][0]).sum()) > 0  # the adapters are trained


@pytest.mark.slow
@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 5), d=st.sampled_from([3, 8]), rank=st.integers(1, 3),
       remat=st.sampled_from(list(REMATS.values())))
def test_shapes_vary(n, d, rank, remat):
    keys = jax.random.split(KEY, n)
    blocks = [_trained(loraify(eqx.nn.Linear(d, d, key=k), rank=rank, key=k)) for k in keys]
    stack = swe.Stack.from_layers(blocks, remat=remat)
    assert stack.layers.weight.a.shape == (n, d, rank)
    x = jnp.linspace(-1.0, 1.0, d)
    assert_trees_close(stack(x), _loop(blocks, x))
    grads = eqx.filter_grad(_loss)(stack, x)
    loop_grads = eqx.filter_grad(lambda bs, x: jnp.sum(jnp.sin(_loop(bs, x))))(blocks, x)
    want = [tuple(jnp.stack(g) for g in zip(*pair))
            for pair in zip(*[_lora_grads(g) for g in loop_grads])]
    assert_trees_close(_lora_grads(grads), want)


def test_loraify_of_the_built_stack_equals_its_layers_run_in_a_loop():
    stack = _trained(loraify(swe.Stack(Block, n=N, key=KEY), rank=R, key=jax.random.key(3)))
    assert_trees_close(stack(X), _loop(stack.to_layers(), X))


def test_nested_remat_and_reverse():
    blocks = _lora_blocks(Block)
    stack = swe.Stack.from_layers(blocks, nested=2, reverse=True)
    assert_trees_close(stack(X), _loop(blocks[::-1], X))


# --------------------------------------------------------------------------
# With an eqx.nn.State, and with a pattern.


def test_stateful_blocks_with_lora():
    made = [eqx.nn.make_with_state(Counted)(key=k) for k in jax.random.split(KEY, N)]
    blocks = [_trained(loraify(b, rank=R, key=jax.random.key(i))) for i, (b, _) in enumerate(made)]
    states = [s for _, s in made]
    stack, state = swe.Stack.from_layers(blocks, states)
    y, state = eqx.filter_jit(lambda m, x, s: m(x, s))(stack, X, state)
    y_loop, states_loop = X, []
    for block, s in zip(blocks, states):
        y_loop, s = quax.quaxify(block)(y_loop, s)
        states_loop.append(s)
    assert_trees_close(y, y_loop)
    _, per_layer = stack.to_layers(state)
    seen = [s.get(b.seen) for b, s in zip(blocks, per_layer)]
    assert_trees_close(seen, [s.get(b.seen) for b, s in zip(blocks, states_loop)])


@pytest.mark.slow  # (a variant: the fast tier has the plain stack's)
def test_pattern_with_lora_on_one_position():
    kinds = [Block, Scale]
    keys = jax.random.split(KEY, 5)
    blocks = [kinds[i % 2](key=k) for i, k in enumerate(keys)]
    blocks = [_trained(loraify(b, rank=R, key=jax.random.key(i))) for i, b in enumerate(blocks)]
    stack = swe.Stack.from_layers(blocks, pattern=2)
    assert is_lora(stack.layers[0].up.weight) and stack.layers[0].up.weight.a.shape[0] == 3
    assert_trees_close(stack(X), _loop(blocks, X))
    grads = eqx.filter_grad(_loss)(stack, X)
    loop_grads = eqx.filter_grad(lambda bs, x: jnp.sum(jnp.sin(_loop(bs, x))))(blocks, X)
    want = [tuple(jnp.stack(g) for g in zip(*pair))
            for pair in zip(*[_lora_grads(g) for g in loop_grads[0::2]])]
    assert_trees_close(_stack_lora_grads(grads.layers[0]), want)


# --------------------------------------------------------------------------
# Inside a model: stackwise.equinox.quaxify, and quax's own quaxify.


class Model(eqx.Module):
    blocks: swe.Stack
    head: eqx.nn.Linear

    def __call__(self, x):
        return self.head(self.blocks(x))


def _model(remat=stackwise.DEFAULT_REMAT, **options):
    blocks = _lora_blocks(Block, **options)
    head = _trained(loraify(eqx.nn.Linear(D, 3, key=jax.random.key(5)), rank=R, key=KEY))
    return Model(swe.Stack.from_layers(blocks, remat=remat), head), blocks, head


def test_quaxify_of_a_model_runs_the_stack_and_the_rest():
    model, blocks, head = _model()
    y = eqx.filter_jit(swe.quaxify(model))(X)
    assert_trees_close(y, quax.quaxify(head)(_loop(blocks, X)))
    # A loss quaxified whole (the model as its argument), differentiated.
    loss = swe.quaxify(lambda m, x: jnp.sum(jnp.sin(m(x))))
    grads = eqx.filter_jit(eqx.filter_grad(loss))(model, X)
    loop_grads = eqx.filter_grad(
        lambda hb, x: jnp.sum(jnp.sin(quax.quaxify(hb[0])(_loop(hb[1], x)))))((head, blocks), X)
    want = [_lora_grads(loop_grads[0])[0]] + [
        tuple(jnp.stack(g) for g in zip(*pair))
        for pair in zip(*[_lora_grads(g) for g in loop_grads[1]])]
    got = _lora_grads(grads.head) + _lora_grads(grads.blocks)
    assert_trees_close(got, want)


def test_quax_quaxify_around_the_stack_works_without_remat_and_is_refused_with_it():
    model, blocks, head = _model(remat=False)
    assert_trees_close(quax.quaxify(model)(X), quax.quaxify(head)(_loop(blocks, X)))
    model, _, _ = _model()
    with pytest.raises(TypeError, match=r"stackwise.equinox.quaxify\(model\)\(x\)"):
        quax.quaxify(model)(X)
    # LoraArrays that allow materialising run under quax's own quaxify, materialised per layer.
    model, blocks, head = _model(allow_materialise=True)
    assert_trees_close(quax.quaxify(model)(X), quax.quaxify(head)(_loop(blocks, X)))


# The one tie to quax's internals (adapters/equinox/_quax.py): it holds with the installed
# quax; with a name moved, quax's own quaxify around a rematted Stack is refused naming both
# releases (and stackwise.equinox.quaxify, which needs no tie, still runs).


def test_the_quax_tie_holds_with_the_installed_quax():
    _quax._probed.cache_clear()
    found = _quax.tie()  # raises QuaxChanged if quax changed
    assert found == (quax._trace._QuaxTracer, quax._values._DenseArrayValue)


@pytest.mark.parametrize("moved", ["tracer", "tie"])
def test_a_moved_quax_name_is_refused_naming_both_releases(monkeypatch, moved):
    model, blocks, head = _model()
    if moved == "tracer":  # as if quax had renamed its tracer
        monkeypatch.setitem(_quax.NAMES, "tracer", ("quax._trace", "_Moved"))
        detail = "its probe raised AttributeError: .*_Moved"
    else:  # as if a plain array's tracer held another type: the probe sees it does not
        monkeypatch.setitem(_quax.NAMES, "dense", ("quax", "ArrayValue"))
        detail = "quaxify passed"
    _quax._probed.cache_clear()
    try:
        message = rf"written against quax {_quax.QUAX_MIRRORS}; quax {quax.__version__} .*{detail}"
        with pytest.raises(_quax.QuaxChanged, match=message):
            quax.quaxify(model)(X)
        assert_trees_close(swe.quaxify(model)(X), quax.quaxify(head)(_loop(blocks, X)))
    finally:
        monkeypatch.undo()
        _quax._probed.cache_clear()


# --------------------------------------------------------------------------
# The adapters stay stacked: through an optimizer step, the conversions and a bad layer axis.


def test_lora_params_stay_stacked_through_training_and_conversions():
    stack = swe.Stack.from_layers(_lora_blocks(Block))
    trainable = _stack_lora_grads  # the adapters' (a, b), as the gradients hold them
    tx = optax.sgd(0.1)
    state = tx.init(trainable(stack))
    grads = eqx.filter_grad(_loss)(stack, X)
    updates, _ = tx.update(_stack_lora_grads(grads), state)
    new = optax.apply_updates(trainable(stack), updates)
    stack = eqx.tree_at(
        lambda s: (s.layers.up.weight.a, s.layers.up.weight.b,
                   s.layers.down.weight.a, s.layers.down.weight.b),
        stack, (*new[0], *new[1]))
    assert stack.layers.up.weight.a.shape == (N, 2 * D, R)
    back = swe.Stack.from_layers(stack.to_layers())
    assert_trees_equal(eqx.filter(back, eqx.is_array), eqx.filter(stack, eqx.is_array))
    assert_trees_close(stack(X), _loop(stack.to_layers(), X))


def test_an_adapter_without_the_layer_axis_is_refused():
    stack = swe.Stack(Block, n=N, key=KEY)
    one = loraify(stack[0].up, rank=R, key=KEY).weight  # one layer's adapter, put whole
    bad = eqx.tree_at(lambda s: s.layers.up.weight, stack, one)
    with pytest.raises(ValueError, match=r"layers\.up\.weight\._w"):
        bad(X)
