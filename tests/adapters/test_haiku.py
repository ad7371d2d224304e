"""`stackwise.haiku.Stack` against a Python loop of the same blocks and against `hk.layer_stack`."""

from __future__ import annotations

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _programs import on_cpu
from _references import Counted, loop_of
from _trees import assert_trees_close, assert_trees_equal
from hypothesis import given, settings
from hypothesis import strategies as st

import stackwise
import stackwise.haiku as swh

D = 4
KEY = jax.random.key(0)


class Block(hk.Module):
    """A residual MLP layer; `scale` reaches every layer."""

    def __init__(self, d: int = D, name: str | None = None):
        super().__init__(name=name)
        self.d = d

    def __call__(self, x, scale=1.0):
        return x + scale * jnp.tanh(hk.Linear(self.d)(jnp.sin(x)))


def shapes(tree):
    return jax.tree.map(jnp.shape, tree)


def first_key(key):
    """The first `hk.next_rng_key()` of a transform applied with `key`."""
    return hk.transform(hk.next_rng_key).apply({}, key)


def y_and_grads(apply):
    """A jitted ``(params, x) -> (y, (d loss/d params, d loss/d x))``: one compile."""

    def loss_and_y(params, x):
        y = apply(params, x)
        return loss(y), y

    grad = jax.value_and_grad(loss_and_y, argnums=(0, 1), has_aux=True)
    return jax.jit(lambda params, x: (lambda out: (out[0][1], out[1]))(grad(params, x)))


def x_of(shape=(3, D), seed=1):
    return jax.random.normal(jax.random.key(seed), shape)


def loss(y):
    return jnp.sum(jnp.sin(y) ** 2)


# --------------------------------------------------------------------------
# Against a Python loop of the same blocks.

CASES = {
    "n1": dict(n=1),
    "n3": dict(n=3),
    "remat": dict(n=3, remat=True),
    "remat-policy-unroll2": dict(n=4, remat=jax.checkpoint_policies.dots_saveable, unroll=2),
    "remat-python-loop": dict(n=3, remat=True, unroll=True),
    "reverse": dict(n=3, reverse=True),
    "nested": dict(n=5, remat=True, nested=True),
    "nested2-reverse-python-loop": dict(n=5, nested=2, reverse=True, unroll=True),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_forward_and_grad_match_a_python_loop(case):
    n = case["n"]
    stacked = hk.transform(lambda x, s: swh.Stack(Block, **case)(x, scale=s))
    loop = hk.transform(loop_of(Block, n, reverse=case.get("reverse", False)))
    x = x_of()
    params = stacked.init(KEY, x, 0.5)
    assert sorted(params) == ["stack/block/linear"]
    assert params["stack/block/linear"]["w"].shape == (n, D, D)
    loop_params = swh.to_loop(params, "stack/block", "block")
    y, (g_params, g_x) = y_and_grads(lambda p, x: stacked.apply(p, None, x, 0.5))(params, x)
    y_loop, (l_params, l_x) = y_and_grads(lambda p, x: loop.apply(p, None, x, scale=0.5))(
        loop_params, x
    )
    assert_trees_close(y, y_loop)
    assert_trees_close(swh.to_loop(g_params, "stack/block", "block"), l_params)
    assert_trees_close(g_x, l_x)


@pytest.mark.slow
@settings(max_examples=3, deadline=None)
@given(n=st.integers(1, 4), batch=st.integers(1, 3), d=st.integers(2, 3))
def test_shapes_vary(n, batch, d):
    make = functools.partial(Block, d)
    stacked = hk.transform(lambda x: swh.Stack(make, n)(x))
    loop = hk.transform(loop_of(make, n))
    x = x_of((batch, d))
    params = stacked.init(KEY, x)
    y = stacked.apply(params, None, x)
    assert_trees_close(y, loop.apply(swh.to_loop(params, "stack/block", "block"), None, x))


def test_init_equals_a_loop_of_blocks_fed_the_per_layer_keys():
    n = 4
    x = x_of()
    # Both jitted: op by op, at the suite's XLA backend optimisation level 0 (tests/conftest.py),
    # the stacked and the one-layer shapes' sampling can differ in the last bits.
    params = jax.jit(hk.transform(lambda x: swh.Stack(Block, n)(x)).init)(KEY, x)
    one = jax.jit(hk.transform(lambda x: Block()(x)).init)
    keys = jax.random.split(first_key(KEY), n)
    per_layer = [one(k, x) for k in keys]
    expected = {f"stack/{k}": v for k, v in stackwise.stack_layers(per_layer).items()}
    assert_trees_equal(params, expected)
    # Layers differ from each other: the keys are independent.
    w = params["stack/block/linear"]["w"]
    assert not np.allclose(w[0], w[1])


# --------------------------------------------------------------------------
# Against hk.layer_stack.


@pytest.mark.parametrize("reverse", [False, True])
def test_forward_and_grad_match_hk_layer_stack(reverse):
    n = 3
    stacked = hk.transform(lambda x: swh.Stack(Block, n, reverse=reverse)(x))
    layer_stack = hk.transform(
        lambda x: hk.layer_stack(n)(lambda x: Block()(x))(x, reverse=reverse)
    )
    x = x_of()
    ls_params = layer_stack.init(KEY, x)
    params = swh.from_layer_stack(ls_params, "stack")
    assert shapes(params) == shapes(jax.eval_shape(stacked.init, KEY, x))
    y, (g, _) = y_and_grads(lambda p, x: stacked.apply(p, None, x))(params, x)
    y_ls, (g_ls, _) = y_and_grads(lambda p, x: layer_stack.apply(p, None, x))(ls_params, x)
    assert_trees_close(y, y_ls)
    assert_trees_close(swh.to_layer_stack(g, "stack"), g_ls)


# --------------------------------------------------------------------------
# State.


def test_state_matches_a_python_loop_across_applies():
    n = 3
    stacked = hk.transform_with_state(lambda x, t: swh.Stack(Counted, n)(x, is_training=t))
    loop = hk.transform_with_state(loop_of(Counted, n))
    x = x_of((5, D))
    params, state = stacked.init(KEY, x, True)
    assert sorted(state) == [
        "stack/counted",
        "stack/counted/batch_norm/~/mean_ema",
        "stack/counted/batch_norm/~/var_ema",
    ]
    # The initial state is the blocks' own initial state, as in a loop of blocks fed the
    # per-layer keys (not the post-apply state). BatchNorm's `average` is set from each
    # layer's own input, so this also checks that init runs layer by layer.
    one = hk.transform_with_state(lambda x: Counted()(x, is_training=True))
    per_layer, x_i = [], x
    for key in jax.random.split(first_key(KEY), n):
        p_i, s_i = one.init(key, x_i)
        x_i, _ = one.apply(p_i, s_i, None, x_i)
        per_layer.append((p_i, s_i))
    expected = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
    assert_trees_close(
        (params, state), tuple({f"stack/{k}": v for k, v in t.items()} for t in expected)
    )
    assert_trees_equal(state["stack/counted"]["count"], jnp.zeros(n, jnp.int32))

    loop_params = swh.to_loop(params, "stack/counted", "counted")
    loop_state = swh.to_loop(state, "stack/counted", "counted")
    loop_init = functools.partial(loop.init, is_training=True)
    assert sorted(loop_state) == sorted(jax.eval_shape(loop_init, KEY, x)[1])
    apply = jax.jit(stacked.apply, static_argnums=4)
    for step in range(3):
        x_step = x_of((5, D), seed=10 + step)
        y, state = apply(params, state, None, x_step, True)
        y_loop, loop_state = loop.apply(loop_params, loop_state, None, x_step, is_training=True)
        assert_trees_close(y, y_loop)
        assert_trees_close(swh.to_loop(state, "stack/counted", "counted"), loop_state)
    assert_trees_equal(state["stack/counted"]["count"], jnp.full(n, 3, jnp.int32))
    # Evaluation reads the state and leaves it alone.
    y, state_eval = stacked.apply(params, state, None, x, False)
    y_loop, _ = loop.apply(loop_params, loop_state, None, x, is_training=False)
    assert_trees_close(y, y_loop)
    assert_trees_equal(state_eval, state)


@pytest.mark.slow
def test_unnamed_stateful_stacks_in_one_scope_keep_their_own_state():
    def forward(x):
        x = swh.Stack(Counted, 2)(x, is_training=True)
        return swh.Stack(Counted, 3)(x, is_training=True)

    f = hk.transform_with_state(forward)
    x = x_of()
    params, state = f.init(KEY, x)
    assert {k.split("/")[0] for k in params} == {"stack", "stack_1"}
    for _ in range(2):
        _, state = f.apply(params, state, None, x)
    assert_trees_equal(state["stack/counted"]["count"], jnp.full(2, 2, jnp.int32))
    assert_trees_equal(state["stack_1/counted"]["count"], jnp.full(3, 2, jnp.int32))


def test_a_stack_called_twice_shares_params_and_state():
    def forward(x):
        stack = swh.Stack(Counted, 2)
        return stack(stack(x, is_training=True), is_training=True)

    f = hk.transform_with_state(forward)
    once = hk.transform_with_state(lambda x: swh.Stack(Counted, 2)(x, is_training=True))
    x = x_of()
    params, state = f.init(KEY, x)
    assert shapes(params) == shapes(jax.eval_shape(once.init, KEY, x)[0])
    assert_trees_equal(state["stack/counted"]["count"], jnp.zeros(2, jnp.int32))
    y, new_state = f.apply(params, state, None, x)
    y1, s1 = once.apply(params, state, None, x)
    y2, s2 = once.apply(params, s1, None, y1)
    assert_trees_close(y, y2)
    assert_trees_close(new_state, s2)
    assert_trees_equal(new_state["stack/counted"]["count"], jnp.full(2, 2, jnp.int32))


# --------------------------------------------------------------------------
# RNG, layer index, per-layer inputs and outputs, arguments.


class Noisy(hk.Module):
    def __call__(self, x):
        noise = jax.random.uniform(hk.next_rng_key(), x.shape)
        return x + hk.Linear(x.shape[-1])(noise), noise


def test_rng_is_independent_per_layer_and_deterministic():
    n = 3
    f = hk.transform(lambda x: swh.Stack(Noisy, n, has_aux=True)(x))
    x = x_of()
    params = f.init(KEY, x)
    key = jax.random.PRNGKey(7)  # raw uint32 keys work as well as typed ones
    y, noise = f.apply(params, key, x)
    assert noise.shape == (n, *x.shape)
    for i in range(n):
        for j in range(i):
            assert not np.allclose(noise[i], noise[j])
    y_again, noise_again = f.apply(params, key, x)
    assert_trees_equal((y, noise), (y_again, noise_again))
    _, other = f.apply(params, jax.random.PRNGKey(8), x)
    assert not np.allclose(noise, other)
    # Equal to a loop of the block fed split(key, n)[i], as in the core.
    one = hk.transform(lambda x: Noisy()(x))
    per_layer = stackwise.unstack_layers({"noisy/linear": params["stack/noisy/linear"]})
    keys = jax.random.split(first_key(key), n)
    y_loop = x
    for i in range(n):
        y_loop, noise_i = one.apply(per_layer[i], keys[i], y_loop)
        assert_trees_close(noise[i], noise_i)
    assert_trees_close(y, y_loop)


def test_without_rng_blocks_that_need_none_work():
    def block(x):
        b = hk.get_parameter("b", x.shape[-1:], init=jnp.ones)
        return x + b

    f = hk.transform(lambda x: swh.Stack(block, 3)(x))
    params = f.init(None, jnp.zeros(D))
    assert list(params) == ["stack/~"] and params["stack/~"]["b"].shape == (3, D)
    assert_trees_close(f.apply(params, None, jnp.zeros(D)), jnp.full(D, 3.0))


@pytest.mark.parametrize("reverse", [False, True])
def test_layer_index_inside_a_block(reverse):
    def block(x):
        i = swh.layer_index()
        return x * 10 + i, i

    f = hk.transform(lambda x: swh.Stack(block, 4, reverse=reverse, has_aux=True)(x))
    y, indices = f.apply({}, None, jnp.int32(0))
    assert_trees_equal(indices, jnp.arange(4))
    assert int(y) == (3210 if reverse else 123)


def test_per_layer_inputs_keywords_and_static_arguments():
    n = 3
    calls = []

    class Gated(hk.Module):
        def __call__(self, x, gate, *, bias, is_training):
            calls.append(is_training)
            if is_training:  # a Python bool: stays static
                x = x * 2.0
            return x * gate + hk.get_parameter("b", [], init=jnp.zeros) + bias

    gates = jnp.array([1.0, 2.0, 3.0])
    f = hk.transform(
        lambda x, t: swh.Stack(Gated, n)(x, stackwise.per_layer(gates), bias=0.5, is_training=t)
    )
    params = f.init(KEY, 1.0, True)
    for t in (True, False):
        y = f.apply(params, None, 1.0, t)
        expected = 1.0
        for g in gates:
            expected = expected * (2.0 if t else 1.0) * g + 0.5
        assert_trees_close(y, expected)
    assert set(calls) == {True, False}


# --------------------------------------------------------------------------
# Remat, seen in the compiled program (barriers: tests/adapters/test_contract.py).

def test_remat_cuts_the_memory_of_the_backward_pass():
    class Wider(hk.Module):
        def __call__(self, x):
            h = jnp.tanh(hk.Linear(4 * x.shape[-1])(x))
            return x + hk.Linear(x.shape[-1])(jnp.sin(h))

    # XLA:TPU reports no temp bytes for a program whose temporaries are a few MiB (compiled for
    # a v5e: 0 for every variant at 64 x 32, and 18 / 143 MB without remat at n = 8 / 16 and
    # 0 with it at 2048 x 128): off the CPU the activations are that large.
    rows, width = (64, 32) if on_cpu() else (2048, 128)

    def temp_bytes(remat, n=8):
        f = hk.transform(lambda x: swh.Stack(Wider, n, remat=remat)(x))
        x = jax.ShapeDtypeStruct((rows, width), jnp.float32)
        params = jax.eval_shape(f.init, KEY, x)
        grad = jax.jit(jax.grad(lambda p, x: loss(f.apply(p, None, x))))
        return grad.lower(params, x).compile().memory_analysis().temp_size_in_bytes

    # Without remat every layer's hidden activations are kept for the backward pass: with it,
    # what each layer adds to the temporaries (from 8 layers to 16: a backend's fixed buffers
    # cancel, tests/_programs.py) is less than half as much.
    remat, plain = temp_bytes(True), temp_bytes(False)
    assert temp_bytes(True, 16) - remat < 0.5 * (temp_bytes(False, 16) - plain)
    if on_cpu():  # and in XLA:CPU's totals, whose fixed part is small
        assert remat < 0.5 * plain


# --------------------------------------------------------------------------
# Composition: nesting, modules, transforms, names, a transformer-ish block.


class Inner(hk.Module):
    def __call__(self, x):
        return x + jnp.tanh(hk.Linear(x.shape[-1])(x))


class Outer(hk.Module):
    """A block that is itself a Stack of Inner blocks."""

    def __init__(self, stacked=True, name=None):
        super().__init__(name=name)
        self.stacked = stacked

    def __call__(self, x):
        if self.stacked:
            x = swh.Stack(Inner, 2, remat=True)(x)
        else:
            for _ in range(2):
                x = Inner()(x)
        return jnp.cos(hk.Linear(x.shape[-1])(x))


def test_stacks_nest():
    stacked = hk.transform(lambda x: swh.Stack(Outer, 3, remat=True)(x))
    loop = hk.transform(loop_of(functools.partial(Outer, stacked=False), 3))
    x = x_of()
    params = stacked.init(KEY, x)
    shapes = jax.tree.map(jnp.shape, params)
    assert shapes["stack/outer/stack/inner/linear"]["w"] == (3, 2, D, D)
    assert shapes["stack/outer/linear"]["w"] == (3, D, D)

    def to_flat(tree):
        tree = swh.to_loop(tree, "stack/outer", "outer")
        for name in ("outer", "outer_1", "outer_2"):
            tree = swh.to_loop(tree, f"{name}/stack/inner", f"{name}/inner")
        return tree

    loop_params = to_flat(params)
    assert sorted(loop_params) == sorted(jax.eval_shape(loop.init, KEY, x))
    y, (g, _) = y_and_grads(lambda p, x: stacked.apply(p, None, x))(params, x)
    y_loop, (g_loop, _) = y_and_grads(lambda p, x: loop.apply(p, None, x))(loop_params, x)
    assert_trees_close(y, y_loop)
    assert_trees_close(to_flat(g), g_loop)


class Model(hk.Module):
    def __init__(self, name=None):
        super().__init__(name=name)
        self.body = swh.Stack(Block, 2, name="body")

    def __call__(self, x):
        return hk.Linear(2)(swh.Stack(Block, 2)(self.body(x)))


def test_names_are_readable_and_distinct():
    x = x_of()
    params = jax.eval_shape(hk.transform(lambda x: Model()(x)).init, KEY, x)
    assert sorted(params) == [
        "model/linear",
        "model/stack/block/linear",
        "model/~/body/block/linear",
    ]
    kinds = {
        "class": Block,
        "partial": functools.partial(Block, D),
        "factory": lambda: Block(name="layer"),
        "function": lambda x: x + hk.Linear(D)(x),
    }
    names = {
        k: sorted(jax.eval_shape(hk.transform(lambda x, b=b: swh.Stack(b, 2)(x)).init, KEY, x))
        for k, b in kinds.items()
    }
    assert names == {
        "class": ["stack/block/linear"],
        "partial": ["stack/block/linear"],
        "factory": ["stack/layer/linear"],
        "function": ["stack/linear"],
    }


@pytest.mark.slow
def test_under_vmap_and_grad_of_inputs():
    f = hk.transform(lambda x: swh.Stack(Block, 3)(x))
    xs = x_of((4, 3, D))
    params = f.init(KEY, xs[0])
    ys = jax.vmap(f.apply, in_axes=(None, None, 0))(params, None, xs)
    assert_trees_close(ys, jnp.stack([f.apply(params, None, x) for x in xs]))
    # An ensemble: vmap over stacked params of two models.
    both = stackwise.stack_layers([params, jax.tree.map(lambda a: -a, params)])
    ys = jax.vmap(f.apply, in_axes=(0, None, None))(both, None, xs[0])
    assert_trees_close(ys[0], f.apply(params, None, xs[0]))


class TransformerBlock(hk.Module):
    """A tiny pre-norm transformer block: attention and an MLP, with dropout."""

    def __init__(self, heads=2, name=None):
        super().__init__(name=name)
        self.heads = heads

    def __call__(self, x, *, is_training):
        d = x.shape[-1]
        drop = (lambda h: hk.dropout(hk.next_rng_key(), 0.1, h)) if is_training else (lambda h: h)
        h = hk.LayerNorm(-1, True, True)(x)
        attn = hk.MultiHeadAttention(
            self.heads, d // self.heads, w_init=hk.initializers.VarianceScaling()
        )
        x = x + drop(attn(h, h, h))
        h = hk.LayerNorm(-1, True, True)(x)
        h = hk.Linear(d)(jax.nn.gelu(hk.Linear(2 * d)(h)))
        return x + drop(h)


@pytest.mark.slow
def test_a_transformer_block_matches_its_python_loop():
    n = 2
    stacked = hk.transform(
        lambda x, t: swh.Stack(TransformerBlock, n, remat=True)(x, is_training=t)
    )
    loop = hk.transform(loop_of(TransformerBlock, n))
    x = x_of((2, 5, 8))  # batch, time, features
    params = stacked.init(KEY, x, False)
    loop_params = swh.to_loop(params, "stack/transformer_block", "transformer_block")
    loop_init = functools.partial(loop.init, is_training=False)
    assert sorted(loop_params) == sorted(jax.eval_shape(loop_init, KEY, x))
    y, (g, _) = y_and_grads(lambda p, x: stacked.apply(p, None, x, False))(params, x)
    y_loop, (g_loop, _) = y_and_grads(lambda p, x: loop.apply(p, None, x, is_training=False))(
        loop_params, x
    )
    assert_trees_close(y, y_loop)
    # The key projection's bias shifts every score of a query alike, which softmax ignores: its
    # gradient is 0, and what the two programs compute there is rounding noise.
    zero = ("multi_head_attention/key']['b']",)
    g = swh.to_loop(g, "stack/transformer_block", "transformer_block")
    assert_trees_close(g, g_loop, zero=zero)
    # Training: dropout draws a different mask per key.
    train = jax.jit(lambda key: stacked.apply(params, key, x, True))
    y1, y2 = train(jax.random.key(1)), train(jax.random.key(2))
    assert y1.shape == x.shape and not np.allclose(y1, y2)


# --------------------------------------------------------------------------
# Errors name the block.


def _init(make_stack, *args, x=None, **kwargs):
    x = x_of() if x is None else x
    return jax.eval_shape(hk.transform(lambda x: make_stack()(x, *args, **kwargs)).init, KEY, x)


class NotAModule:
    pass


def _shrink(x):
    return x[..., :2]


def _to_half(x):
    return x.astype(jnp.float16)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: swh.Stack(5, 2), TypeError, r"Stack\(int, n=2\).*`block` must be.*got int 5"),
        (lambda: swh.Stack(Block(), 2), TypeError, r"Stack\(Block, n=2\).*instance.*pass `Block`"),
        (lambda: swh.Stack(NotAModule, 2), TypeError, r"got the class NotAModule"),
        (lambda: swh.Stack(hk.Linear, 2), TypeError, r"constructor arguments.*functools.partial"),
        (lambda: swh.Stack(Block, 0), ValueError, r"Stack\(Block, n=0\).*at least 1"),
        (lambda: swh.Stack(Block, 2.0), TypeError, r"Stack\(Block, n=2.0\).*Python int"),
        (lambda: swh.Stack(Block, 2, remat="yes"), TypeError, r"Stack\(Block, n=2\).*`remat`"),
        (
            lambda: swh.Stack(_shrink, 2),
            TypeError,
            r"Stack\(_shrink, n=2\).*carry leaf `x` from float32\[3, 4\] to float32\[3, 2\]",
        ),
        (lambda: swh.Stack(_to_half, 2), TypeError, r"Stack\(_to_half, n=2\).*cast it back"),
    ],
    ids=[
        "not-callable",
        "instance",
        "class",
        "needs-args",
        "n0",
        "n-float",
        "remat",
        "carry-shape",
        "carry-dtype",
    ],
)
def test_bad_blocks_are_named(make, error, match):
    with pytest.raises(error, match=match):
        _init(make)


def test_an_unknown_keyword_names_the_block():
    with pytest.raises(TypeError, match=r"Stack\(Block, n=2\).*unexpected keyword.*'shift'"):
        _init(lambda: swh.Stack(Block, 2), shift=1.0)


def test_per_layer_inputs_of_the_wrong_depth_name_the_block():
    bad = stackwise.per_layer(jnp.ones(3))
    with pytest.raises(ValueError, match=r"(?s)Stack\(Block, n=2\).*argument \*args\[0\].*n=2"):
        _init(lambda: swh.Stack(Block, 2), bad)


def test_stacked_params_of_the_wrong_depth_name_the_block_and_the_leaf():
    x = x_of()
    params = jax.eval_shape(hk.transform(lambda x: swh.Stack(Block, 3)(x)).init, KEY, x)
    deeper = hk.transform(lambda x: swh.Stack(Block, 4)(x))
    expected = r"(?s)Stack\(Block, n=4\).*n=4.*stack/block/linear/w: shape \(3, 4, 4\)"
    with pytest.raises(ValueError, match=expected):
        jax.eval_shape(deeper.apply, params, None, x)


# --------------------------------------------------------------------------
# Patterns (outputs and grads against the loop: tests/adapters/test_contract.py).


def test_a_patterns_params_are_named_as_one_call_of_its_blocks_would_name_them():
    class LocalBlock(hk.Module):
        def __call__(self, x):
            return x + jnp.tanh(hk.Linear(D)(x))

    class GlobalBlock(LocalBlock):
        pass

    def sandwich(x):  # one call of the k blocks, in order: the names the Stack keeps
        for block in (LocalBlock, LocalBlock, GlobalBlock):
            x = block()(x)
        return x

    stack = hk.transform(lambda x: swh.Stack([LocalBlock, LocalBlock, GlobalBlock], n=26)(x))
    params = stack.init(KEY, x_of())
    expected = hk.transform(sandwich).init(KEY, x_of())
    assert sorted(params) == sorted(f"stack/{name}" for name in expected)
    assert sorted(params) == [
        "stack/global_block/linear",
        "stack/local_block/linear",
        "stack/local_block_1/linear",
    ]
    depths = {name: leaves["w"].shape[0] for name, leaves in params.items()}
    assert depths == {  # layers p, p + 3, ...: 9, 9 and 8 of 26
        "stack/local_block/linear": 9,
        "stack/local_block_1/linear": 9,
        "stack/global_block/linear": 8,
    }


def test_a_pattern_of_function_blocks_names_each_after_its_function():
    def local(x):
        return x + jnp.tanh(hk.Linear(D)(x))

    def wide(x):
        return x + hk.Linear(D)(jnp.tanh(hk.Linear(2 * D)(x)))

    f = hk.transform(lambda x: swh.Stack([local, wide], n=5)(x))
    params = f.init(KEY, x_of())
    assert sorted(params) == ["stack/local/linear", "stack/wide/linear", "stack/wide/linear_1"]
    assert params["stack/local/linear"]["w"].shape == (3, D, D)
    assert f.apply(params, None, x_of()).shape == x_of().shape
